"""The floor learns from the steps it skipped (`Drafter.propose(shadow=...)`, `observe_shadow`).

p = target, q = drafter. When the floor runs plain target steps, the drafter reads their tokens
in its next forward anyway; its logits there are what a first draft would have been. These tests
check the verdicts against a brute-force forward over the whole sequence (greedy: q's argmax is
the token; sampling: q's probability of it under the sampling spec), that the policy's averages
take them in, that a floor switched on by a pessimistic prior switches drafting back on after
one probe because of them (and does not without them), and that output stays the target's.
"""

from __future__ import annotations

import pytest
import torch

from specdistill.data.sampling import Sampling
from specdistill.decode.acceptance import probs_from_logits
from specdistill.decode.draft_length import DraftCosts, make_policy, modeled_speedup
from specdistill.decode.draft_length.policies import DraftLengthPolicy
from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from tests.conftest import tiny_llama
from tests.decode.test_speculative import greedy_reference, left_pad, prompts, truncated_copy

DEAR = DraftCosts(c=0.9, verify_per_token=0.1, round_overhead=0.3)  # the floor engages
CHEAP = DraftCosts(c=0.2, verify_per_token=0.02, round_overhead=0.05)
# T=1: plain steps and drafting rounds both (a parallel round's one forward needs a dearer c)
SOMETIMES = DraftCosts(c=0.7, verify_per_token=0.05, round_overhead=0.2)
SOMETIMES_PARALLEL = DraftCosts(c=1.2, verify_per_token=0.05, round_overhead=0.4)


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(vocab=64, layers=3, hidden=32, seed=0)
    return target, truncated_copy(target)


def _record(dec: SpeculativeDecoder) -> list[tuple[list[int], int, torch.Tensor]]:
    """Wrap the decoder's drafter: per propose with shadow tokens, (pos of t per row, shadow
    tokens asked for, verdicts returned)."""
    calls: list[tuple[list[int], int, torch.Tensor]] = []
    propose = dec.drafting.propose

    def wrapped(t, pos, k, generator, keep=None, shadow=0):
        prop = propose(t, pos, k, generator, keep, shadow)
        if shadow:
            assert prop.shadow is not None and prop.shadow.shape[1] <= shadow
            calls.append((pos.tolist(), shadow, prop.shadow.clone()))
        return prop

    dec.drafting.propose = wrapped
    return calls


@torch.no_grad()
def _brute(drafter, seq: list[int], idx: int, sampling: Sampling) -> float:
    """q's verdict on seq[idx] from a cache-free forward over seq[:idx]."""
    logits = drafter(torch.tensor([seq[:idx]])).logits[0, -1, :64]
    if sampling.greedy:
        return float(int(logits.argmax()) == seq[idx])
    return float(probs_from_logits(logits, sampling)[seq[idx]])


def _check(calls, drafter, seqs: list[list[int]], sampling: Sampling) -> int:
    """Every verdict equals the brute-force one; returns how many were checked."""
    checked = 0
    for pos, _, seen in calls:
        s = seen.shape[1]
        for r, p in enumerate(pos):
            for j in range(s):
                idx = p - s + 1 + j  # the shadow tokens end at the pending token t (at pos)
                want = _brute(drafter, seqs[r], idx, sampling)
                assert float(seen[r, j]) == pytest.approx(want, abs=1e-5), (r, idx)
                checked += 1
    return checked


@pytest.mark.parametrize("drafting", ["autoregressive", "parallel"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_shadow_verdicts_equal_a_brute_force_forward(pair, drafting, temperature):
    target, drafter = pair
    sampling = Sampling(temperature=temperature, top_k=0, top_p=1.0)
    cfg = DecoderConfig(
        max_new_tokens=48,
        draft_length="confidence",
        probe_every=2,
        draft_costs=DEAR,
        sampling=sampling,
        drafting=drafting,
        mask_token_id=63 if drafting == "parallel" else None,
    )
    dec = SpeculativeDecoder(target, drafter, cfg)
    calls = _record(dec)
    gen = torch.Generator().manual_seed(0)
    checked = 0
    for prompt in prompts(5, 64, seed=11):
        calls.clear()
        out = dec.generate(torch.tensor([prompt]), generator=gen)
        checked += _check(calls, drafter, [prompt + out.tokens[0]], sampling)
    assert checked >= 12  # the floor skipped steps and the probes read them


def test_shadow_verdicts_batched_uneven_prompts(pair, monkeypatch):
    target, drafter = pair
    # the probe ladder without its jump (`doubt` 0): more probes, more verdicts to check
    monkeypatch.setattr(DraftLengthPolicy, "doubt", 0.0)
    cfg = DecoderConfig(
        max_new_tokens=24, draft_length="confidence", probe_every=2, draft_costs=DEAR
    )
    dec = SpeculativeDecoder(target, drafter, cfg)
    calls = _record(dec)
    rows = prompts(4, 64, seed=12)
    ids, mask = left_pad(rows)
    out = dec.generate(ids, mask)
    seqs = [prompt + toks for prompt, toks in zip(rows, out.tokens)]
    # rows past their end still take plain steps; check the rows that were active
    checked = 0
    for pos, shadow, seen in calls:
        live = [r for r in range(len(rows)) if pos[r] < len(seqs[r])]
        sub = [([pos[r] for r in live], shadow, seen[live])]
        checked += _check(sub, drafter, [seqs[r] for r in live], Sampling())
    assert checked >= 10
    for r, prompt in enumerate(rows):
        assert out.tokens[r] == greedy_reference(target, prompt, 24)


def test_observe_shadow_feeds_the_floors_averages():
    pol = make_policy("confidence", 4, 8, CHEAP)
    pol.start(2)
    fe = pol.floor_ema
    pol.observe_shadow([[1.0, 1.0, 0.0, 1.0], [0.25]], [True, True], pairs=True, block=True)
    # row 0: every verdict feeds first (1, 1, 0, 1); those after a hit feed follow (1, 0); a
    # block of n moves an average by the weight of n single updates, its values weighed alike
    keep4, keep2 = (1 - fe) ** 4, (1 - fe) ** 2
    assert pol.first[0] == pytest.approx(keep4 * 0.5 + (1 - keep4) * 0.75)
    assert pol.follow[0] == pytest.approx(keep2 * 0.5 + (1 - keep2) * 0.5)
    recent0 = 0.5
    for ok in (1.0, 1.0, 0.0, 1.0):  # `recent` takes them one at a time
        recent0 = (1 - pol.ema) * recent0 + pol.ema * ok
    assert pol.recent[0] == pytest.approx(recent0)
    assert pol.first[1] == pytest.approx(0.5 * (1 - fe) + fe * 0.25)  # one verdict: one update
    assert pol.follow[1] == 0.5
    assert pol._life["first"] == [3.25, 5]
    assert pol._life["follow"] == [1.0, 2]
    assert pol._life["all"] == [3.25, 5]
    assert pol.shadowed
    seq = make_policy("confidence", 4, 8, CHEAP)  # greedy: one verdict at a time, newest last
    seq.start(1)
    seq.observe_shadow([[1.0, 1.0, 0.0, 1.0]], [True], pairs=True)
    first0, follow0 = 0.5, 0.5
    for ok in (1.0, 1.0, 0.0, 1.0):
        first0 = (1 - fe) * first0 + fe * ok
    for ok in (1.0, 0.0):
        follow0 = (1 - fe) * follow0 + fe * ok
    assert seq.first[0] == pytest.approx(first0) and seq.follow[0] == pytest.approx(follow0)
    assert seq.recent[0] == pytest.approx(recent0)
    assert seq._life == {"first": [3.0, 4], "follow": [1.0, 2], "all": [3.0, 4]}
    other = make_policy("confidence", 4, 8, CHEAP)
    other.start(1)
    other.observe_shadow([[1.0, 1.0]], [True], pairs=False)  # every verdict is a first draft
    assert other._life["first"] == [2.0, 2] and other._life["follow"] == [0.0, 0]
    idle = make_policy("confidence", 4, 8, CHEAP)
    idle.start(2)
    idle.observe_shadow([[0.0], [1.0]], [True, False], pairs=True)  # finished rows learn nothing
    assert idle.first[1] == 0.5 and idle._life["first"] == [0.0, 1]


def test_a_block_of_verdicts_is_order_free():
    """Sampled verdicts arrive together: their order inside the block is not recency, so any
    order leaves the floor's averages in the same state."""
    rng = torch.Generator().manual_seed(5)
    row = (torch.rand(40, generator=rng) < 0.8).double().tolist()
    states = []
    for order in (row, row[::-1], sorted(row)):
        pol = make_policy("confidence", 4, 8, CHEAP)
        pol.start(1)
        pol.observe_shadow([order], [True], pairs=False, block=True)
        states.append((pol.first[0], *pol._life["first"]))
    assert states[1] == pytest.approx(states[0]) and states[2] == pytest.approx(states[0])


def test_a_drafter_below_break_even_rarely_looks_as_if_it_paid():
    """A probe after 64 skipped steps of a drafter accepted 45% of the time, where drafting pays
    from ~60% on (c 0.4): judged on the block's verdicts weighed alike (sampling), the floor
    switches drafting back on in under 3% of probes; fed one by one (greedy: the last ~10
    verdicts set the average) it would in over 5%, each a false start of rounds that lose."""
    costs = DraftCosts(c=0.4, verify_per_token=0.1, round_overhead=0.1)
    assert costs.round_cost(1) == pytest.approx(1.6)  # 1 + a > 1.6: a > 0.6
    rng = torch.Generator().manual_seed(11)
    block, single, trials = 0, 0, 400
    for _ in range(trials):
        row = (torch.rand(64, generator=rng) < 0.45).double().tolist()
        pol = make_policy("confidence", 4, 8, costs)
        pol.start(1)
        pol.observe_shadow([row], [True], pairs=False, block=True)
        block += pol._pays([True])
        one = make_policy("confidence", 4, 8, costs)
        one.start(1)
        one.observe_shadow([row], [True], pairs=False)
        single += one._pays([True])
    assert block / trials < 0.03
    assert single / trials > 0.05


@pytest.mark.parametrize("with_shadow", [True, False])
def test_a_pessimistic_floor_drafts_again_after_one_probe(with_shadow):
    """A drafter that is the target (every draft accepted) behind a lifetime prior of no
    acceptance: the floor starts with plain steps. The first probe's catch-up reads the skipped
    tokens; their verdicts (all hits) switch drafting back on at once. Without them one accepted
    probe moves the average by floor_ema only, and the floor stays on for more intervals."""
    target = tiny_llama(vocab=64, layers=2, hidden=32, seed=3)
    cfg = DecoderConfig(
        max_new_tokens=40, draft_length="confidence", probe_every=4, draft_costs=CHEAP
    )
    dec = SpeculativeDecoder(target, target, cfg)
    prompt = prompts(1, 64, seed=13)[0]
    dec.generate(torch.tensor([prompt]))  # builds the policy
    pol = dec.get_policy(None)
    pol._life = {"first": [0.0, 200.0], "follow": [0.0, 200.0], "all": [0.0, 400.0]}
    # ... and, to match, a lifetime of plain steps: a realized rate of 1 to start from
    pol._life_rate, pol.tokens, pol.cost = [200.0, 200.0], [], []
    pol.skipped, pol.interval = 0, cfg.probe_every
    if not with_shadow:
        pol.observe_shadow = lambda *a, **k: None
    out = dec.generate(torch.tensor([prompt]))
    assert out.tokens[0] == greedy_reference(target, prompt, 40)
    plain = out.draft_lengths[0]
    if with_shadow:
        assert plain <= cfg.probe_every + 1
    else:
        assert plain > 2 * cfg.probe_every


def test_modeled_speedup_by_hand():
    """Tokens over the modeled time of the rounds: 3 plain steps (1 each), two 1-draft rounds
    and one 3-draft round at c 0.5, verify_per_token 0.1, overhead 0.2."""
    costs = DraftCosts(c=0.5, verify_per_token=0.1, round_overhead=0.2)
    one = 0.5 + 1 + 0.2 + 0.1
    three = 1.5 + 1 + 0.2 + 0.3
    assert modeled_speedup([3, 2, 0, 1], 10, costs) == pytest.approx(10 / (3 + 2 * one + three))
    assert modeled_speedup([5], 5, costs) == 1.0  # plain steps only: target-only speed
    assert modeled_speedup([], 0, costs) == 0.0


def test_failed_probes_back_off_to_the_cap_and_a_paying_one_resets():
    """Each probe that does not pay doubles the interval, up to max_backoff probe_every (a
    drafter that never pays probes rarely: its probes cost a prefill and a catch-up); the first
    probe that pays brings it back to probe_every."""
    pol = make_policy("confidence", 4, 4, CHEAP, probe_every=2)
    pol.start(1)
    intervals = []

    def run_until_probe(accepted: int) -> None:
        while True:
            pol.first, pol.follow = [0.01], [0.01]  # drafting looks hopeless before each round
            plan = pol.plan(4, [True])
            if plan.k == 0:
                pol.observe_step([True])
                continue
            pol.observe([plan.k], [min(accepted, plan.k)], [True], [[0.5] * plan.k])
            if plan.probe:
                intervals.append(pol.interval)
                return

    for _ in range(9):
        run_until_probe(accepted=0)
    cap = pol.max_backoff * pol.probe_every
    assert cap == 128
    assert intervals == [4, 8, 16, 32, 64, 128, 128, 128, 128]
    run_until_probe(accepted=4)  # every draft accepted: the probe paid
    assert intervals[-1] == pol.probe_every


FLOOR = {"probe_every": 2, "lookup": False}
LOOKUP = {"draft_costs": CHEAP, "lookup": True}  # greedy outputs repeat: lookup rounds


@pytest.mark.parametrize(
    ("drafting", "temperature", "setting"),
    [
        ("autoregressive", 1.0, {**FLOOR, "draft_costs": SOMETIMES}),
        ("parallel", 1.0, {**FLOOR, "draft_costs": SOMETIMES_PARALLEL}),
        ("autoregressive", 0.0, LOOKUP),
        ("parallel", 0.0, LOOKUP),
    ],
    ids=[
        "ar-after-floor-steps",
        "parallel-after-floor-steps",
        "ar-after-lookup",
        "parallel-after-lookup",
    ],
)
def test_every_drafts_q_is_a_cache_free_forward(pair, drafting, temperature, setting, monkeypatch):
    """Losslessness cannot see a drafter fed the wrong tokens or positions (the verify corrects
    it, only acceptance drops; vLLM PR 55257's one-token shift of a PARD drafter): every draft's
    q (sampling; greedy: q's probability of its draft, the confidence) must come from a
    cache-free forward over the prompt, the tokens emitted so far and what follows them in the
    round (autoregressive: its earlier drafts; parallel: mask tokens), also after the plain steps
    and lookup rounds whose tokens the drafter reads late (its lag)."""
    target, drafter = pair
    monkeypatch.setattr(DraftLengthPolicy, "doubt", 0.0)  # the probe ladder: more probes
    sampling = Sampling(temperature=temperature)
    mask_id = 63 if drafting == "parallel" else None
    cfg = DecoderConfig(
        max_new_tokens=48,
        max_draft=3,
        draft_length="confidence",
        sampling=sampling,
        drafting=drafting,
        mask_token_id=mask_id,
        **setting,
    )
    dec = SpeculativeDecoder(target, drafter, cfg)
    rounds: list[tuple[int, list[int], torch.Tensor | None, list[float]]] = []
    state: dict = {}
    propose, play = dec.drafting.propose, dec._round

    def spy_propose(*args, **kw):
        prop = propose(*args, **kw)
        q = None if prop.q is None else prop.q[0].clone()
        rounds.append((len(state["out"].tokens[0]), prop.tokens[0].tolist(), q, prop.conf[0]))
        return prop

    def spy_round(st):
        state["out"] = st.out
        return play(st)

    dec.drafting.propose, dec._round = spy_propose, spy_round
    gen = torch.Generator().manual_seed(0)
    checked = lagged = 0
    for prompt in prompts(5, 64, seed=13):
        rounds.clear()
        out = dec.generate(torch.tensor([prompt]), generator=gen)
        seq = prompt + out.tokens[0]
        lagged += out.lookup_rounds + out.draft_lengths[0]
        for done, drafts, q, conf in rounds:
            chain = seq[: len(prompt) + done]
            for j, d in enumerate(drafts):
                with torch.inference_mode():
                    if mask_id is None:
                        logits = drafter(torch.tensor([chain])).logits[0, -1, :64]
                    else:  # one forward: q_j at the (j-1)-th mask after the real tokens
                        real = chain[: len(chain) - j]
                        x = torch.tensor([real + [mask_id] * (len(drafts) - 1)])
                        logits = drafter(x).logits[0, len(real) - 1 + j, :64]
                if q is None:  # greedy: the draft is q's argmax, its confidence q's probability
                    assert d == int(logits.argmax()), (len(chain), j)
                    want = float(torch.softmax(logits.float(), -1)[d])
                    assert conf[j] == pytest.approx(want, abs=1e-6), (len(chain), j)
                else:
                    want_q = probs_from_logits(logits, sampling)
                    assert torch.allclose(q[j, :64].float(), want_q, atol=1e-6), (len(chain), j)
                chain = [*chain, d]
                checked += 1
    assert checked >= 30 and lagged >= 20  # drafts checked, many after the drafter lagged
