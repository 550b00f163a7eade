"""The drafter aligned to the target: what the export changes in a drafter of the target's
tokenizer so that serving engines accept the pair (vocabulary rows, special ids, generation
config, a parallel drafter's mask token). p = target, q = drafter; stage.py runs these on the
loaded drafter before it is written and self-checked.
"""

from __future__ import annotations

import torch

from specdistill.data.models.pairs import PairSpec
from specdistill.data.runtime import ConfigError


def resize_vocab_rows(model, size: int) -> int:
    """Pad (zero rows) or trim the embedding and LM-head rows to `size`; returns the old size.

    Rows past the tokenizer's length are padding: no text maps to them. New rows are zero, so
    their logit is exactly 0 and every real token's logit is unchanged. Tied weights stay one
    tensor (resize_token_embeddings re-ties them).
    """
    old = int(model.get_input_embeddings().weight.shape[0])
    head_old = int(model.get_output_embeddings().weight.shape[0])
    if old == size and head_old == size:
        return old
    model.resize_token_embeddings(size, mean_resizing=False)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        if size > old:
            emb[old:].zero_()
        head = model.get_output_embeddings()
        if head.weight.data_ptr() != emb.data_ptr() and size > head_old:
            head.weight[head_old:].zero_()
            if getattr(head, "bias", None) is not None:
                head.bias[head_old:].zero_()
    model.config.vocab_size = size
    return old


def align_with_target(model, target_config, target_generation) -> None:
    """bos/eos/pad ids and the generation config become the target's."""
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.config, key, getattr(target_config, key, None))
    model.generation_config = target_generation


def mark_parallel(model, vocab: int, field_name: str, source: str) -> int | None:
    """A parallel (PARD) drafter's mask token, written where serving engines look for it:
    `mask_token_id` (ours; TensorRT-LLM's PARDDecodingConfig takes it), `pard_token` (what
    vLLM's draft_model method reads for `parallel_drafting`) and `parallel_drafting`. None for
    an autoregressive drafter (its config has no mask_token_id)."""
    mask_id = getattr(model.config, "mask_token_id", None)
    if mask_id is None:
        return None
    if not isinstance(mask_id, int) or not 0 <= mask_id < vocab:
        raise ConfigError(
            f"{field_name}={source!r}: config.json mask_token_id={mask_id!r} is not a token id "
            f"of the target's vocabulary (0..{vocab - 1})"
        )
    info = dict(getattr(model.config, "parallel_drafting", None) or {})
    model.config.pard_token = mask_id
    model.config.parallel_drafting = info | {"mask_token_id": mask_id}
    return mask_id


def target_generation(spec: PairSpec, target_config):
    """The target's generation_config.json, or one derived from its config when it has none."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(spec.target, revision=spec.revision)
    except OSError:
        return GenerationConfig.from_model_config(target_config)
