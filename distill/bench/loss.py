"""Benchmark: training throughput and peak memory with and without the chunked loss.

    python -m specdistill.distill.bench.loss --vocab 128256 --batch 2 --seq 256 --steps 3

A large vocabulary with a small hidden size (fits a CPU) is where the loss dominates: the
unchunked loss materialises several fp32 [batch, seq, vocab] tensors (both log-softmaxes,
their exps, the products and their gradients) at once; the chunked one holds one chunk's worth.
Each variant runs in its own fresh process so peak memory is not shared between them (CPU: peak
RSS above the post-setup baseline; CUDA: max allocated), and both are printed side by side.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch


def _model(vocab: int, hidden: int, seed: int, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
        max_position_embeddings=4096, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).to(device)


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def measure(args: argparse.Namespace, chunk: int | None) -> dict:
    """One variant: a few optimizer steps of drafter training against a frozen target."""
    from specdistill.distill.losses import distill_loss

    dev = args.device
    torch.set_num_threads(args.threads)
    drafter = _model(args.vocab, args.hidden, 0, dev).train()
    target = _model(args.vocab, args.hidden, 1, dev).eval().requires_grad_(False)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(dev)
    mask = torch.ones(args.batch, args.seq, dtype=torch.bool, device=dev)
    mask[:, : args.seq // 4] = False  # the prompt part

    def step() -> float:
        with torch.no_grad():
            t_logits = target(input_ids=ids).logits
        logits = drafter(input_ids=ids).logits
        loss = distill_loss(logits, mask, target_logits=t_logits, divergence=args.loss,
                            chunk_size=chunk)  # fmt: skip
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss)

    step()  # warm-up (allocator, optimizer state)
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    base = _rss_mb()
    t0 = time.perf_counter()
    losses = [step() for _ in range(args.steps)]
    if dev == "cuda":
        torch.cuda.synchronize()
    secs = time.perf_counter() - t0
    if dev == "cuda":
        peak, kind = torch.cuda.max_memory_allocated() / 2**20, "cuda_max_allocated_mb"
    else:
        peak, kind = (
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base,
            "cpu_peak_rss_above_baseline_mb",
        )
    tokens = int(mask.sum()) * args.steps
    return {
        "variant": "unchunked" if chunk is None else f"chunked({chunk})",
        "tokens_per_s": round(tokens / secs, 1),
        "step_seconds": round(secs / args.steps, 3),
        "peak_memory_mb": round(peak, 1),
        "memory_kind": kind,
        "final_loss": losses[-1],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=32)
    ap.add_argument("--loss", default="fkl")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--one", choices=["chunked", "unchunked"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print(json.dumps(measure(args, args.chunk if args.one == "chunked" else None)))
        return
    rows = []
    for variant in ("unchunked", "chunked"):  # fresh process each: independent peak memory
        cmd = [sys.executable, "-m", "specdistill.distill.bench.loss", "--one", variant]
        cmd += [a for a in sys.argv[1:]]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"vocab={args.vocab} hidden={args.hidden} batch={args.batch} seq={args.seq} "
          f"loss={args.loss} device={args.device} steps={args.steps}")  # fmt: skip
    print(f"{'variant':<14} {'tokens/s':>10} {'s/step':>8} {'peak MB':>9}  memory")
    for r in rows:
        print(f"{r['variant']:<14} {r['tokens_per_s']:>10} {r['step_seconds']:>8} "
              f"{r['peak_memory_mb']:>9}  {r['memory_kind']}")  # fmt: skip
    same = abs(rows[0]["final_loss"] - rows[1]["final_loss"]) <= 1e-4 * abs(rows[0]["final_loss"])
    print(f"same loss: {same} ({rows[0]['final_loss']:.6f} vs {rows[1]['final_loss']:.6f})")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
