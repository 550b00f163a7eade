"""The decoder at realistic shapes on a GPU: roofline, efficiency, ours vs HF assisted, batches.

    python -m specdistill.decode.bench.gpu --out DIR [--preset tinyllama] [--batches 1 4 16]

Random weights are fine for speed (bytes per token do not depend on values), but a random
drafter never agrees with a random target, so the drafter is the target's first
`--draft-layers` layers (a layer-skip drafter) and every residual branch is scaled so that
greedy agreement is near `--alpha` (speed does not depend on the scale). Reported side by side:
copy bandwidth and the batch-1 roofline, our target-only decode against it, speculative alpha,
tau, c, verify cost, measured and modeled speedup, graphs compiled after warm-up (must be 0),
`transformers` generate() with and without an assistant, and larger batches.

Results go to DIR/bench_gpu.json after every section, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from specdistill.data.io import atomic_write_json
from specdistill.decode.draft_length.costs import DraftCosts, speedup_at
from specdistill.decode.speculative import DecodeOutput, DecoderConfig, SpeculativeDecoder
from specdistill.decode.validate.engines.hf_assisted import hf_assisted_speed
from specdistill.decode.validate.modes import merge
from specdistill.decode.validate.timing import step_costs

# Llama-shaped presets: (vocab, hidden, intermediate, layers, heads, kv heads).
PRESETS = {
    "tinyllama": (32000, 2048, 5632, 22, 32, 4),  # TinyLlama-1.1B
    "llama3-1b": (128256, 2048, 8192, 16, 32, 8),  # Llama-3.2-1B (untied here)
    "llama3-8b": (128256, 4096, 14336, 32, 32, 8),  # Llama-3.1-8B
    "tiny": (512, 64, 128, 4, 4, 2),  # smoke test on any machine
}


def build_pair(preset: str, draft_layers: int, device: str, dtype: torch.dtype, seed: int):
    """Random target of the preset's shape and its layer-skip drafter (shared weights copied)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab, hidden, inter, layers, heads, kv = PRESETS[preset]

    def config(n: int) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
            bos_token_id=None,
            eos_token_id=None,
            pad_token_id=0,
        )

    torch.manual_seed(seed)
    with torch.device(device):
        target = LlamaForCausalLM(config(layers)).to(dtype).eval()
        drafter = LlamaForCausalLM(config(draft_layers)).to(dtype).eval()
    drafter.load_state_dict(target.state_dict(), strict=False)
    for m in (target, drafter):
        m.generation_config.pad_token_id = 0
    return target, drafter


@torch.inference_mode()
def set_residual_scale(target, drafter, scale: float, base: dict[str, torch.Tensor]) -> None:
    """o_proj and down_proj = scale x their initial values, in both models alike."""
    for model in (target, drafter):
        for name, p in model.named_parameters():
            if name in base:
                p.copy_(base[name] * scale)


@torch.inference_mode()
def greedy_agreement(target, drafter, ids: torch.Tensor) -> float:
    """Share of positions of a random context where the two models' argmax agree."""
    return float(
        (target(ids).logits.argmax(-1) == drafter(ids).logits.argmax(-1)).float().mean().item()
    )


def calibrate(target, drafter, ids: torch.Tensor, alpha: float) -> tuple[float, list]:
    """The residual scale (from a fixed ladder) whose greedy agreement is nearest `alpha`."""
    base = {
        n: p.detach().clone()
        for n, p in target.named_parameters()
        if n.endswith(("o_proj.weight", "down_proj.weight"))
    }
    ladder = [1.0, 0.1, 0.03, 0.01, 0.005, 0.003, 0.002, 0.001, 5e-4, 2e-4, 1e-4]
    seen = []
    for s in ladder:
        set_residual_scale(target, drafter, s, base)
        seen.append((s, round(greedy_agreement(target, drafter, ids), 3)))
    best = min(seen, key=lambda t: abs(t[1] - alpha))[0]
    set_residual_scale(target, drafter, best, base)
    return best, seen


def copy_bandwidth(device: str, gib: float = 2.0) -> float:
    """Device-to-device copy, bytes read + written per second (median of 10)."""
    if not device.startswith("cuda"):
        return float("nan")
    n = int(gib * 2**30) // 2
    x = torch.randn(n, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y.copy_(x)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    del x, y
    torch.cuda.empty_cache()
    return 2 * n * 2 / statistics.median(times)


def step_bytes(model, context: float, batch: int = 1) -> float:
    """Bytes one decode step must read: every weight but the embedding table (one row per
    token), plus K and V of `context` positions per row."""
    cfg = model.config
    emb = model.get_input_embeddings().weight
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    weights -= emb.numel() * emb.element_size()
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * emb.element_size()
    return weights + batch * context * kv


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def graphs_compiled() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def timed(fn, batches, device: str) -> tuple[float, DecodeOutput]:
    """Tokens/s over all batches, and their outputs merged (tokens and acceptance counters)."""
    sync(device)
    t0 = time.perf_counter()
    outs = [fn(ids) for ids in batches]
    sync(device)
    merged = merge(outs)
    n = sum(len(t) for t in merged.tokens)
    return n / (time.perf_counter() - t0), merged


def bench_batch(target, drafter, args, batch: int, device: str) -> dict[str, Any]:
    """Target-only vs speculative at one batch size, compile and recompiles counted apart."""
    g = torch.Generator().manual_seed(batch)
    vocab = target.config.vocab_size
    prompts = [
        torch.randint(1, vocab, (batch, args.prompt_len), generator=g).to(device)
        for _ in range(args.prompts)
    ]
    dec = SpeculativeDecoder(
        target, drafter, DecoderConfig(gamma=args.gamma, max_new_tokens=args.new_tokens)
    )
    row: dict[str, Any] = {"batch": batch, "compiled": dec.compile, "static": dec.static}
    graphs0, t0 = graphs_compiled(), time.perf_counter()
    if batch == 1:
        dec.warm_up(prompts[0])
    for fn in (dec.baseline, dec.generate):  # compiles any remaining step shape
        fn(prompts[0])
    sync(device)
    row["compile_and_warmup_s"] = round(time.perf_counter() - t0, 1)
    row["graphs_compiled_in_warmup"] = graphs_compiled() - graphs0
    graphs1 = graphs_compiled()
    base, spec = [], []
    for _ in range(args.repeats):
        base.append(timed(dec.baseline, prompts, device))
        spec.append(timed(dec.generate, prompts, device))
    row["graphs_compiled_while_timed"] = graphs_compiled() - graphs1
    b = statistics.median(r for r, _ in base)
    s = statistics.median(r for r, _ in spec)
    out_b, out_s = base[0][1], spec[0][1]
    same = sum(x == y for x, y in zip(out_b.tokens, out_s.tokens))
    row |= {
        "baseline_tokens_per_s": round(b, 1),
        "speculative_tokens_per_s": round(s, 1),
        "speedup": round(s / b, 3),
        "alpha": round(out_s.alpha, 4),
        "tau": round(out_s.tau, 3),
        "rows_token_identical": f"{same}/{len(out_b.tokens)}",
    }
    if batch == 1:
        each = SpeculativeDecoder(
            target,
            drafter,
            DecoderConfig(gamma=args.gamma, max_new_tokens=args.new_tokens, host_sync_every=1),
        )
        each.baseline(prompts[0])
        rate = statistics.median(timed(each.baseline, prompts, device)[0] for _ in range(2))
        row["baseline_sync_every_step_tokens_per_s"] = round(rate, 1)
        slots = dec.spec_slots(1, args.prompt_len)
        c, verify = step_costs(dec, prompts[0], args.c_iters, args.gamma, slots=slots)
        costs = DraftCosts(c=c, verify_per_token=max(verify - 1, 0) / args.gamma)
        theory = speedup_at(out_s.acceptance_at(), args.gamma, costs)
        ctx = args.prompt_len + args.new_tokens / 2
        roof = args.bandwidth / step_bytes(target, ctx)
        row |= {
            "c": round(c, 4),
            "verify_cost": round(verify, 3),
            "theoretical_speedup": round(theory, 3),
            "decoder_efficiency": round(s / b / theory, 3),
            "roofline_tokens_per_s": round(roof, 1),
            "baseline_share_of_roofline": round(b / roof, 3),
        }
        row["graphs_compiled_total"] = graphs_compiled() - graphs0
    return row


@torch.inference_mode()
def fp32_lossless(target, drafter, args, device: str) -> dict[str, Any]:
    """In fp32, ours (speculative and target-only, compiled steps) against `transformers`'
    own greedy generate() on the same prompts: token-identical rows."""
    target.float(), drafter.float()
    g = torch.Generator().manual_seed(11)
    n = args.fp32_check
    rows = [
        torch.randint(1, target.config.vocab_size, (1, args.prompt_len), generator=g)
        for _ in range(n)
    ]
    dec = SpeculativeDecoder(target, drafter, DecoderConfig(gamma=args.gamma, max_new_tokens=64))
    same_spec = same_base = 0
    for ids in rows:
        ids = ids.to(device)
        ref = target.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=64, do_sample=False
        )[0, ids.shape[1] :].tolist()
        same_spec += dec.generate(ids).tokens[0] == ref
        same_base += dec.baseline(ids).tokens[0] == ref
    return {
        "speculative_equals_hf_greedy": f"{same_spec}/{n}",
        "baseline_equals_hf_greedy": f"{same_base}/{n}",
    }


def bench_hf(target, drafter, args, ours: float) -> dict[str, Any]:
    """transformers' generate() alone and with assistant_model= on batch-1 prompts."""
    g = torch.Generator().manual_seed(7)
    vocab = target.config.vocab_size
    rows = [
        (torch.randint(1, vocab, (1, args.prompt_len), generator=g), None)
        for _ in range(args.hf_prompts)
    ]
    batches = [(ids, torch.ones_like(ids)) for ids, _ in rows]
    cfg = DecoderConfig(gamma=args.gamma, max_new_tokens=args.new_tokens)
    tok = SimpleNamespace(pad_token_id=0)
    hf = hf_assisted_speed(target, drafter, tok, batches[:1], batches, cfg, 1, None)
    hf["ours_speculative_over_hf_assisted"] = round(ours / hf["assisted_tokens_per_s"]["median"], 2)
    return hf


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tinyllama")
    ap.add_argument("--draft-layers", type=int, default=1)
    ap.add_argument("--alpha", type=float, default=0.8, help="greedy agreement to calibrate to")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--hf-prompts", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--c-iters", type=int, default=20)
    ap.add_argument("--batches", type=int, nargs="+", default=[1])
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--fp32-check", type=int, default=0, help="prompts for the fp32 check (last)")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    result["device"] = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    result["versions"] = {"torch": torch.__version__}

    def save(section: str, value: Any) -> None:
        result[section] = value
        atomic_write_json(args.out / "bench_gpu.json", result)
        print(f"[{section}] {json.dumps(value)}", flush=True)

    import transformers

    result["versions"]["transformers"] = transformers.__version__
    args.bandwidth = copy_bandwidth(device)
    save("copy_bandwidth_GBps", round(args.bandwidth / 1e9, 1))
    target, drafter = build_pair(args.preset, args.draft_layers, device, dtype, seed=0)
    params = {
        m: round(sum(p.numel() for p in x.parameters()) / 1e6, 1)
        for m, x in (("target_M", target), ("drafter_M", drafter))
    }
    ids = torch.randint(1, target.config.vocab_size, (4, 256), generator=torch.Generator())
    scale, ladder = calibrate(target, drafter, ids.to(device), args.alpha)
    save("pair", params | {"residual_scale": scale, "agreement_by_scale": ladder})
    rows = []
    for batch in args.batches:
        rows.append(bench_batch(target, drafter, args, batch, device))
        save("batches", rows)
        if batch == 1 and not args.no_hf:
            ours = rows[-1]["speculative_tokens_per_s"]
            save("hf", bench_hf(target, drafter, args, ours))
    if args.fp32_check:
        save("fp32_lossless", fp32_lossless(target, drafter, args, device))
    print(markdown(result), flush=True)
    (args.out / "bench_gpu.md").write_text(markdown(result))
    return result


def markdown(result: dict[str, Any]) -> str:
    """Batch sizes as columns, figures as rows."""
    rows = result.get("batches", [])
    keys = [k for k in (rows[0] if rows else {}) if k != "batch"]
    lines = [
        f"device {result['device']}, copy bandwidth {result.get('copy_bandwidth_GBps')} GB/s, "
        f"pair {result.get('pair', {}).get('target_M')}M / {result.get('pair', {}).get('drafter_M')}M",
        "",
        "| figure | " + " | ".join(f"batch {r['batch']}" for r in rows) + " |",
        "|---|" + "---|" * len(rows),
        *[f"| {k} | " + " | ".join(str(r.get(k)) for r in rows) + " |" for k in keys],
    ]
    hf = result.get("hf")
    if hf:
        lines += [
            "",
            f"HF generate {hf['generate_tokens_per_s']['median']} tok/s, assisted "
            f"{hf['assisted_tokens_per_s']['median']} tok/s ({hf['speedup']}x); ours / HF "
            f"assisted {hf['ours_speculative_over_hf_assisted']}x",
        ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
