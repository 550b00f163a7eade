"""Training a parallel (PARD) drafter: mask chains packed into one forward per sequence.

p = target, q = drafter. A parallel drafter reads a context x_1..x_j followed by k-1 mask tokens
and predicts x_{j+1} at x_j and x_{j+d} at the (d-1)-th mask (`decode.drafters.parallel`).
To train depth 2..K on a Seq-KD / on-policy sequence x_1..x_T without one forward per anchor,
mask chains are appended to the real tokens and a 4-D attention mask keeps them apart (PARD):
the chain of anchor j holds K-1 masks; its mask of depth d (d = 2..K) has position id j+d-1,
attends the real tokens x_1..x_j and the masks of its own chain up to itself, and is labelled
with the target's distribution at real position j+d-1 (the one that predicts x_{j+d}). Real
tokens attend causally among themselves only, so their logits are exactly the autoregressive
ones (depth 1). The target's distributions come from its one forward over the real sequence
(or the stored top-k log-probs): masks add no target cost.

Loss weights (`parallel.objective`): `token` weighs depth d by decay^(d-1) (depth 1: 1). A draft at
depth d only matters when the d-1 before it were accepted, which a drafter's acceptance makes
roughly geometric in d; the decay puts the capacity where acceptance length is made, alike for
every chain. `cat` weighs each chain's depths by the gradient of that chain's own expected
accepted length, dE/da_d = P(drafts before d kept) * (1 + what keeping d unlocks)
(distill.acceptance_loss), from the drafter's current soft acceptance: a chain whose first draft
the drafter misses (as after a rejection) keeps its depth-1 term and little else, one it gets
right trains its deep masks. `cat_mix` < 1 blends the two: each position's weight is cat_mix times
its `cat` weight plus (1 - cat_mix) times its `token` weight (both sum to the same total), so
deep masks keep a floor while the drafter's first drafts are still wrong (from a base drafter
the chains' soft acceptance is small, and `cat` alone leaves depths >= 3 nearly untrained:
distill/RESULTS.md). `acceptance_length` adds -E itself (summed over chains, divided by
the window's chains, times `length_weight`) to the `cat`-weighted divergence. `miss_weight`
(any objective) weighs contexts that end just after a token the drafter missed, where rounds
start (`after_miss_factors`). Anchors are subsampled (`anchors` per sequence, at random among
completion positions) to bound the packed length T + anchors (K-1).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdistill.data.runtime import ConfigError
from specdistill.distill.acceptance_loss import (
    chain_values,
    expected_accepted,
    length_weights,
    scatter_chain_weights,
    soft_acceptance,
)

OBJECTIVES = ("token", "cat", "acceptance_length")
MAX_DEPTH = 15  # the decoder drafts at most 15 tokens a round (decoder.max_draft 1..15)


def resolve_train_mask_token(configured, tokenizer) -> int:
    """`parallel.mask_token_id`: auto = a reserved id of the target's vocabulary that never
    occurs in the training text (the checkpoint keeps the target's vocab_size): the pad id,
    unless it is also the eos, bos or unk id (SmolLM2's pad is its eos `<|im_end|>`: as the mask
    it would be trained both ways and never drafted), then the last of the tokenizer's other
    special tokens (SmolLM2: `<empty_output>`)."""
    if configured in (None, "auto"):
        roles = {getattr(tokenizer, f"{r}_token_id", None) for r in ("eos", "bos", "unk")}
        pad = getattr(tokenizer, "pad_token_id", None)
        if pad is not None and pad not in roles:
            return int(pad)
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        special = set(getattr(tokenizer, "all_special_ids", [])) | {
            i for i, tok in added.items() if getattr(tok, "special", False)
        }
        spare = sorted(special - roles - {pad})
        if not spare:
            raise ConfigError(
                "parallel.mask_token_id=auto needs a pad token that is not the eos/bos/unk "
                "token, or another special token: set parallel.mask_token_id to a reserved "
                "token id of the vocabulary"
            )
        return int(spare[-1])
    if isinstance(configured, bool) or not isinstance(configured, int) or configured < 0:
        raise ConfigError(
            f"parallel.mask_token_id={configured!r} must be a token id >= 0 or auto (pad id)"
        )
    if configured >= len(tokenizer):
        raise ConfigError(
            f"parallel.mask_token_id={configured} is past the tokenizer's {len(tokenizer)} tokens"
        )
    return configured


def check_parallel_config(node) -> None:
    """One line naming the field for bad `parallel.*` settings."""
    depth, anchors, decay = node.get("depth"), node.get("anchors"), node.get("decay")
    if isinstance(depth, bool) or not isinstance(depth, int) or not 2 <= depth <= MAX_DEPTH:
        raise ConfigError(
            f"parallel.depth={depth!r} must be an integer in 2..{MAX_DEPTH} (drafts/forward; "
            f"the decoder's max_draft is at most {MAX_DEPTH})"
        )
    objective = node.get("objective", "token")
    if objective not in OBJECTIVES:
        raise ConfigError(f"parallel.objective={objective!r}: use one of {', '.join(OBJECTIVES)}")
    mix = node.get("cat_mix", 1.0)
    if isinstance(mix, bool) or not isinstance(mix, (int, float)) or not 0 <= mix <= 1:
        raise ConfigError(
            f"parallel.cat_mix={mix!r} must be a number in [0, 1] (the share of the cat weights)"
        )
    mw = node.get("miss_weight", 1.0)
    if isinstance(mw, bool) or not isinstance(mw, (int, float)) or not mw > 0:
        raise ConfigError(
            f"parallel.miss_weight={mw!r} must be a number > 0 (1: every context alike)"
        )
    lw = node.get("length_weight", 1.0)
    if isinstance(lw, bool) or not isinstance(lw, (int, float)) or not lw > 0:
        raise ConfigError(f"parallel.length_weight={lw!r} must be a number > 0")
    if isinstance(anchors, bool) or not isinstance(anchors, int) or anchors < 1:
        raise ConfigError(f"parallel.anchors={anchors!r} must be an integer >= 1 (chains/seq)")
    if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay <= 1:
        raise ConfigError(f"parallel.decay={decay!r} must be a number in (0, 1]")


def choose_anchors(
    loss_mask: torch.Tensor, count: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """(B, A) anchor positions j per row, -1 for none: `count` at random among positions whose
    next two tokens are completion tokens (so depth 2 has a label), all of them when fewer."""
    b = loss_mask.shape[0]
    ok = torch.zeros_like(loss_mask, dtype=torch.bool)
    ok[:, :-1] = loss_mask[:, :-1].bool() & loss_mask[:, 1:].bool()
    cols = []
    for r in range(b):
        idx = ok[r].nonzero().flatten()
        if len(idx) > count:
            pick = torch.randperm(len(idx), generator=generator)[:count]
            idx = idx[pick.sort().values]
        cols.append(idx)
    width = max(1, max(len(c) for c in cols))
    out = torch.full((b, width), -1, dtype=torch.long)
    for r, c in enumerate(cols):
        out[r, : len(c)] = c
    return out


def pack_parallel(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    loss_mask: torch.Tensor,
    anchors: torch.Tensor,
    depth: int,
    mask_token_id: int,
    decay: float,
) -> dict[str, torch.Tensor]:
    """Real tokens (right-padded, as `collate` makes them) + one chain of depth-1 masks per anchor.

    Returns input_ids, anchors (B, A), position_ids (B, N), allowed (B, N, N) bool (query attends key),
    label_pos (B, N) (the real position whose target distribution labels each packed position),
    depth (B, N) (1 for real tokens) and weight (B, N) fp32 (0 where there is no loss).
    N = T + A (depth - 1).
    """
    b, t = input_ids.shape
    a, m = anchors.shape[1], depth - 1
    n = t + a * m
    dev = input_ids.device
    d = torch.arange(2, depth + 1, device=dev).repeat(a)  # (A m,) depth of each chain slot
    chain = torch.arange(a, device=dev).repeat_interleave(m)  # (A m,)
    j = anchors[:, chain]  # (B, A m) anchor of each chain slot
    valid = j >= 0
    real_pos = torch.arange(t, device=dev).expand(b, t)
    label = torch.cat([real_pos, (j + d - 1).clamp(min=0, max=t - 1)], 1)
    position_ids = torch.cat([real_pos, (j.clamp(min=0) + d - 1)], 1)
    ids = torch.cat([input_ids, torch.full((b, a * m), mask_token_id, dtype=input_ids.dtype)], 1)
    depth_all = torch.cat([torch.ones(b, t, dtype=torch.long), d.expand(b, -1)], 1)
    # what each query may see: real keys up to ctx_end, chain keys of its chain up to its depth
    ctx_end = torch.cat([real_pos, j], 1)  # (B, N); -1 for unused chains: no real key
    chain_all = torch.cat([torch.full((t,), -1, device=dev), chain]).expand(b, n)
    is_real = torch.arange(n, device=dev) < t
    keys_real = (torch.arange(t, device=dev)[None, None, :] <= ctx_end[:, :, None]) & (
        attention_mask.bool()[:, None, :]
    )
    same_chain = (chain_all[:, :, None] == chain_all[:, None, t:]) & ~is_real[None, :, None]
    keys_chain = same_chain & (depth_all[:, None, t:] <= depth_all[:, :, None])
    allowed = torch.cat([keys_real, keys_chain], 2)
    allowed |= torch.eye(n, dtype=torch.bool, device=dev)[None]  # unused chains see themselves
    in_range = valid & (j + d - 1 < t)
    chain_w = torch.where(
        in_range,
        loss_mask.gather(1, label[:, t:]).float() * decay ** (d - 1).float(),
        torch.zeros((), device=dev),
    )
    weight = torch.cat([loss_mask.float(), chain_w], 1)
    return {
        "input_ids": ids,
        "anchors": anchors,
        "position_ids": position_ids,
        "allowed": allowed,
        "label_pos": label,
        "depth": depth_all,
        "weight": weight,
    }


def additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(B, 1, N, N) float mask for the model: 0 where allowed, the dtype's min elsewhere."""
    out = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return out.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def gather_positions(x: torch.Tensor, label_pos: torch.Tensor) -> torch.Tensor:
    """x (B, T, ...) read at label_pos (B, N): the target's figures at each packed position."""
    idx = label_pos.reshape(*label_pos.shape, *([1] * (x.dim() - 2)))
    return x.gather(1, idx.expand(-1, -1, *x.shape[2:]))


def packed_forward(model, packed: dict[str, torch.Tensor]) -> torch.Tensor:
    """The drafter's logits over a packed batch (one forward, 4-D mask, explicit positions)."""
    dtype = next(model.parameters()).dtype
    return model(
        input_ids=packed["input_ids"],
        attention_mask=additive_mask(packed["allowed"], dtype),
        position_ids=packed["position_ids"],
    ).logits


def packed_hidden(model, packed: dict[str, torch.Tensor]) -> torch.Tensor:
    """The drafter's final hidden states over a packed batch: `packed_forward` without the head,
    so the head can run on the labelled positions only (the masked head, `train/logits.py`).
    `model` (or the model its DDP / DeepSpeed wrapper holds) must pass
    `train.logits.has_plain_head`."""
    from specdistill.distill.train.logits import final_hidden

    dtype = next(model.parameters()).dtype
    inputs = {
        "input_ids": packed["input_ids"],
        "attention_mask": additive_mask(packed["allowed"], dtype),
        "position_ids": packed["position_ids"],
    }
    return final_hidden(model, inputs)


def acceptance_by_depth(
    accept: torch.Tensor, packed: dict[str, torch.Tensor], depth: int
) -> tuple[list[float], list[int]]:
    """Mean per-position acceptance (B, N) at each depth 1..depth over positions with a loss,
    and how many positions each mean is over."""
    has = packed["weight"] > 0
    means, counts = [], []
    for d in range(1, depth + 1):
        sel = has & (packed["depth"] == d)
        counts.append(int(sel.sum()))
        means.append(float(accept[sel].double().sum()) / max(counts[-1], 1))
    return means, counts


def accepted_length(alpha_at: Sequence[float]) -> float:
    """Expected accepted drafts per round when draft d is accepted with alpha_at[d-1] given the
    earlier ones were: sum_d prod_{i<=d} alpha_i (the eval figure best/ follows)."""
    total, prefix = 0.0, 1.0
    for a in alpha_at:
        prefix *= a
        total += prefix
    return total


def prepare_drafter(drafter, mask_token_id: int, depth: int) -> None:
    """Make the drafter trainable as a parallel drafter and self-describing once saved.

    The mask token is the pad id, which `nn.Embedding(padding_idx=...)` would keep frozen: its
    row must learn (it is the mask's only signal), so the padding index is dropped here. A
    reloaded checkpoint rebuilds the padding index but loads the trained row. `mask_token_id`
    and `parallel_drafting` land in config.json, where the decoder and the exporter read them.
    """
    emb = drafter.get_input_embeddings()
    if getattr(emb, "padding_idx", None) == mask_token_id:
        emb.padding_idx = None
    drafter.config.mask_token_id = mask_token_id
    drafter.config.parallel_drafting = {"mask_token_id": mask_token_id, "max_drafts": depth}


def pack_batch(batch: dict, node, mask_token_id: int, seed: int, micro: int) -> dict:
    """`pack_parallel` for one collated micro-batch; anchors drawn from (seed, micro-batch
    index), so a resumed run packs exactly the batches an uninterrupted one would."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + micro)
    anchors = choose_anchors(batch["loss_mask"], int(node.anchors), gen)
    return pack_parallel(
        batch["input_ids"],
        batch["attention_mask"],
        batch["loss_mask"],
        anchors,
        int(node.depth),
        mask_token_id,
        float(node.decay),
    )


# ---------------------------------------------------------------------------------------------
# Acceptance-length objectives (`parallel.objective`), over the chains of a packed batch.


def chain_index(packed: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, A, K) packed position of each chain's depth 1..K (depth 1 = the anchor's real
    position, depth d = the chain's (d-1)-th mask) and whether it carries a label."""
    anchors, weight = packed["anchors"], packed["weight"]
    b, a = anchors.shape
    t = int((packed["depth"][0] == 1).sum())  # real positions come first
    k = (weight.shape[1] - t) // max(a, 1) + 1
    slots = t + torch.arange(a, device=anchors.device)[:, None] * (k - 1)
    slots = slots + torch.arange(k - 1, device=anchors.device)[None]  # (A, K-1)
    index = torch.cat([anchors[..., None], slots.expand(b, a, k - 1)], -1)
    has = weight.gather(1, index.clamp(min=0).reshape(b, -1)).reshape(b, a, k) > 0
    return index, has & (anchors[..., None] >= 0)


def packed_acceptance(
    logits: torch.Tensor, targets: dict[str, torch.Tensor], greedy: bool, temperature: float
) -> torch.Tensor:
    """Soft acceptance a (B, N) of each packed position's draft (drafter logits q, the target's
    figures at its label: `target_logits` or stored `topk_ids`/`topk_lp`), differentiable in q:
    q(target's argmax) for a greedy target, sum_x min(p, q) at `temperature` for sampling
    (over the stored top-k a lower bound, as the held-out eval scores it)."""
    if greedy:
        lq = torch.log_softmax(logits.float(), -1)
        return soft_acceptance(lq, target_ids=target_argmax(targets))
    if "topk_ids" in targets:
        ids, lpk = targets["topk_ids"].long(), targets["topk_lp"].float()
        lq = torch.log_softmax(logits.float(), -1)
        return soft_acceptance(lq.gather(-1, ids), lp=lpk)
    p = targets["target_logits"].float()
    lq = torch.log_softmax(logits.float() / temperature, -1)
    return soft_acceptance(lq, lp=torch.log_softmax(p / temperature, -1))


def target_argmax(targets: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, N) the target's argmax at each packed position: of its logits (`target_logits`), or
    of the stored top-k (`topk_ids` at the top `topk_lp`)."""
    if "topk_ids" in targets:
        lp = targets["topk_lp"]
        return targets["topk_ids"].long().gather(-1, lp.argmax(-1, keepdim=True)).squeeze(-1)
    return targets["target_logits"].argmax(-1)


def objective_weights(
    accept: torch.Tensor, packed: dict[str, torch.Tensor], cat_mix: float = 1.0
) -> torch.Tensor:
    """The `cat` loss weights (B, N) from the soft acceptance (B, N) (detached): each chain's
    depths get dE/da_d of the chain's own E (`acceptance_loss.length_weights`); a real position
    that anchors no chain in this micro-batch gets its row's mean depth-1 weight (it is the
    depth 1 of a round too, whose continuation was not drawn). Scaled so the micro-batch's
    weights sum to the `token` objective's: the window's normaliser, and so the learning rate's
    meaning, stay those of `token`; only their split between positions changes. `cat_mix` < 1:
    that share of the `cat` weights, the rest the `token` ones (the same total)."""
    base = packed["weight"]
    index, valid = chain_index(packed)
    a, usable = chain_values(accept.detach().float(), index, valid)
    w_chain, hit = scatter_chain_weights(length_weights(a) * usable, index, usable, base.shape[1])
    first = torch.where(usable[..., 0], length_weights(a)[..., 0], torch.zeros(()))
    n_first = usable[..., 0].sum(1, keepdim=True)
    row_mean = torch.where(n_first > 0, first.sum(1, keepdim=True) / n_first.clamp(min=1), 1.0)
    real = packed["depth"] == 1
    w = torch.where(hit, w_chain, torch.where(real, row_mean.expand_as(base), 0.0))
    w = torch.where(base > 0, w, torch.zeros(()))
    total = w.sum()
    cat = w * (base.sum() / total) if float(total) > 0 else base
    return cat if cat_mix >= 1 else cat_mix * cat + (1.0 - cat_mix) * base


def after_miss_factors(
    packed: dict[str, torch.Tensor],
    drafter_top: torch.Tensor,
    target_top: torch.Tensor,
    miss_weight: float,
) -> torch.Tensor:
    """(B, N) loss multipliers `parallel.miss_weight`: `miss_weight` at every packed position
    whose context ends just after a token the drafter missed, 1 elsewhere (pure).

    A round starts at the token the target put where the drafter's draft was rejected (or at
    the bonus token no draft proposed), so the drafts a round keeps are made in contexts that
    end in a token the drafter did not predict; a uniform draw of anchors puts only the
    drafter's miss rate of chains there, and its masks agree with the target far less after a
    miss than after a hit (distill/RESULTS.md, "Parallel drafter at the toy pair's equal
    budget"). drafter_top, target_top (B, N): the drafter's and
    the target's argmax at each packed position (the prediction of its label); the greedy
    disagreement marks a miss in either serving mode. Real position i is after a miss when
    position i - 1 missed (i = 0 never is); a chain slot when its anchor is."""
    b = drafter_top.shape[0]
    t = int((packed["depth"][0] == 1).sum())  # real positions come first
    labelled = packed["weight"][:, :t] > 0
    missed = labelled & (drafter_top[:, :t] != target_top[:, :t])
    first = torch.zeros(b, 1, dtype=torch.bool, device=missed.device)
    after = torch.cat([first, missed[:, :-1]], 1)  # (B, T)
    anchors = packed["anchors"]
    a = anchors.shape[1]
    m = (packed["weight"].shape[1] - t) // max(a, 1)
    slots = torch.arange(a, device=anchors.device).repeat_interleave(m)
    j = anchors[:, slots]  # (B, A m): each chain slot's anchor
    chain_after = (j >= 0) & after.gather(1, j.clamp(min=0))
    heavy = torch.cat([after, chain_after], 1)
    return torch.where(heavy, float(miss_weight), 1.0).to(packed["weight"].dtype)


def reweigh(weights: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:
    """weights * factors, scaled back to the weights' own total (pure): the window's
    normaliser, and so the learning rate's meaning, stay the same; only the split moves."""
    out = weights * factors
    total = out.sum()
    return out * (weights.sum() / total) if float(total) > 0 else weights


def chains_expected_length(accept: torch.Tensor, packed: dict[str, torch.Tensor]) -> torch.Tensor:
    """sum over the micro-batch's chains of E[accepted drafts] from the per-position soft
    acceptance (B, N), differentiable: the `acceptance_length` objective maximises it."""
    index, valid = chain_index(packed)
    a, _ = chain_values(accept, index, valid)
    return expected_accepted(a).sum()


def chain_count(packed: dict[str, torch.Tensor]) -> int:
    """Chains (anchors) of a packed micro-batch: the normaliser of the E term."""
    return int((packed["anchors"] >= 0).sum())


def round_accepted(accept: torch.Tensor, packed: dict[str, torch.Tensor]) -> tuple[float, int]:
    """(sum over chains of sum_j prod_{i<=j} a_i, chains) from per-position acceptance (B, N):
    with greedy 0/1 agreement it is, per anchor, the drafts a round started there keeps (the
    drafts before the first miss), measured per round, not from per-depth means."""
    index, valid = chain_index(packed)
    a, _ = chain_values(accept.double(), index, valid)
    return float(expected_accepted(a).sum()), chain_count(packed)
