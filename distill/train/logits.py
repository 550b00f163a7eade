"""Logits only where the loss reads them: the LM head applied to the masked positions.

A distill batch is prompt + completion, right-padded to its longest row; the loss reads the
logits of completion positions only. On SmolLM2 (vocabulary 49k, hidden 576) the head is most of a
4-layer drafter's arithmetic (its [positions, V] logits, their fp32 log-softmax and the gradient
back through the head), and with toy prompts (mean 54 tokens, up to 156) plus 64 completion tokens
the padded [b, n] grid is several times the completion tokens. So the decoder body runs on the
padded batch as before, and the head runs on the rows of `mask` only.

Exact up to matmul blocking: each kept row is the same `lm_head(hidden)` product the full
forward computes (tested against the full logits). Only for architectures whose causal-LM
forward is exactly `lm_head(decoder(...).last_hidden_state)` (no logit scaling or soft-capping);
other models take the full forward and a gather, which is the same result at the full cost.
"""

from __future__ import annotations

from typing import Any

import torch

from specdistill.distill.head_loss import HeadInput

# Causal-LM classes whose logits are exactly lm_head(last_hidden_state) (transformers 5.x).
PLAIN_HEAD = frozenset({"llama", "mistral", "qwen2", "qwen3"})


def causal_lm(model: Any) -> Any:
    """The `*ForCausalLM` itself: `model`, or the one a DDP or DeepSpeed wrapper holds."""
    inner = getattr(model, "module", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def has_plain_head(model: Any) -> bool:
    """True when `masked_logits` may call the decoder and the head separately on `model` (or
    on the causal LM its DDP / DeepSpeed wrapper holds)."""
    model = causal_lm(model)
    config = getattr(model, "config", None)
    return getattr(config, "model_type", None) in PLAIN_HEAD and hasattr(model, "get_decoder")


def final_hidden(model: Any, inputs: dict[str, Any]) -> torch.Tensor:
    """The decoder's last hidden state [b, n, H] (after the final norm), without the head.

    A bare model runs its decoder alone. A DDP or DeepSpeed (ZeRO-1/2) wrapper must run its own
    forward, where it prepares the gradients' all-reduce, and so must an FSDP2 model, whose
    root forward gathers the root group (embeddings, head: train/fsdp.py): it runs with the head
    on no position (`logits_to_keep`: an empty index), and the decoder's output is taken by a
    forward hook. The head then runs outside on the loss positions only; its weight is a full
    tensor under DDP, ZeRO-1/2 and FSDP2 (the root group stays whole until the backward), so
    every parameter's gradient still reaches the wrapper's hooks (ZeRO-3 partitions it: the
    caller keeps the full forward there)."""
    from specdistill.distill.train.fsdp import is_sharded

    inner = causal_lm(model)
    if inner is model and not is_sharded(model):
        return model.get_decoder()(**inputs).last_hidden_state
    seen: list[torch.Tensor] = []
    hook = inner.get_decoder().register_forward_hook(
        lambda _m, _a, out: seen.append(out.last_hidden_state)
    )
    try:
        none = torch.empty(0, dtype=torch.long, device=inputs["input_ids"].device)
        model(**inputs, logits_to_keep=none)
    finally:
        hook.remove()
    return seen[-1]


def model_inputs(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    position_ids: torch.Tensor | None = None,
) -> dict[str, Any]:
    """A forward's keywords; `position_ids` only for a packed batch (train/packing.py), since
    some forwards (a recurrent state's) take none, and then no cache: `transformers` reads
    sequence restarts from the position ids only when there is neither a mask nor a cache."""
    inputs: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask}
    if position_ids is not None:
        inputs |= {"position_ids": position_ids, "use_cache": False}
    return inputs


def masked_logits(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    mask: torch.Tensor,
    vocab: int,
    head_ids: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """The logits of the positions where `mask` [b, n] is True, as [N, vocab] in row order;
    with `head_ids` [K], only those vocabulary rows, as [N, K] (the draft vocabulary: the head's
    matmul and its gradient shrink by V / K).

    `model` is a `*ForCausalLM` or its DDP / DeepSpeed ZeRO-1/2 wrapper (`final_hidden`).
    `position_ids` (and no attention mask): a packed batch (train/packing.py).
    """
    mask = mask.bool()
    inputs = model_inputs(input_ids, attention_mask, position_ids)
    if not has_plain_head(model):
        logits = model(**inputs).logits
        logits = logits[..., :vocab][mask]
        return logits if head_ids is None else logits.index_select(-1, head_ids)
    hidden = final_hidden(model, inputs)
    head = causal_lm(model).get_output_embeddings()
    if head_ids is None:
        return head(hidden[mask])[..., :vocab]
    bias = None if head.bias is None else head.bias.index_select(0, head_ids)
    return torch.nn.functional.linear(hidden[mask], head.weight.index_select(0, head_ids), bias)


def masked_head_input(
    model: Any,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    mask: torch.Tensor,
    vocab: int,
    position_ids: torch.Tensor | None = None,
) -> HeadInput:
    """The final hidden states of the positions where `mask` [b, n] is True ([N, H], row order)
    and the head cut to `vocab` rows, for `head_loss.fused_distill_loss`, which never
    materialises the [N, vocab] logits. `model` (or the model its wrapper holds) must pass
    `has_plain_head`."""
    hidden = final_hidden(model, model_inputs(input_ids, attention_mask, position_ids))
    head = causal_lm(model).get_output_embeddings()
    bias = None if head.bias is None else head.bias[:vocab]
    return HeadInput(hidden[mask.bool()], head.weight[:vocab], bias)
