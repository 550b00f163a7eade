"""Benchmark: a multi-process distill step's memory per rank with a large vocabulary, by
strategy (DDP, DeepSpeed ZeRO-2 / ZeRO-3, FSDP2) and loss path, side by side in one run.

    python -m specdistill.distill.bench.ranks --vocab 151936 --strategies ddp zero2 zero3 fsdp2

An 8B target's vocabulary (Qwen's 151,936) makes the drafter's logits the memory of a distill
step: [positions, V] in fp32 for the logits, their log-softmax and their gradient. Under a
wrapper (DDP, DeepSpeed ZeRO-1/2) or sharded (FSDP2, distill/train/fsdp.py) the stage keeps the
head at the loss positions only and the chunked loss (`train/logits.final_hidden`), as one
process does; `full` is the path multi-process runs took before (`masked_head=false
chunked_loss=false`: the whole [b, n, V] grid).

The run builds, at run time, a tiny random Llama drafter with that vocabulary (untied head, as
large targets have), a word-level tokenizer of as many tokens and a synthetic Seq-KD set with
stored top-k (`data/generate/synthetic.py`, so no target is loaded). Each (strategy, path) is
the distill stage's own `prepare` + `train_step` under `torchrun --nproc_per_node N` (gloo on
CPU), one warm-up step and `--steps` steps; every rank records its peak RSS (`ru_maxrss`) and
the steps' losses. It prints per-rank peak RSS (the larger rank), its ratio to the same
strategy's `full` path and to DDP's (what every multi-process run paid before), and the
largest relative loss difference between the paths (the same window, so the same loss up to
float summation order). RSS and timings are this machine's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PATHS = {
    "full": ["masked_head=false", "chunked_loss=false"],
    "masked+chunked": ["masked_head=true", "chunked_loss=true"],
}
STRATEGIES = {
    "ddp": "deepspeed=none",
    "zero2": "deepspeed=zero2",
    "zero3": "deepspeed=zero3",
    "fsdp2": "fsdp=true",
}


def build_world(root: Path, vocab: int, rows: int, prompt_len: int, completion_len: int) -> Path:
    """A drafter folder (tiny random Llama + word-level tokenizer of `vocab` tokens) and a merged
    synthetic Seq-KD set under `root`; returns the set's folder."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from specdistill.data.generate.merge import merge_shards
    from specdistill.data.generate.synthetic import synthetic_run

    words = {"<pad>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, vocab)}
    tk = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
        tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    drafter = root / "drafter"
    LlamaForCausalLM(config).save_pretrained(drafter)
    tok.save_pretrained(drafter)
    run = synthetic_run(root / "seqkd", rows, prompt_len=prompt_len,
                        completion_len=completion_len, k=32, vocab=vocab)  # fmt: skip
    merge_shards(run)
    return run


def rank_run(data: str, out: str, steps: int, overrides: list[str]) -> None:
    """One rank's share: the stage's prepare + train_step; writes out/rank<R>.json."""
    import torch
    from hydra import compose, initialize_config_module

    from specdistill.distill.train import stage

    torch.set_num_threads(1)
    drafter = str(Path(data).parent / "drafter")
    base = [
        "pair.toy=null", f"pair.target={drafter}", f"pair.drafter={drafter}",
        f"data.path={data}", "eval.source=path", f"eval.path={data}", "eval.limit=1",
        "logger=none", "device=cpu", f"output_dir={out}/run", "freeze_embeddings=false",
        "draft_vocab=none",
    ]  # fmt: skip
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        cfg = compose(config_name="distill", overrides=[*base, *overrides])
    tr = stage.prepare(cfg)
    losses = [stage.train_step(tr, 0)["loss"]]
    t0 = time.perf_counter()
    for step in range(1, steps + 1):
        losses.append(stage.train_step(tr, step)["loss"])
    rank = int(os.environ.get("RANK", "0"))
    record = {
        "rank": rank,
        "world": tr.accelerator.num_processes,
        "losses": losses,
        "seconds": round(time.perf_counter() - t0, 2),
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))


def _launch(data: Path, out: Path, nproc: int, steps: int, overrides: list[str]) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    cmd = ["torchrun", "--standalone", "--nproc_per_node", str(nproc), "-m", __spec__.name,
           "--rank-data", str(data), "--rank-out", str(out), "--steps", str(steps), *overrides]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"error: {' '.join(overrides)} failed:\n{done.stderr[-3000:]}")
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def rel_diff(a: list[float], b: list[float]) -> float:
    """The largest relative difference between two runs' step losses."""
    return max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a, b, strict=True))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--strategies", nargs="+", default=["ddp", "zero2", "zero3"],
                    choices=list(STRATEGIES))  # fmt: skip
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=96)
    ap.add_argument("--completion-len", type=int, default=160)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--work", help="keep the built world and runs here (default: a temp dir)")
    ap.add_argument("--output", help="write the rows as JSON here")
    ap.add_argument("--rank-data", help=argparse.SUPPRESS)  # internal: one rank's run
    ap.add_argument("--rank-out", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="distill overrides for every run")
    args = ap.parse_args(argv)
    if args.rank_data:
        rank_run(args.rank_data, args.rank_out, args.steps, args.overrides)
        return
    if shutil.which("torchrun") is None:
        sys.exit("error: the `torchrun` CLI is not installed (it comes with torch)")
    work = Path(args.work or tempfile.mkdtemp(prefix="specdistill-ranks-"))
    t0 = time.perf_counter()
    data = build_world(work, args.vocab, args.rows, args.prompt_len, args.completion_len)
    shared = [f"micro_batch_size={args.micro_batch}", "grad_accum=1",
              f"max_seq_len={args.prompt_len + args.completion_len + 16}", *args.overrides]  # fmt: skip
    rows: list[dict[str, Any]] = []
    ddp_full = None  # what a multi-process run cost before: DDP over the full logits
    for strategy in args.strategies:
        by_path = {}
        for path, own in PATHS.items():
            ranks = _launch(data, work / f"{strategy}-{path}", args.nproc, args.steps,
                            [STRATEGIES[strategy], *shared, *own])  # fmt: skip
            by_path[path] = ranks
            print(json.dumps({"strategy": strategy, "path": path, "ranks": ranks}), flush=True)
        full = max(r["peak_rss_mb"] for r in by_path["full"])
        ddp_full = full if strategy == "ddp" else ddp_full
        for path, ranks in by_path.items():
            peak = max(r["peak_rss_mb"] for r in ranks)
            rows.append({
                "strategy": strategy, "path": path, "peak_rss_mb_per_rank": peak,
                "ratio_to_full": round(peak / full, 2),
                "ratio_to_ddp_full": None if ddp_full is None else round(peak / ddp_full, 2),
                "loss_rel_diff_to_full": rel_diff(ranks[0]["losses"], by_path["full"][0]["losses"]),
                "seconds": max(r["seconds"] for r in ranks),
            })  # fmt: skip
    print(f"\n{args.nproc} processes (gloo), vocabulary {args.vocab}, micro-batch "
          f"{args.micro_batch} x {args.prompt_len}+{args.completion_len} tokens, {args.steps} "
          "steps after one warm-up:")  # fmt: skip
    print("| strategy | loss path | peak RSS per rank, MB | x full | x DDP full | "
          "loss rel. diff to full | s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['strategy']} | {r['path']} | {r['peak_rss_mb_per_rank']} | "
              f"{r['ratio_to_full']} | {r['ratio_to_ddp_full'] or '-'} | "
              f"{r['loss_rel_diff_to_full']:.1e} | {r['seconds']} |")  # fmt: skip
    print(f"RSS and seconds are this machine's; {time.perf_counter() - t0:.0f} s in all")
    if args.output:
        Path(args.output).write_text(json.dumps(rows, indent=2) + "\n")
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
