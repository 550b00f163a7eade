"""Benchmark: distill-step throughput and peak RSS by vocabulary size, before/after the fused loss.

    python -m specdistill.distill.bench.vocab                       # 49k / 128k / 262k heads
    python -m specdistill.distill.bench.vocab --vocab 262144 --draft 4096 --steps 3

A drafter of a big-vocabulary target is a small body under a big tied head; its weights do not
matter to the time of a step, so CI builds one: a random Llama body (SmolLM2-like: hidden 576,
9 heads / 3 KV heads, `--layers` layers) with a tied head of V rows, frozen as the distill stage
freezes a drafter built from the target's layers (`freeze_embeddings: auto`). Rows are random
Zipf-distributed tokens (so a draft vocabulary of the most frequent N covers most of them) with
stored top-32 target log-probs; each step is one optimizer step of `--rows` rows of `--prompt`
+ `--completion` tokens through the distill stage's own loss (`shared_vocab.shared_vocab_loss`):

- `before`: `chunked_loss=false`, the [N, V] logits and `losses.distill_loss` (chunks of 256
  positions over those logits);
- `after`: `chunked_loss=true`, `head_loss.fused_distill_loss` (exact: the same loss values);
- `draft:N` (262k only, `--draft`): `draft_vocab_train=true` over the N most frequent tokens,
  which changes the objective (q over those N rows, intersection.py's loss), so its loss is not
  comparable.

Each configuration runs in its own process (peak RSS is its own: ru_maxrss, model and optimizer
included); tokens/s counts the completion tokens trained on, after one warm-up step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any

import torch

VOCABS = (49152, 128256, 262144)
DRAFTS = (4096, 16384, 32768)


def _drafter(vocab: int, layers: int, hidden: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
        num_hidden_layers=layers, num_attention_heads=9, num_key_value_heads=3,
        max_position_embeddings=2048, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg)
    model.get_input_embeddings().weight.requires_grad_(False)  # tied: the head too
    return model.train()


def _rows(vocab: int, args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """A batch of Zipf(1.1) tokens; top-k = the next token + K-1 other draws, log-probs sorted."""
    gen = torch.Generator().manual_seed(1)
    n, k = args.prompt + args.completion, args.topk
    ranks = torch.arange(1, vocab + 1, dtype=torch.float64)
    zipf = ranks.pow(-1.1)
    ids = torch.multinomial(zipf, args.rows * n, replacement=True, generator=gen).view(-1, n)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[:, args.prompt - 1 : n - 1] = True  # position t predicts token t + 1 (a completion)
    others = torch.multinomial(zipf, args.rows * n * (k - 1), True, generator=gen)
    top_ids = torch.cat([ids.roll(-1, 1)[..., None], others.view(args.rows, n, k - 1)], -1)
    top_lp = torch.log_softmax(torch.randn(args.rows, n, k, generator=gen) * 2, -1) - 0.1
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask,
            "topk_ids": top_ids, "topk_lp": top_lp.sort(-1, descending=True).values}  # fmt: skip


def measure(vocab: int, variant: str, args: argparse.Namespace) -> dict:
    """`args.steps` timed optimizer steps (after one warm-up) of one configuration."""
    from specdistill.decode.draft_vocab import choose_draft_vocab
    from specdistill.distill.intersection import Intersection
    from specdistill.distill.train.shared_vocab import shared_vocab_loss

    torch.set_num_threads(args.threads)
    model = _drafter(vocab, args.layers, args.hidden)
    batch = _rows(vocab, args)
    head_ids = head_inter = None
    if variant.startswith("draft:"):
        size = int(variant.split(":")[1])
        keep = choose_draft_vocab(batch["input_ids"].tolist(), vocab, size)
        head_ids = torch.tensor(keep, dtype=torch.long)
        head_inter = Intersection.from_draft_to_target(head_ids, vocab)
    # every position counts (no greedy mask), so each variant trains the same positions
    settings = SimpleNamespace(loss=SimpleNamespace(temperature=1.0), loss_chunk_size=256,
                               mask_unreachable=False)  # fmt: skip
    tr: Any = SimpleNamespace(  # the fields of trainer.Trainer that `shared_vocab_loss` reads
        model=model, target=None, topk=True, vocab=vocab, head_ids=head_ids,
        head_inter=head_inter, chunked=variant == "after", s=settings,
        accelerator=SimpleNamespace(autocast=contextlib.nullcontext),
    )  # fmt: skip
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    n_tokens = int(batch["loss_mask"].sum())

    def step() -> float:
        loss = shared_vocab_loss(tr, batch, False, True, args.loss, 0.5, n_tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    losses = [step()]
    t0, c0 = time.perf_counter(), _cpu_seconds()
    losses += [step() for _ in range(args.steps)]
    secs, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
    return {
        "vocab": vocab,
        "variant": variant,
        "head_rows": vocab if head_ids is None else len(head_ids),
        "tokens_per_s": round(n_tokens * args.steps / secs, 1),
        "step_s": round(secs / args.steps, 2),
        "cpu_s": round(cpu / args.steps, 2),  # user + system: less bent by other load
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "losses": [round(v, 6) for v in losses],
    }


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def default_variant(vocab: int) -> str:
    """The path the distill stage takes by default at this vocabulary (chunked_loss: auto from
    32768 rows; draft_vocab_train: auto over draft_vocab auto's rows from 131072)."""
    from specdistill.decode.draft_vocab import AUTO_SIZE
    from specdistill.distill.head_loss import AUTO_MIN_VOCAB
    from specdistill.distill.train.settings import DRAFT_VOCAB_TRAIN_MIN

    if vocab >= DRAFT_VOCAB_TRAIN_MIN:
        return f"draft:{AUTO_SIZE}"
    return "after" if vocab >= AUTO_MIN_VOCAB else "before"


def _table(rows: list[dict]) -> list[str]:
    out = ["| vocab | path | head rows trained | tokens/s | s/step | CPU s/step | peak RSS MB "
           "| loss by step |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        loss = " / ".join(f"{v:.5f}" for v in r["losses"])
        out.append(f"| {r['vocab']} | {r['variant']} | {r['head_rows']} | {r['tokens_per_s']} "
                   f"| {r['step_s']} | {r['cpu_s']} | {r['peak_rss_mb']} | {loss} |")  # fmt: skip
    by = {(r["vocab"], r["variant"]): r for r in rows}
    lo, hi = min(r["vocab"] for r in rows), max(r["vocab"] for r in rows)
    for variant in dict.fromkeys(r["variant"] for r in rows if r["vocab"] == hi):
        a, b = by.get((hi, variant)), by.get((lo, "before" if "draft" in variant else variant))
        if a and b and hi != lo:
            out.append(f"tokens/s {hi} {variant} / {lo} {b['variant']}: "
                       f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}x "
                       f"(per CPU second {b['cpu_s'] / max(a['cpu_s'], 1e-3):.2f}x)")  # fmt: skip
    a, b = by.get((hi, default_variant(hi))), by.get((lo, default_variant(lo)))
    if a and b and hi != lo:
        out.append(f"the stage's defaults: tokens/s {hi} {a['variant']} / {lo} {b['variant']}: "
                   f"{a['tokens_per_s'] / b['tokens_per_s']:.2f}x, peak RSS {a['peak_rss_mb']} "
                   f"vs {b['peak_rss_mb']} MB")  # fmt: skip
    for v in sorted({r["vocab"] for r in rows}):
        a, b = by.get((v, "before")), by.get((v, "after"))
        if a and b:
            gap = max(abs(x - y) / max(abs(x), 1e-12) for x, y in zip(a["losses"], b["losses"]))
            out.append(f"{v}: after/before tokens/s {b['tokens_per_s'] / a['tokens_per_s']:.2f}x,"
                       f" peak RSS {b['peak_rss_mb']} vs {a['peak_rss_mb']} MB,"
                       f" loss max relative gap {gap:.1e}")  # fmt: skip
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, action="append", help=f"default {VOCABS}")
    ap.add_argument("--draft", type=int, action="append",
                    help=f"draft-vocabulary rows trained at the largest vocab; default {DRAFTS}")  # fmt: skip
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--completion", type=int, default=64)
    ap.add_argument("--topk", type=int, default=32)
    ap.add_argument("--loss", default="fkl")
    ap.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: VOCAB:VARIANT, prints JSON
    args = ap.parse_args(argv)
    if args.one:
        vocab, _, variant = args.one.partition(":")
        print(json.dumps(measure(int(vocab), variant, args)))
        return
    vocabs = args.vocab or list(VOCABS)
    configs = [(v, p) for v in vocabs for p in ("before", "after")]
    configs += [(max(vocabs), f"draft:{n}") for n in (args.draft or DRAFTS)]
    own = [a for a in (argv if argv is not None else sys.argv[1:]) if a not in ("--one",)]
    rows = []
    for vocab, variant in configs:  # a fresh process each: its own peak RSS
        cmd = [sys.executable, "-m", __spec__.name, *own, "--one", f"{vocab}:{variant}"]
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode != 0:
            sys.exit(f"error: {vocab}:{variant} failed:\n{out.stderr[-2000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    print(f"layers={args.layers} hidden={args.hidden} rows={args.rows} "
          f"tokens={args.prompt}+{args.completion} top-{args.topk} loss={args.loss} "
          f"threads={args.threads} steps={args.steps}+1 warm-up")  # fmt: skip
    print("\n".join(_table(rows)))


if __name__ == "__main__":
    main()
