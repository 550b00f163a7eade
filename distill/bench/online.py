"""Benchmark of online adaptation's costs: update overhead and the buffer's memory.

    python -m specdistill.distill.bench.online --vocabs 4096 128256 --requests 16

For each vocabulary size it builds a random pair of small Llamas (the cost structure of online
adaptation scales with the vocabulary: the top-k conversion of each verified row, the drafter's
logits in an update), serves `--requests` requests speculatively with updates, and prints side
by side (one process, same load): decode seconds, update seconds and their share of serving
time, the top-k conversion's share, and the replay buffer's peak bytes at the configured
capacity, next to what full fp32 rows would take. Ratios only: the machine may be shared.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from omegaconf import OmegaConf

from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from specdistill.distill.online.buffer import Entry, ReplayBuffer, entries_from_output
from specdistill.distill.online.update import Updater


def _llama(vocab: int, layers: int, hidden: int, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=512,
        pad_token_id=0,
        eos_token_id=None,
        bos_token_id=None,
    )
    return LlamaForCausalLM(cfg).eval()


def bench_vocab(vocab: int, args: argparse.Namespace) -> dict:
    target = _llama(vocab, 2, 128, seed=1)
    drafter = _llama(vocab, 1, 64, seed=2)
    cfg = OmegaConf.create(
        {
            "seed": 0,
            "update_steps": args.update_steps,
            "update_batch": args.update_batch,
            "loss": {"name": "fkl", "beta": 0.0},
            "loss_chunk_size": 256,
            "optim": {
                "optimizer": {"_target_": "torch.optim.AdamW", "_partial_": True, "lr": 1e-4},
                "schedule": "constant",
                "warmup_steps": 0,
                "min_lr_ratio": 0.1,
                "max_grad_norm": 1.0,
            },
        }
    )
    dcfg = DecoderConfig(gamma=4, max_new_tokens=args.max_new_tokens, record_probs=True)
    dec = SpeculativeDecoder(target, drafter, dcfg)
    updater = Updater(drafter, cfg, 1000, vocab, pad_id=0)
    buffer = ReplayBuffer(args.buffer_tokens)
    gen = torch.Generator().manual_seed(0)
    decode_s = convert_s = update_s = 0.0
    tokens = 0
    for req in range(args.requests):
        prompt = torch.randint(1, vocab, (1, args.prompt_len), generator=gen)
        t = time.perf_counter()
        out = dec.generate(prompt)
        decode_s += time.perf_counter() - t
        t = time.perf_counter()
        for e in entries_from_output(out, prompt.tolist(), [req], args.topk, "rejected"):
            buffer.add(e)
        convert_s += time.perf_counter() - t
        tokens += len(out.tokens[0])
        if (req + 1) % args.update_every == 0:
            t = time.perf_counter()
            updater.update(buffer, req)
            update_s += time.perf_counter() - t
    # The buffer at capacity: synthetic entries of the same shape (peak = capacity positions).
    full = ReplayBuffer(args.buffer_tokens)
    per = args.prompt_len + args.max_new_tokens
    for req in range(args.buffer_tokens // 16 + 2):
        ids = torch.zeros(per, dtype=torch.int32)
        topk_ids = torch.zeros(16, args.topk, dtype=torch.int32)
        full.add(Entry(req, ids, torch.arange(16), topk_ids, torch.zeros(16, args.topk)))
    serve = decode_s + convert_s + update_s
    return {
        "vocab": vocab,
        "requests": args.requests,
        "tokens": tokens,
        "decode_s": round(decode_s, 3),
        "topk_convert_s": round(convert_s, 3),
        "update_s": round(update_s, 3),
        "update_share": round(update_s / serve, 4),
        "convert_share": round(convert_s / serve, 4),
        "buffer_capacity_positions": args.buffer_tokens,
        "buffer_peak_mb": round(full.peak_nbytes / 2**20, 3),
        "full_rows_mb": round(args.buffer_tokens * vocab * 4 / 2**20, 1),
        # the decoder's recorded full rows live until the request's conversion (at most one
        # round per new token)
        "decoder_rows_per_request_max_mb": round(
            args.max_new_tokens * (dcfg.gamma + 1) * vocab * 4 / 2**20, 1
        ),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--vocabs", type=int, nargs="+", default=[4096, 128256])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--topk", type=int, default=32)
    p.add_argument("--buffer-tokens", type=int, default=4096)
    p.add_argument("--update-every", type=int, default=4)
    p.add_argument("--update-steps", type=int, default=4)
    p.add_argument("--update-batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = [bench_vocab(v, args) for v in args.vocabs]
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for r in rows:
        print("| " + " | ".join(str(r[k]) for k in keys) + " |")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
