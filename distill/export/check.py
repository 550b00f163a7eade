"""The export's self-check: what a serving stack will rely on, verified on the written files.

Run on the temporary folder before it is published, so a failing export never reaches the
destination. Any failure is a `ExportCheckError` naming what differs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from specdistill.data.models.pairs import PairSpec, load_role
from specdistill.data.runtime import CheckFailed


class ExportCheckError(CheckFailed):
    """The written checkpoint does not behave like the drafter it was exported from."""


def _fail(what: str) -> None:
    raise ExportCheckError(f"export self-check failed: {what}")


def check_config(
    config, *, expect_vocab: int, expect_dtype: torch.dtype, min_positions: int | None
):
    """architectures, dtype, vocab_size and context length as engines read them."""
    if not getattr(config, "architectures", None):
        _fail("config.json has no `architectures`; engines pick the model class from it")
    if int(config.vocab_size) != expect_vocab:
        _fail(f"config.json vocab_size {config.vocab_size} != the target's {expect_vocab}")
    saved = str(getattr(config, "dtype", None) or "").removeprefix("torch.")
    if saved != str(expect_dtype).removeprefix("torch."):
        _fail(f"config.json dtype {saved!r} != the exported weights' {expect_dtype}")
    positions = getattr(config, "max_position_embeddings", None)
    if min_positions and (positions is None or int(positions) < min_positions):
        _fail(f"max_position_embeddings {positions} < the validated context {min_positions}")


def check_tokenizer(folder: Path, target_tok) -> None:
    """Vocabulary, special tokens and chat template equal the target's."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    if tok.get_vocab() != target_tok.get_vocab():
        _fail("the exported tokenizer's vocabulary differs from the target's")
    for attr in ("bos_token", "eos_token", "pad_token", "unk_token"):
        if getattr(tok, attr) != getattr(target_tok, attr):
            _fail(f"tokenizer {attr} {getattr(tok, attr)!r} != {getattr(target_tok, attr)!r}")
    if sorted(tok.all_special_tokens) != sorted(target_tok.all_special_tokens):
        _fail("the exported tokenizer's special tokens differ from the target's")
    if getattr(tok, "chat_template", None) != getattr(target_tok, "chat_template", None):
        _fail("the exported tokenizer's chat template differs from the target's")


def greedy(target, ids: torch.Tensor, max_new_tokens: int, pad_id: int | None, **kw) -> list[int]:
    out = target.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        max_new_tokens=max_new_tokens,
        pad_token_id=pad_id,
        **kw,
    )
    return out[0, ids.shape[1] :].tolist()


def check_reloaded(
    drafter, *, expect_vocab: int, expect_dtype: torch.dtype, min_positions: int | None
) -> bool:
    """config.json, the weights' dtype, the head's rows and its tying as reloaded; whether the
    head is tied."""
    check_config(
        drafter.config,
        expect_vocab=expect_vocab,
        expect_dtype=expect_dtype,
        min_positions=min_positions,
    )
    if drafter.dtype != expect_dtype:
        _fail(f"reloaded weights are {drafter.dtype}, expected {expect_dtype}")
    if int(drafter.get_output_embeddings().weight.shape[0]) != expect_vocab:
        _fail("the LM head's rows do not match config.json vocab_size")
    tied = bool(getattr(drafter.config, "tie_word_embeddings", False))
    same = drafter.get_output_embeddings().weight.data_ptr() == (
        drafter.get_input_embeddings().weight.data_ptr()
    )
    if tied != same:
        _fail(f"tie_word_embeddings={tied} but the reloaded head and embedding tied={same}")
    return tied


def logit_drift(drafter, probe: torch.Tensor, reference_logits: torch.Tensor) -> float:
    """The largest change of a real token's logit on the probe since before the export (the
    written weights must be the drafter's); fails beyond float noise."""
    drafter.eval()
    with torch.no_grad():
        logits = drafter(probe).logits[0, :, : reference_logits.shape[-1]].float()
    drift = float((logits - reference_logits).abs().max())
    if drift > 1e-4 * max(1.0, float(reference_logits.abs().max())):
        _fail(f"real-token logits changed by {drift:.3g} after export")
    return drift


def pad_id(target_tok) -> int | None:
    """The pad id `generate` is given: the tokenizer's pad token, else its eos."""
    return (
        target_tok.pad_token_id if target_tok.pad_token_id is not None else target_tok.eos_token_id
    )


def assisted_equals_greedy(
    target, target_tok, text: str, max_new_tokens: int, device: torch.device, call: str, **assist
) -> tuple[torch.Tensor, list[int]]:
    """`generate` with the exported drafter as assistant (`assist`) reproduces the target's own
    greedy output on `text`, or fails naming `call`; (prompt ids, that output)."""
    pad = pad_id(target_tok)
    ids = torch.tensor([target_tok(text, add_special_tokens=False).input_ids], device=device)
    with torch.no_grad():
        plain = greedy(target, ids, max_new_tokens, pad)
        assisted = greedy(target, ids, max_new_tokens, pad, **assist)
    if plain != assisted:
        _fail(
            f"{call} gave {assisted[:12]}... but the target alone {plain[:12]}... on prompt "
            f"{text[:40]!r}"
        )
    return ids, plain


def self_check(
    folder: Path,
    spec: PairSpec,
    target_tok,
    *,
    prompts: list[str],
    max_new_tokens: int,
    device: torch.device,
    target_dtype: torch.dtype,
    expect_dtype: torch.dtype,
    expect_vocab: int,
    min_positions: int | None,
    reference_logits: torch.Tensor,
    probe: torch.Tensor,
    mask_token_id: int | None = None,
) -> dict[str, Any]:
    """Reload the export and check it; returns the findings recorded in export.json."""
    from transformers import AutoModelForCausalLM

    drafter = AutoModelForCausalLM.from_pretrained(str(folder), dtype="auto")
    tied = check_reloaded(
        drafter, expect_vocab=expect_vocab, expect_dtype=expect_dtype, min_positions=min_positions
    )
    check_tokenizer(folder, target_tok)
    drift = logit_drift(drafter, probe, reference_logits)

    target = load_role(spec, "target", dtype=target_dtype, device=device)
    # decoded in the target's dtype (fp32 by default: no near-ties): a bf16 export upcasts
    # exactly, and our decoder takes a pair of one dtype only
    drafter = drafter.to(device=device, dtype=target_dtype)
    same_tokens = 0
    for text in prompts:
        _, plain = assisted_equals_greedy(
            target, target_tok, text, max_new_tokens, device, "generate(assistant_model=drafter)",
            assistant_model=drafter,
        )  # fmt: skip
        same_tokens += len(plain)
    parallel = {}
    if mask_token_id is not None:
        parallel = check_parallel(
            drafter, target, target_tok, prompts, max_new_tokens, mask_token_id
        )
    vocab_check = {}
    if getattr(drafter.config, "draft_vocab_ids", None) and mask_token_id is None:
        vocab_check = check_draft_vocab(drafter, target, target_tok, prompts, max_new_tokens)
    return {
        "reloaded": True,
        "tokenizer_matches_target": True,
        "assisted_equals_target_greedy": f"{len(prompts)} prompts, {same_tokens} tokens",
        "max_logit_drift": drift,
        "tied_embeddings": tied,
        "max_position_embeddings": int(getattr(drafter.config, "max_position_embeddings", 0)),
        "min_positions": min_positions,
        "device": str(device),
        **parallel,
        **vocab_check,
    }


def check_draft_vocab(
    drafter, target, target_tok, prompts: list[str], max_new_tokens: int
) -> dict[str, Any]:
    """A drafter with `draft_vocab_ids` as reloaded: our decoder, scoring only those tokens in
    its draft steps, reproduces the target's greedy output on every prompt."""
    from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder

    eos = () if target_tok.eos_token_id is None else (int(target_tok.eos_token_id),)
    dec_cfg = DecoderConfig(gamma=4, max_new_tokens=max_new_tokens, eos_token_id=eos)
    dec = SpeculativeDecoder(target, drafter, dec_cfg, tokenizer_len=len(target_tok))
    for text in prompts:
        ids = torch.tensor([target_tok(text, add_special_tokens=False).input_ids])
        ids = ids.to(next(target.parameters()).device)
        plain = greedy(target, ids, max_new_tokens, target_tok.pad_token_id)
        if dec.generate(ids).tokens[0] != plain:
            _fail(f"decoding with the draft vocabulary diverged from the target on {text[:40]!r}")
    return {
        "draft_vocab": len(drafter.config.draft_vocab_ids),
        "draft_vocab_equals_target_greedy": f"{len(prompts)} prompts, gamma 4",
    }


def check_parallel(
    drafter, target, target_tok, prompts: list[str], max_new_tokens: int, mask_token_id: int
) -> dict[str, Any]:
    """A parallel drafter as reloaded: the mask token where engines read it, and our parallel
    decoder (one drafter forward per round over new tokens + masks) reproducing the target's
    greedy output on every prompt."""
    from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder

    cfg = drafter.config
    if getattr(cfg, "mask_token_id", None) != mask_token_id:
        _fail(f"config.json mask_token_id {getattr(cfg, 'mask_token_id', None)} != {mask_token_id}")
    if getattr(cfg, "pard_token", None) != mask_token_id:
        _fail(f"config.json pard_token {getattr(cfg, 'pard_token', None)} != {mask_token_id}")
    eos = () if target_tok.eos_token_id is None else (int(target_tok.eos_token_id),)
    dec_cfg = DecoderConfig(
        gamma=4, max_new_tokens=max_new_tokens, drafting="parallel", eos_token_id=eos
    )
    dec = SpeculativeDecoder(target, drafter, dec_cfg, tokenizer_len=len(target_tok))
    alpha = greedy_alpha_equal_to_target(
        dec, target, target_tok, prompts, max_new_tokens,
        lambda text, got, plain: f"parallel drafting gave {got[:12]}... but the target "
        f"{plain[:12]}...",
    )  # fmt: skip
    return {
        "mask_token_id": mask_token_id,
        "parallel_drafting_equals_target_greedy": f"{len(prompts)} prompts, gamma 4",
        "parallel_alpha_greedy": alpha,
    }


def greedy_alpha_equal_to_target(
    dec, target, target_tok, prompts, max_new_tokens, failure
) -> float:
    """Decode each prompt with `dec` (greedy) and fail, with `failure(text, got, plain)`, unless
    it equals the target's own greedy output; the decoder's acceptance rate over all prompts."""
    accepted = trials = 0
    for text in prompts:
        ids = torch.tensor([target_tok(text, add_special_tokens=False).input_ids])
        ids = ids.to(next(target.parameters()).device)
        out = dec.generate(ids)
        plain = greedy(target, ids, max_new_tokens, target_tok.pad_token_id)
        if out.tokens[0] != plain:
            _fail(failure(text, out.tokens[0], plain))
        accepted += out.accepted
        trials += out.trials
    return round(accepted / max(trials, 1), 3)
