"""The distill stage for a drafter q with its own tokenizer, trained in the form it is served (TLI).

Target p, drafter q. Under TLI serving (vLLM `use_heterogeneous_vocab`; our decoder's mapped
drafter) the drafter reads the target's tokens mapped to its own ids (a token outside the
intersection becomes its unk: the tokenizer's unk, else its eos, as vLLM picks), positions stay
one for one, and its q is restricted to the intersection and moved into target ids
(distill/intersection.py). So training does exactly that:

- Rows stay in the target's tokens (Seq-KD from the generate stage, reference completions, the
  target's held-out continuations: the target reads them as they are); each micro-batch gets
  `draft_input_ids` (`map_ids`) for the drafter and, with stored top-k, `topk_rows`: the
  target's top-k ids as the drafter rows that propose them (-1 where q never can).
- The loss is `intersection.tli_loss` (treatment (b): raw p on I, the outside mass on an outcome
  q cannot produce; greedy serving also drops positions whose target argmax is outside I:
  `tli_mask_unreachable`, auto = on when eval.sampling is greedy).
- The held-out figure that picks best/ is the TLI acceptance (greedy: the served argmax in
  target ids equals the target's; sampling: sum_x min(p, q) over target ids).
- best/ and final/ carry the drafter's own tokenizer.

The plain path (logits at the loss positions, `logits.masked_logits`), not the fused head loss:
a TLI drafter's head is its own (4096 rows for the toy drafter) and the loss needs its full
softmax over I's rows once per position, so the [N, Vd] logits are small; the live target's
[N, Vt] logits are computed without grad at the loss positions only.

Not supported for mapped pairs (one `error:` line each): on-policy batches (lmbda > 0: the
drafter's own samples would need re-tokenising into the target's tokens), drafting=parallel,
draft_vocab_train; the decode-time draft vocabulary is not stored (the intersection already
bounds what q proposes); the held-out decode prediction (train/predict.py) is skipped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from specdistill.data.models.pairs import PairSpec, load_role, vocab_size
from specdistill.data.models.vocab_mapping import VocabMapping, load_source, vocab_mapping
from specdistill.data.runtime import ConfigError, parse_dtype
from specdistill.data.sampling import Sampling
from specdistill.distill.intersection import (
    Intersection,
    served_argmax,
    served_target_logits,
    tli_acceptance_full,
    tli_acceptance_topk,
    tli_loss,
)
from specdistill.distill.train.data import Example
from specdistill.distill.train.evaluate import serving_acceptance
from specdistill.distill.train.logits import masked_logits
from specdistill.distill.train.settings import TrainSettings

log = logging.getLogger(__name__)


def draft_unk_id(tok) -> int:
    """The drafter id a target token outside the intersection is read as: unk, else eos (the
    order vLLM's TLI uses), else one `error:` line."""
    for attr in ("unk_token_id", "eos_token_id"):
        value = getattr(tok, attr, None)
        if value is not None:
            return int(value)
    raise ConfigError(
        "pair.drafter: its tokenizer has neither an unk nor an eos token, so the target's tokens "
        "outside the vocabulary intersection have nothing to be read as: add an unk token"
    )


def read_ids(mapping: VocabMapping, unk: int, target_rows: int) -> torch.Tensor:
    """[target_rows] drafter id read for each target id (`target_to_draft`, unk where -1)."""
    t2d = mapping.target_to_draft.long()
    out = torch.full((target_rows,), unk, dtype=torch.long)
    n = min(target_rows, t2d.numel())
    out[:n] = torch.where(t2d[:n] >= 0, t2d[:n], unk)
    return out


def map_ids(ids: torch.Tensor, reads: torch.Tensor) -> torch.Tensor:
    """Target ids -> the drafter ids TLI feeds it (pure)."""
    return reads[ids.long()]


def map_topk(topk_ids: torch.Tensor, inter: Intersection) -> torch.Tensor:
    """The target's top-k ids -> the drafter rows that propose them (-1: q never can)."""
    return inter.served_row[topk_ids.long()]


def map_example(ex: Example, reads: torch.Tensor, inter: Intersection) -> Example:
    """A Seq-KD row in the target's tokens as the drafter sees it (ids mapped, unk outside I;
    top-k ids mapped into drafter rows): what `map_batch` does to a collated batch, per row."""
    ids = lambda xs: map_ids(torch.tensor(xs, dtype=torch.long), reads).tolist()  # noqa: E731
    rows = None
    if ex.topk_ids is not None:
        rows = map_topk(torch.tensor(ex.topk_ids, dtype=torch.long), inter).tolist()
    return Example(ids(ex.prompt_ids), ids(ex.completion_ids), rows, ex.topk_logprobs)


@dataclass
class MappedPair:
    """What the stage holds for a mapped pair (on the training device)."""

    inter: Intersection
    reads: torch.Tensor  # [target rows] drafter id read per target id
    draft_tok: Any  # the drafter's own tokenizer: saved with best/ and final/
    target_vocab: int  # target logit rows compared (its tokenizer's ids)
    draft_rows: int  # drafter logit rows
    mask_unreachable: bool
    summary: dict[str, Any]

    def draft_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return map_ids(ids, self.reads)

    def drafter_logits(self, model, batch: dict[str, torch.Tensor], masked: bool) -> torch.Tensor:
        """[N, Vd] drafter logits at the loss positions, on the mapped ids."""
        ids, att, mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"].bool()
        d_ids = self.draft_ids(ids)
        if masked:
            return masked_logits(model, d_ids, att, mask, self.draft_rows)
        return model(input_ids=d_ids, attention_mask=att).logits[..., : self.draft_rows][mask]

    def target_logits(self, target, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        ids, att, mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"].bool()
        with torch.no_grad():
            return masked_logits(target, ids, att, mask, self.target_vocab)

    def loss(
        self, tr, batch: dict[str, torch.Tensor], masked: bool, divergence: str, beta: float,
        temperature: float, num_tokens: float,
    ) -> torch.Tensor:  # fmt: skip
        """One micro-batch's share of the window's loss (`intersection.tli_loss`)."""
        mask = batch["loss_mask"].bool()
        with tr.accelerator.autocast():
            z = self.drafter_logits(tr.model, batch, masked)
        kwargs: dict[str, Any]
        if tr.topk:
            rows = map_topk(batch["topk_ids"][mask], self.inter)
            kwargs = {"topk_rows": rows, "topk_lp": batch["topk_lp"][mask]}
        else:
            kwargs = {"target_logits": self.target_logits(tr.target, batch)}
        return tli_loss(
            z, torch.ones(z.shape[0], dtype=torch.bool, device=z.device), self.inter,
            divergence=divergence, beta=beta, temperature=temperature,
            num_tokens=num_tokens, mask_unreachable=self.mask_unreachable, **kwargs,
        )  # fmt: skip

    @torch.no_grad()
    def evaluate(self, drafter, target, batches: list, sampling: Sampling, device) -> dict:
        """Held-out TLI acceptance in the serving mode (what best/ follows) and greedy agreement
        through the mapping; `target=None` reads the stored top-k (exact for greedy, the lower
        bound over the top-k for T = 1)."""
        was_training = drafter.training
        drafter.eval()
        acc_sum, agree, count = 0.0, 0, 0
        for b in batches:
            b = {k: v.to(device) for k, v in b.items()}
            mask = b["loss_mask"].bool()
            z = self.drafter_logits(drafter, b, masked=True).float()
            if target is not None:
                p = self.target_logits(target, b).float()
                if sampling.greedy or (
                    sampling.temperature == 1.0 and sampling.top_k == 0 and sampling.top_p == 1.0
                ):
                    acc = tli_acceptance_full(z, p, self.inter, greedy=sampling.greedy)
                else:  # temperature / top-k / top-p on q in target ids (exact when one-to-one)
                    q = served_target_logits(z, self.inter, self.target_vocab)
                    acc = serving_acceptance(p, q, sampling)
                good = served_argmax(z, self.inter) == p.argmax(-1)
            else:
                rows = map_topk(b["topk_ids"][mask], self.inter)
                lp = b["topk_lp"][mask]
                acc = tli_acceptance_topk(z, rows, lp, self.inter, greedy=sampling.greedy)
                good = tli_acceptance_topk(z, rows, lp, self.inter, greedy=True).bool()
            acc_sum += float(acc.double().sum())
            agree += int(good.sum())
            count += int(mask.sum())
        drafter.train(was_training)
        if count == 0:
            return {"alpha": float("nan"), "greedy_agreement": float("nan"), "tokens": 0}
        return {"alpha": acc_sum / count, "greedy_agreement": agree / count, "tokens": count}


def check_mapped_config(s: TrainSettings) -> bool:
    """Settings a mapped pair cannot run, each one line naming the field; returns
    `tli_mask_unreachable` resolved (auto: on when eval.sampling is greedy)."""
    if s.most_onpolicy > 0:
        raise ConfigError(
            f"lmbda={s.lmbda}: on-policy batches are not supported for a drafter with its own "
            "tokenizer (pair.vocab=mapped) yet; use lmbda=0 (Seq-KD rows in the target's tokens)"
        )
    if s.drafting != "autoregressive":
        raise ConfigError(
            f"drafting={s.drafting}: a drafter with its own tokenizer (pair.vocab=mapped) "
            "trains autoregressive drafts only"
        )
    if s.pack_sequences:
        raise ConfigError(
            "pack_sequences=true: a drafter with its own tokenizer (pair.vocab=mapped) reads "
            "mapped, padded rows; set pack_sequences=false"
        )
    if s.draft_vocab_train is True:  # auto: the mapped path never trains a draft vocabulary
        raise ConfigError(
            "draft_vocab_train=true: a drafter with its own tokenizer (pair.vocab=mapped) is "
            "trained over the vocabulary intersection already; set draft_vocab_train=false"
        )
    return s.mask_unreachable


def prepare_mapped(s: TrainSettings, spec: PairSpec, tok, drafter, device) -> MappedPair:
    """The intersection, the read map and the drafter's own tokenizer, from tokenizer files
    (the mapping is cached per pair: data/models/vocab_mapping.py)."""
    mask_unreachable = check_mapped_config(s)
    from transformers import AutoTokenizer

    name = spec.drafter_tokenizer or spec.drafter
    try:
        draft_tok = AutoTokenizer.from_pretrained(name, revision=spec.drafter_revision)
    except (OSError, ValueError) as e:
        raise ConfigError(f"pair.drafter={name!r}: its own tokenizer did not load ({e})") from e
    t_src = load_source(spec.tokenizer, field="pair.tokenizer", revision=spec.revision)
    d_src = load_source(name, field="pair.drafter", revision=spec.drafter_revision)
    if t_src is None or d_src is None:
        raise ConfigError(f"pair.drafter={name!r}: no tokenizer.json to map the vocabularies")
    mapping = vocab_mapping(t_src, d_src)
    rows = drafter.get_output_embeddings().weight.shape[0]
    target_vocab = max(len(tok), mapping.target_vocab)
    mapping = mapping.resized(target_vocab, max(rows, mapping.draft_vocab))
    d2t = mapping.draft_to_target[:rows]
    inter = Intersection.from_draft_to_target(d2t, target_vocab)
    unk = draft_unk_id(draft_tok)
    summary = {
        "vocab": "mapped",
        "intersection": inter.size,
        "draft_rows_in_intersection": int(inter.rows.numel()),
        "target_vocab": target_vocab,
        "draft_vocab": rows,
        "draft_unk_id": unk,
        "tli_mask_unreachable": mask_unreachable,
    }
    log.info("mapped pair: %s", summary)
    return MappedPair(
        inter=inter.to(device),
        reads=read_ids(mapping, unk, target_vocab).to(device),
        draft_tok=draft_tok,
        target_vocab=target_vocab,
        draft_rows=rows,
        mask_unreachable=mask_unreachable,
        summary=summary,
    )


def load_mapped_target(spec: PairSpec, s: TrainSettings, device, mp: MappedPair):
    """The frozen target for a mapped pair: its logit rows must hold its tokenizer's ids."""
    target = load_role(spec, "target", dtype=parse_dtype(s.target_dtype, device), device=device)
    target.requires_grad_(False)
    if vocab_size(target) < mp.target_vocab:
        raise ConfigError(
            f"pair.target={spec.target!r} has {vocab_size(target)} logit rows but its tokenizer "
            f"{mp.target_vocab} ids: use the target's own tokenizer (pair.tokenizer)"
        )
    return target
