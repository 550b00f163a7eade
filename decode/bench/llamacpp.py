"""llama.cpp beside our decoder: the same drafters, prompts (as token ids) and K, side by side.

    python -m specdistill.decode.bench.llamacpp --target T.gguf \\
        --drafter base=BASE.gguf --drafter distilled=DIST.gguf --k 1 2 3 4 --p-min 0 0.5

For each drafter, K, p_min and temperature it serves the target alone and with the drafter
(`llama-server`, decode/llamacpp/server.py) on the same prompt ids, and reports llama.cpp's own
counters: acceptance (accepted / drafted), tau (tokens per target round, bonus included),
tokens/s and the speedup over its plain decoding measured in the same run; at temperature 0 also
whether the output equals the plain output token for token. `--ours` adds our decoder's
acceptance and tau on the same prompt ids, greedy, at the K of `--ours-k`, with the very weights llama.cpp
serves (the GGUF files read back by `transformers`, the drafter's full head as llama.cpp runs
it): what differs between the columns is the engine, not the model.

Acceptance figures are the same on any machine up to llama.cpp's own arithmetic (quantised
activations); the tokens/s and the speedups are this machine's and say so. Plain decoding is
run before and after the speculative runs and its median taken, so drift in the machine's speed
shows as a range instead of a false speedup.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from specdistill.data.runtime import ConfigError


@dataclass
class Row:
    """One configuration's figures (llama.cpp's, and ours where measured)."""

    drafter: str
    k: int
    p_min: float
    temperature: float
    acceptance: float
    tau: float
    tokens_per_s: float
    plain_tokens_per_s: float
    speedup: float
    identical: bool | None  # greedy output == plain output (None: sampled)
    ours_acceptance: float | None = None
    ours_tau: float | None = None


def _prompt_ids(tokenizer, source: str, n: int) -> list[list[int]]:
    """`toy:SPLIT` (the toy world's code prompts) or a jsonl file with a `prompt` field."""
    if source.startswith("toy:"):
        from specdistill.data.toy.world import toy_prompts

        texts = [r["prompt"] for r in toy_prompts("toy-tiny", source.split(":", 1)[1])]
    else:
        path = Path(source)
        if not path.is_file():
            raise ConfigError(f"--prompts={source!r}: no such file (toy:test or a .jsonl)")
        texts = [json.loads(line)["prompt"] for line in path.read_text().splitlines() if line]
    return [tokenizer(t, add_special_tokens=False).input_ids for t in texts[:n]]


def _server(binary, model, args, **draft):
    """A LlamaServer with the bench's threads, context and extra flags (`draft`: its drafter
    settings)."""
    from specdistill.decode.llamacpp.server import LlamaServer

    return LlamaServer(
        binary,
        model,
        threads=args.threads,
        ctx=args.ctx,
        extra_args=tuple(args.server_arg),
        **draft,
    )


def _serve(binary, target, prompts, args, *, draft=None, k=3, p_min=0.0, temperature=0.0):
    sampling = "probabilistic" if temperature > 0 and draft is not None else None
    with _server(
        binary, target, args, draft=draft, draft_max=k, draft_p_min=p_min, draft_sampling=sampling
    ) as server:
        server.complete(prompts[0], 4, temperature=temperature)  # warm-up, untimed
        return [
            server.complete(
                ids, args.max_new_tokens, temperature=temperature, seed=i, ignore_eos=True
            )
            for i, ids in enumerate(prompts)
        ]


def _ours(target_model, drafter_path: Path, prompts, k: int, max_new: int):
    """(accepted / drafted, tau) of our decoder, greedy, fixed K, full head, on the same prompt
    ids: acceptance counted as llama.cpp counts it (every drafted token, not only the trials
    up to the first rejection that our reports' alpha counts)."""
    import torch
    from transformers import AutoModelForCausalLM

    from specdistill.decode.config import DecoderConfig
    from specdistill.decode.speculative import SpeculativeDecoder

    drafter = AutoModelForCausalLM.from_pretrained(
        drafter_path.parent, gguf_file=drafter_path.name, dtype=torch.float32
    ).eval()
    # no EOS: exactly max_new tokens a prompt, as the server's requests (ignore_eos) decode
    cfg = DecoderConfig(
        gamma=k, max_new_tokens=max_new, draft_vocab="full", cache="dynamic", compile=False
    )
    decoder = SpeculativeDecoder(target_model, drafter, cfg)
    accepted = drafted = tokens = rounds = 0
    for ids in prompts:
        out = decoder.generate(torch.tensor([ids]))
        # llama.cpp's draft_n counts every drafted token, those after a rejection too
        accepted += out.accepted
        drafted += sum(width * n for width, n in enumerate(out.draft_lengths))
        tokens, rounds = tokens + out.block_tokens, rounds + out.row_rounds
    return accepted / max(drafted, 1), tokens / max(rounds, 1)


@dataclass
class Costs:
    """What a round costs in llama.cpp on this machine, in target steps: a drafter step (c,
    from the drafter served alone) and a verify of n tokens (a prompt of n tokens processed in
    one batch, against one decode step)."""

    target_tokens_per_s: float
    drafter_c: dict[str, float]  # name -> its decode step over the target's (each served alone)
    batch_cost: dict[int, float]  # n -> a forward over n tokens, in target decode steps
    temperature: float = 0.0  # the decoding both step times were measured at


def _batch_cost(binary, target, prompts, args, n: int, step_ms: float) -> float:
    """Median time of an n-token prompt's forward (n_predict 1) over one decode step."""
    with _server(binary, target, args) as server:
        server.complete(prompts[0][:n], 1)
        ms = [server.complete(ids[:n], 1).prompt_ms for ids in prompts if len(ids) >= n]
    return statistics.median(ms) / step_ms if ms else float("nan")


def _costs(binary, target, drafters, prompts, args, plain_tps: float, temp: float) -> Costs:
    """The costs against the target's plain tokens/s at `temp`, each drafter served alone at
    the same temperature (sampling over the vocabulary costs a step too)."""
    from specdistill.decode.llamacpp.measure import tokens_per_second

    c = {}
    for name, path in drafters.items():
        alone = tokens_per_second(_serve(binary, path, prompts, args, temperature=temp))
        c[name] = round(plain_tps / alone, 3) if alone else float("nan")
    step_ms = 1000.0 / plain_tps
    batch = {
        n: round(_batch_cost(binary, target, prompts, args, n, step_ms), 2)
        for n in sorted({1, *(k + 1 for k in args.k)})
    }
    return Costs(round(plain_tps, 1), c, batch, temp)


def run(args) -> tuple[list[Row], Costs | None]:
    from transformers import AutoTokenizer

    from specdistill.decode.llamacpp.build import llama_server_binary
    from specdistill.decode.llamacpp.measure import engine_figures, tokens_per_second

    binary = llama_server_binary()
    target = Path(args.target)
    drafters = dict(_named(d) for d in args.drafter)
    tok = AutoTokenizer.from_pretrained(target.parent, gguf_file=target.name)
    prompts = _prompt_ids(tok, args.prompts, args.num_prompts)
    target_model = None
    if args.ours:
        import torch
        from transformers import AutoModelForCausalLM

        from specdistill.data.models.gguf import ensure_gguf_checkpoint

        target_model = AutoModelForCausalLM.from_pretrained(
            ensure_gguf_checkpoint(target), dtype=torch.float32
        ).eval()
    rows: list[Row] = []
    costs = None
    for temp in args.temperature:
        plain_runs = [_serve(binary, target, prompts, args, temperature=temp)]
        specs = {}
        for name, path in drafters.items():
            for k in args.k:
                for p_min in args.p_min:
                    specs[(name, k, p_min)] = _serve(
                        binary,
                        target,
                        prompts,
                        args,
                        draft=path,
                        k=k,
                        p_min=p_min,
                        temperature=temp,
                    )
        plain_runs.append(_serve(binary, target, prompts, args, temperature=temp))
        plain_tps = statistics.median(tokens_per_second(r) for r in plain_runs)
        if costs is None and args.costs:
            costs = _costs(binary, target, drafters, prompts, args, plain_tps, temp)
        for (name, k, p_min), spec in specs.items():
            fig = engine_figures(plain_runs[0], spec)
            ours = (
                _ours(target_model, drafters[name], prompts, k, args.max_new_tokens)
                if target_model is not None and temp == 0 and p_min == 0 and k in args.ours_k
                else (None, None)
            )
            rows.append(
                Row(
                    drafter=name,
                    k=k,
                    p_min=p_min,
                    temperature=temp,
                    acceptance=round(fig.acceptance, 3),
                    tau=round(fig.tau, 2),
                    tokens_per_s=round(fig.spec_tokens_per_s, 1),
                    plain_tokens_per_s=round(plain_tps, 1),
                    speedup=round(fig.spec_tokens_per_s / plain_tps, 2) if plain_tps else 0.0,
                    identical=fig.greedy_identical if temp == 0 else None,
                    ours_acceptance=None if ours[0] is None else round(ours[0], 3),
                    ours_tau=None if ours[1] is None else round(ours[1], 2),
                )
            )
        print(
            f"plain decoding at T={temp}: "
            + " / ".join(f"{tokens_per_second(r):.1f}" for r in plain_runs)
            + " tokens/s (before / after)",
            flush=True,
        )
    return rows, costs


def _named(spec: str) -> tuple[str, Path]:
    name, _, path = spec.partition("=")
    if not path or not Path(path).is_file():
        raise ConfigError(f"--drafter {spec!r}: give NAME=PATH.gguf with an existing file")
    return name, Path(path)


def table(rows: Sequence[Row]) -> str:
    """The markdown table the bench prints."""
    lines = [
        "| drafter | K | p_min | T | acceptance, llama.cpp / ours | tau, llama.cpp / ours | "
        "tokens/s spec / plain | speedup | greedy = plain |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        ours_a = "-" if r.ours_acceptance is None else f"{r.ours_acceptance:.3f}"
        ours_t = "-" if r.ours_tau is None else f"{r.ours_tau:.2f}"
        same = "-" if r.identical is None else ("yes" if r.identical else "NO")
        lines.append(
            f"| {r.drafter} | {r.k} | {r.p_min:g} | {r.temperature:g} | {r.acceptance:.3f} / "
            f"{ours_a} | {r.tau:.2f} / {ours_t} | {r.tokens_per_s:.1f} / "
            f"{r.plain_tokens_per_s:.1f} | {r.speedup:.2f}x | {same} |"
        )
    return "\n".join(lines)


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m specdistill.decode.bench.llamacpp")
    p.add_argument("--target", required=True, help="the target's .gguf")
    p.add_argument("--drafter", action="append", required=True, help="NAME=PATH.gguf")
    p.add_argument("--prompts", default="toy:test", help="toy:SPLIT or a jsonl with `prompt`")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--k", type=int, nargs="+", default=[3])
    p.add_argument("--p-min", type=float, nargs="+", default=[0.0])
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ctx", type=int, default=2048)
    # LlamaServer already passes --poll 0 (spinning draft and target pools starve each other)
    p.add_argument("--server-arg", action="append", default=[], help="one more server flag")
    p.add_argument("--ours", action="store_true", help="our decoder's acceptance beside")
    p.add_argument("--ours-k", type=int, nargs="+", default=[3], help="the K ours runs at")
    p.add_argument("--costs", action="store_true", help="measure c and the verify's batch cost")
    p.add_argument("--out", help="write the rows as JSON here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    t0 = time.perf_counter()
    try:
        rows, costs = run(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(table(rows))
    if costs is not None:
        c = ", ".join(f"{k} {v}" for k, v in costs.drafter_c.items())
        b = ", ".join(f"{n} tokens {v}" for n, v in costs.batch_cost.items())
        print(
            f"costs in target decode steps ({costs.target_tokens_per_s} tokens/s plain at "
            f"T={costs.temperature:g}): "
            f"a drafter step (c): {c}; one forward over n tokens: {b}"
        )
    machine = f"{platform.processor() or platform.machine()}, {args.threads} threads"
    print(f"speeds are this machine's ({machine}); {time.perf_counter() - t0:.0f} s in all")
    if args.out:
        record = {"rows": [asdict(r) for r in rows], "costs": costs and asdict(costs)}
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
