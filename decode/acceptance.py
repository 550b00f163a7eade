"""Pure accept/resample math for speculative decoding (fp32, vectorised over rows).

Convention everywhere: p = the target's distribution, q = the drafter's. Shapes: `B` rows,
`G` = gamma drafted tokens per round, `V` vocabulary. Every random choice takes explicit uniforms
so tests can enumerate outcomes exactly; `uniforms()` draws them from a `torch.Generator`.

The rules are lossless (the output follows p exactly) except `lenience < 1`, the DistillSpec
lossy variant, which callers must label as such wherever it is reported.
"""

from __future__ import annotations

import weakref

import torch

from specdistill.data.sampling import Sampling

NEG_INF = float("-inf")


def process_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Temperature, then top-k, then top-p (the `transformers` order) on fp32 logits.

    Applied identically to p (target) and q (drafter) so both rules compare the same
    distributions. Returns logits with removed tokens at -inf; greedy leaves them unscaled.
    """
    x = logits.float()
    if sampling.greedy:
        return x
    if sampling.temperature != 1.0:  # x / 1 is x: one op less in every T=1 step
        x = x / sampling.temperature
    v = x.shape[-1]
    if 0 < sampling.top_k < v:
        kth = torch.topk(x, sampling.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, NEG_INF)
    if sampling.top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        # Keep the smallest prefix whose mass reaches top_p: a token goes once the mass before it
        # already reaches top_p (the most likely token always stays).
        drop_sorted = mass_before >= sampling.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, idx, drop_sorted)
        x = x.masked_fill(drop, NEG_INF)
    return x


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """`logits.argmax(-1)` (same ties and NaN rule) through `max`, whose CPU kernel is faster;
    every greedy decision, speculative and target-only, goes through here, so both pick alike."""
    return logits.max(-1).indices


def probs_from_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Processed fp32 distribution; greedy gives the one-hot of the argmax."""
    x = process_logits(logits, sampling)
    if sampling.greedy:
        return torch.nn.functional.one_hot(greedy_tokens(x), x.shape[-1]).float()
    return torch.softmax(x, dim=-1)


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sample per row of `probs` (..., V) with uniforms `u` (...) in [0, 1).

    Unnormalised rows are fine. Zero-probability tokens are never picked: the search finds the
    first CDF entry above the point, which only rises where a token has mass; round-off could
    put u * total at the total itself, so the point is held just below it. Every T=1 step
    samples here, so it stays a few tensor ops.
    """
    cdf = torch.cumsum(probs.float(), dim=-1)
    total = cdf[..., -1:]
    below = torch.nextafter(total, -total)  # the largest float below a positive total
    target = torch.minimum(u.float().unsqueeze(-1) * total, below)
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return idx.clamp(max=probs.shape[-1] - 1)  # an all-zero row: the last token, as before


def uniforms(shape: tuple[int, ...], generator: torch.Generator | None, device) -> torch.Tensor:
    """U[0,1) draws; one generator seeds a whole run.

    torch refuses a CPU generator for a CUDA draw, and drawing on the host then copying would
    sync every step; so a decode on another device draws from a companion generator there,
    seeded once from the host one: runs stay reproducible."""
    if generator is not None and generator.device != torch.device(device):
        generator = _companion(generator, torch.device(device))
    return torch.rand(shape, generator=generator, device=device, dtype=torch.float32)


_COMPANIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _new_generator(device: torch.device) -> torch.Generator:
    return torch.Generator(device=device)


def _companion(host: torch.Generator, device: torch.device) -> torch.Generator:
    """The generator on `device` that `host` seeds (made on first use, one per device)."""
    per_device = _COMPANIONS.setdefault(host, {})
    if device not in per_device:
        seed = int(torch.randint(0, 2**62, (1,), generator=host))
        per_device[device] = _new_generator(device).manual_seed(seed)
    return per_device[device]


def verify_greedy(
    draft: torch.Tensor, target_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: accept drafts while they equal the target's argmax.

    draft: (B, G) drafter tokens; target_logits: (B, G+1, V) target logits at the positions
    that predict draft[0..G-1] and the bonus slot. Returns (n_accepted (B,), next_token (B,)),
    next_token being the target's argmax at the first mismatch (or the bonus position).
    """
    return accept_prefix(*greedy_agreement(draft, target_logits))


def greedy_agreement(
    draft: torch.Tensor, target_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ok (B, G) bool: draft[j] is the target's argmax at j, target tokens (B, G+1)): the one
    argmax greedy verification and its per-position acceptance both read."""
    target_tok = greedy_tokens(target_logits)  # fp32/bf16 alike: no upcast copy needed
    return draft == target_tok[:, :-1], target_tok


def accept_prefix(ok: torch.Tensor, next_by_pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """n = length of the all-true prefix of `ok` (B, G); next token = next_by_pos[:, n]."""
    n = torch.cumprod(ok.int(), dim=-1).sum(-1)
    return n, next_by_pos.gather(1, n.unsqueeze(1)).squeeze(1)


def acceptance_probs(
    p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, lenience: float = 1.0
) -> torch.Tensor:
    """min(1, f(p(x))/q(x)) at each drafted token x, f(p) = p / lenience (lenience 1: lossless).

    p: (B, G, V) target, q: (B, G, V) drafter (both processed), draft: (B, G). q(x) > 0 always
    holds for a token the drafter sampled; the clamp only guards degenerate inputs.
    """
    px = p.gather(-1, draft.unsqueeze(-1)).squeeze(-1)
    qx = q.gather(-1, draft.unsqueeze(-1)).squeeze(-1)
    return torch.clamp(px / (lenience * qx.clamp_min(1e-30)), max=1.0)


def residual(p: torch.Tensor, q: torch.Tensor, lenience: float = 1.0) -> torch.Tensor:
    """normalize(max(0, p - lenience*q)): where to resample after a rejection (p where it is 0).

    With lenience 1 this is exactly the distribution that makes speculative sampling lossless.
    """
    r = torch.clamp(p - lenience * q, min=0.0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(1e-30), p)


def verify_sampling(
    draft: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor,
    u_accept: torch.Tensor,
    u_sample: torch.Tensor,
    lenience: float = 1.0,
    lengths: torch.Tensor | None = None,
    accept_p: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling (Leviathan et al. / Chen et al.) for rows that accept different lengths.

    draft: (B, G) tokens sampled from q; p: (B, G+1, V) target probs (the last position is the
    bonus slot); q: (B, G, V) drafter probs; u_accept: (B, G) and u_sample: (B,) uniforms.
    Accept draft[j] iff u_accept[j] < min(1, p/q); at the first rejection j resample from
    residual(p_j, q_j); with all G accepted, sample the bonus token from p_G.
    `lengths` (B,): row r proposed only its first lengths[r] drafts (its bonus slot follows them).
    `accept_p`: `acceptance_probs(p[:, :G], q, draft, lenience)` when the caller has it.
    Returns (n_accepted (B,), next_token (B,)).
    """
    b, g = draft.shape
    if accept_p is None:
        accept_p = acceptance_probs(p[:, :g], q, draft, lenience)
    ok = u_accept < accept_p
    if lengths is not None:
        proposed = torch.arange(g, device=draft.device)[None, :] < lengths[:, None]
        ok &= proposed
        q = q * proposed[..., None]
    n = torch.cumprod(ok.int(), dim=-1).sum(-1)
    # Distribution for the next token: residual at the rejected position, p at the bonus slot.
    q_pad = torch.cat([q, q.new_zeros(b, 1, q.shape[-1])], dim=1)  # q = 0 at the bonus slot
    rows = torch.arange(b, device=draft.device)
    dist = residual(p[rows, n], q_pad[rows, n], lenience)
    return n, sample_from(dist, u_sample)


def expected_alpha(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Per-position acceptance probability sum_x min(p, q) = 1 - TVD(p, q) (p target, q drafter)."""
    return torch.minimum(p.float(), q.float()).sum(-1)
