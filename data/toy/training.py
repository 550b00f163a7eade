"""The toy world's models: small Llamas trained from scratch on the corpus's token stream.

Plain next-token training (AdamW, warm-up + cosine decay) for a fixed number of steps from a
fixed seed, so a build is deterministic; `heldout_loss` is the build's one quality figure.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator

import torch
from tqdm.auto import tqdm

from specdistill.data.toy.specs import ModelShape, ToySpec

log = logging.getLogger(__name__)


def make_llama(shape: ModelShape, vocab_size: int, max_positions: int, tokenizer, seed: int):
    """A small Llama with the tokenizer's special ids wired into its config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def _batches(stream: torch.Tensor, seq_len: int, batch: int, seed: int) -> Iterator[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hi = len(stream) - seq_len - 1
    while True:
        starts = torch.randint(0, hi, (batch,), generator=gen)
        yield torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])


@torch.no_grad()
def heldout_loss(model, stream: torch.Tensor, seq_len: int, n_windows: int = 32) -> float:
    """Mean next-token loss on evenly spaced held-out windows (deterministic)."""
    model.eval()
    step = max(1, (len(stream) - seq_len - 1) // n_windows)
    losses = []
    for i in range(n_windows):
        w = stream[i * step : i * step + seq_len + 1]
        if len(w) < seq_len + 1:
            break
        logits = model(input_ids=w[None, :-1]).logits
        losses.append(float(torch.nn.functional.cross_entropy(logits[0].float(), w[1:])))
    model.train()
    return float(sum(losses) / max(1, len(losses)))


def train_lm(model, stream: torch.Tensor, spec: ToySpec, steps: int, seed: int, desc: str):
    """Plain next-token training with warm-up + cosine decay; returns tokens/s."""
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup = max(1, steps // 10)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    batches = _batches(stream, spec.seq_len, spec.batch_size, seed)
    t0 = time.perf_counter()
    bar = tqdm(range(steps), desc=desc, leave=False, disable=None)
    log_every = max(1, steps // 10)  # tqdm is silent without a TTY: logs show progress too
    for step in bar:
        b = next(batches)
        logits = model(input_ids=b[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), b[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % log_every == 0:
            rate = (step + 1) * spec.batch_size * spec.seq_len / (time.perf_counter() - t0)
            log.info(
                "%s: step %d/%d loss %.3f (%.0f tokens/s)", desc, step + 1, steps, loss.item(), rate
            )
    elapsed = time.perf_counter() - t0
    return steps * spec.batch_size * spec.seq_len / max(elapsed, 1e-9)
