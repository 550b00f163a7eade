"""A drafter q with its own tokenizer (decode/drafters/mapped.py, text_context.py) keeps the
decoder lossless: greedy output is the target p's own greedy output in both context modes (batch
1 and batched, dynamic and static caches, adaptive lengths); sampled output follows p's
distribution (chi-square on an 8-token vocabulary whose overlap with the drafter's is partial,
so some target tokens can only come from the residual); q moved into the target's ids sums to 1
and equals a brute-force sum. Tokenizers are built at run time (tests/data/vocab_fixtures.py)."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from specdistill.data.models.vocab_mapping import VocabMapping, build_mapping, read_source
from specdistill.data.runtime import ConfigError, pad_rows
from specdistill.data.sampling import Sampling
from specdistill.decode.drafters.mapped import (
    MappedDrafter,
    check_context,
    make_mapped_vocab,
    restricted_target_logprobs,
)
from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from tests.conftest import tiny_llama
from tests.data import vocab_fixtures as fx
from tests.decode.test_distribution import PROMPT, H, chi2_pvalue, empirical, exact_sequence_probs
from tests.decode.test_speculative import greedy_reference

T_ROLES = {"eos_token": "<|endoftext|>", "pad_token": "<|pad|>"}
D_ROLES = {"eos_token": "</s>", "unk_token": "<unk>"}


def load(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def mapping_of(t_dir, d_dir) -> VocabMapping:
    return build_mapping(read_source(t_dir).table(), read_source(d_dir).table())


def mapped_copy(target, d2t: torch.Tensor, layers: int = 1, noise: float = 0.0, seed: int = 0):
    """A drafter over its own ids that is the target's first layers where the ids map (its
    embedding and head rows copied from the target's row d2t[d]); other rows random."""
    d = copy.deepcopy(target)
    d.model.layers = d.model.layers[:layers]
    d.config.num_hidden_layers = layers
    dv, hidden = d2t.numel(), target.config.hidden_size
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(dv, hidden, generator=g) * 0.5
    head = torch.randn(dv, hidden, generator=g) * float(target.lm_head.weight.detach().std())
    ok = d2t >= 0
    with torch.no_grad():
        emb[ok] = target.model.embed_tokens.weight[d2t[ok]]
        head[ok] = target.lm_head.weight[d2t[ok]] + noise * torch.randn(
            int(ok.sum()), hidden, generator=g
        )
    d.resize_token_embeddings(dv)
    d.model.embed_tokens.weight.data.copy_(emb)
    d.lm_head = torch.nn.Linear(hidden, dv, bias=False)
    d.lm_head.weight.data.copy_(head)
    d.config.vocab_size = dv
    d.config.tie_word_embeddings = False
    return d.eval()


# ------------------------------------------------------------------ byte-level pair (greedy)


@pytest.fixture(scope="module")
def bpe_pair(tmp_path_factory):
    """Two byte-level BPEs trained on different texts (partial overlap), tiny models."""
    root = tmp_path_factory.mktemp("mapped")
    t = fx.byte_level(fx.TEXT_A, 330, ["<|endoftext|>", "<|pad|>"])
    d = fx.byte_level(fx.TEXT_A[:1] + fx.TEXT_B, 300, ["</s>", "<unk>"])
    t_dir, d_dir = fx.save(t, root / "t", **T_ROLES), fx.save(d, root / "d", **D_ROLES)
    m = mapping_of(t_dir, d_dir)
    assert 0 < m.intersection_size < m.draft_vocab and m.target_mapped < m.target_vocab
    target = tiny_llama(vocab=m.target_vocab, layers=3, hidden=32, seed=1)
    drafter = mapped_copy(target, m.draft_to_target, noise=0.02)
    return target, drafter, m, load(t_dir), load(d_dir)


TEXTS = ["def add(a, b):", "for item in items:\n\tprint(", "class Point:\n    def ", "the quick"]


def decoder(pair, context: str, **cfg):
    target, drafter, m, t_tok, d_tok = pair
    mv = make_mapped_vocab(
        m, m.target_vocab, m.draft_vocab, draft_tokenizer=d_tok, target_tokenizer=t_tok,
        context=context,
    )  # fmt: skip
    return SpeculativeDecoder(target, drafter, DecoderConfig(**cfg), mapped=mv)


@pytest.mark.parametrize("context", ["tli", "text"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("draft_length", ["fixed", "heuristic", "confidence"])
def test_greedy_identity_batch1(bpe_pair, context, cache, draft_length):
    target, _, _, t_tok, _ = bpe_pair
    dec = decoder(bpe_pair, context, gamma=3, max_new_tokens=16, cache=cache,
                  draft_length=draft_length, max_draft=4)  # fmt: skip
    accepted = trials = 0
    for text in TEXTS:
        ids = t_tok(text, return_tensors="pt").input_ids
        out = dec.generate(ids)
        assert out.tokens[0] == greedy_reference(target, ids[0].tolist(), 16)
        accepted, trials = accepted + out.accepted, trials + out.trials
    if draft_length == "fixed":
        assert 0 < accepted < trials  # the drafter is neither useless nor perfect


@pytest.mark.parametrize("context", ["tli", "text"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("draft_length", ["fixed", "confidence"])
def test_greedy_identity_batched(bpe_pair, context, cache, draft_length):
    target, _, _, t_tok, _ = bpe_pair
    rows = [t_tok(x).input_ids for x in TEXTS]
    ids, mask = pad_rows(rows, t_tok.pad_token_id)
    dec = decoder(bpe_pair, context, gamma=3, max_new_tokens=14, cache=cache,
                  draft_length=draft_length)  # fmt: skip
    out = dec.generate(ids, mask)
    for r, row in enumerate(rows):
        assert out.tokens[r] == greedy_reference(target, row, 14), r
    if draft_length == "fixed":  # (confidence may floor this weak pair to plain target steps)
        assert out.accepted > 0


def test_text_context_reads_the_drafters_own_tokenization(bpe_pair):
    """Text mode: the drafter's cache holds its tokenizer's split of the target's text, not a
    token-by-token mapping (which would put unk where the target has a token it lacks)."""
    _, _, _m, t_tok, d_tok = bpe_pair
    dec = decoder(bpe_pair, "text", gamma=2, max_new_tokens=6)
    ids = t_tok(TEXTS[1], return_tensors="pt").input_ids
    out = dec.generate(ids)
    state = dec.drafting.drafter_state()
    text = t_tok.decode(state["rows"][0], skip_special_tokens=True)
    assert (
        text.startswith(TEXTS[1]) and len(state["rows"][0]) >= ids.shape[1] + len(out.tokens[0]) - 1
    )
    want = d_tok.encode(text, add_special_tokens=False)
    assert state["cached"][0][: len(want) - 2] == want[: len(want) - 2]


# ------------------------------------------------------------------ q in the target's ids


def test_q_in_target_ids_sums_to_one_and_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    d2t = torch.tensor([0, 1, 2, 2, 5, -1, 7, -1, 5])  # many-to-one (2, 5) and unmapped rows
    logits = torch.randn(3, 2, d2t.numel(), generator=g) * 3
    q = restricted_target_logprobs(logits, d2t >= 0, d2t.clamp(min=0), 9).exp()
    assert torch.allclose(q.sum(-1), torch.ones(3, 2), atol=1e-6)
    for b in range(3):
        for j in range(2):
            z = sum(logits[b, j, d].exp() for d in range(d2t.numel()) if d2t[d] >= 0)
            for x in range(9):
                want = sum(logits[b, j, d].exp() for d in range(d2t.numel()) if d2t[d] == x)
                assert float(q[b, j, x]) == pytest.approx(float(want / z), abs=1e-6)
    # the planted bug: q not restricted to the intersection puts unmapped mass on target id 0
    unrestricted = restricted_target_logprobs(logits, d2t >= -1, d2t.clamp(min=0), 9).exp()
    assert not torch.allclose(unrestricted, q, atol=1e-3)


def test_tli_maps_ids_in_with_unk_and_drafts_back(bpe_pair):
    _target, _drafter, m, _t_tok, d_tok = bpe_pair
    dec = decoder(bpe_pair, "tli", gamma=2, max_new_tokens=4)
    dr: MappedDrafter = dec.drafting
    unk = d_tok.unk_token_id
    ids = torch.arange(m.target_vocab)
    want = torch.where(m.target_to_draft >= 0, m.target_to_draft, torch.tensor(unk))
    assert torch.equal(dr.drafter_ids(ids), want)
    logq = dr.target_logits(torch.randn(2, m.draft_vocab))
    assert torch.isinf(logq[:, m.target_to_draft < 0]).all()  # never drafted: residual only


def test_bad_settings_are_one_line():
    with pytest.raises(ConfigError, match="decoder.mapped_context"):
        check_context("bytes")
    d2t = torch.tensor([-1, -1])
    m = VocabMapping(torch.tensor([-1, -1, -1]), d2t)
    tok = type("T", (), {"unk_token_id": None, "eos_token_id": 0})()
    with pytest.raises(ConfigError, match="shares no token"):
        make_mapped_vocab(m, 3, 2, draft_tokenizer=tok)


def test_parallel_drafting_is_refused(bpe_pair):
    with pytest.raises(ConfigError, match="decoder.drafting='parallel'"):
        decoder(bpe_pair, "tli", gamma=2, max_new_tokens=4, drafting="parallel", mask_token_id=1)


# ------------------------------------------------------------------ sampling (chi-square)


def tiny_bpe(vocab: list[str], merges: list[tuple[str, str]], unk: str | None = None):
    from tokenizers import Tokenizer, models

    return Tokenizer(models.BPE({t: i for i, t in enumerate(vocab)}, merges, unk_token=unk))


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory):
    """Target vocabulary of 8 (the chi-square horizon of test_distribution); the drafter shares
    eos, a, b, c, ab: target d, ba, cd only ever come from the residual."""
    root = tmp_path_factory.mktemp("small")
    t = tiny_bpe(
        ["<eos>", "a", "b", "c", "d", "ab", "ba", "cd"], [("a", "b"), ("b", "a"), ("c", "d")]
    )
    t.add_special_tokens(["<eos>"])
    d = tiny_bpe(
        ["<eos>", "<unk>", "a", "b", "c", "ab", "bc", "x"], [("a", "b"), ("b", "c")], "<unk>"
    )
    d.add_special_tokens(["<eos>", "<unk>"])
    t_dir = fx.save(t, root / "t", eos_token="<eos>", pad_token="<eos>")
    d_dir = fx.save(d, root / "d", eos_token="<eos>", unk_token="<unk>")
    m = mapping_of(t_dir, d_dir)
    assert m.draft_to_target.tolist() == [0, -1, 1, 2, 3, 5, -1, -1]
    from tests.decode.test_distribution import sharp_llama

    target = sharp_llama(seed=11, layers=2)
    drafter = mapped_copy(target, m.draft_to_target, noise=0.6, seed=3)
    with torch.no_grad():
        drafter.lm_head.weight.mul_(0.7)
    return target, drafter, m, load(t_dir), load(d_dir)


@pytest.mark.parametrize("context", ["tli", "text"])
@pytest.mark.parametrize(
    "sampling", [Sampling(1.0), Sampling(0.7, top_p=0.8)], ids=["t1", "t0.7-topp0.8"]
)
def test_sampled_output_follows_the_target(small_pair, context, sampling):
    target = small_pair[0]
    dec = decoder(small_pair, context, gamma=2, max_new_tokens=H, sampling=sampling)
    n = 8192
    counts = empirical(dec, n, seed=7)
    exact = exact_sequence_probs(target, sampling)
    ids = torch.tensor([PROMPT] * 512)
    alpha = dec.generate(
        ids, torch.ones_like(ids), generator=torch.Generator().manual_seed(1)
    ).alpha
    assert 0.05 < alpha < 0.95
    assert chi2_pvalue(exact, counts, n) > 1e-3


class UnrestrictedDrafts(MappedDrafter):
    """The planted bug: drafts drawn from the drafter's whole vocabulary (an unmapped draft sent
    to target id 0, as vLLM's map_draft_to_target_ids sends it to unk), while the rule is
    handed q restricted to the intersection."""

    def _draw(self, logits, generator, want_q):
        raw = torch.softmax(self._raw[:, -1].float(), -1)
        d = torch.multinomial(raw, 1, generator=generator)[:, 0]
        t = self.mapped.mapping.draft_to_target.to(d.device)[d].clamp(min=0)
        return t, torch.softmax(logits.float(), -1)

    def target_logits(self, logits):
        self._raw = logits
        return super().target_logits(logits)


def test_chi_square_catches_unrestricted_drafts(small_pair, monkeypatch):
    target = small_pair[0]
    s = Sampling(1.0)
    dec = decoder(small_pair, "tli", gamma=2, max_new_tokens=H, sampling=s)
    bad = UnrestrictedDrafts(small_pair[1], **{k: getattr(dec.drafting, k) for k in ("vocab", "sampling", "device", "max_draft", "compiled", "make_runner")}, mapped=dec.mapped)  # fmt: skip
    dec.drafting = bad
    n = 8192
    assert chi2_pvalue(exact_sequence_probs(target, s), empirical(dec, n, seed=5), n) < 1e-6


def test_small_pair_tokenizers_round_trip(small_pair):
    _, _, _, _t_tok, d_tok = small_pair
    assert json.dumps(d_tok.encode("abcd", add_special_tokens=False)) == "[5, 4, 1]"


# ------------------------------------------------------------------ validate end to end


@pytest.fixture(scope="module")
def mapped_drafter_dir(toy_tiny, tmp_path_factory):
    """A drafter with its own tokenizer for the toy-tiny target: the target's first layer over
    another byte-level BPE's ids (rows copied where the two spell the same bytes)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("mapped_validate")
    d = fx.byte_level(fx.TEXT_A + fx.TEXT_B, 320, ["</s>", "<unk>"])
    d_dir = fx.save(d, root / "drafter", **D_ROLES)
    m = mapping_of(toy_tiny.target_dir, d_dir)
    target = AutoModelForCausalLM.from_pretrained(toy_tiny.target_dir)
    m = m.resized(target.get_output_embeddings().weight.shape[0], m.draft_vocab)
    mapped_copy(target, m.draft_to_target, noise=0.05).save_pretrained(d_dir)
    return d_dir


@pytest.mark.parametrize("context", ["tli", "text"])
def test_validate_runs_a_mapped_pair(mapped_drafter_dir, tmp_path, context):
    from hydra import compose, initialize_config_module

    from specdistill.decode.validate.stage import run

    overrides = [
        "pair=toy-tiny", f"pair.drafter={mapped_drafter_dir}", "pair.vocab=mapped",
        "pair.min_vocab_coverage=0", f"decoder.mapped_context={context}", "decoder.gamma=2",
        f"output_dir={tmp_path}", "num_prompts=2", "max_new_tokens=8", "repeats=1",
        "step_time_iters=2", "plot=false", "both_modes=true",
    ]  # fmt: skip
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        cfg = compose(config_name="validate", overrides=overrides)
    r = run(cfg)
    assert r.lossless is True and r.mismatched_sequences == 0
    v = r.vocab_mapping
    assert v["context"] == context and 0 < v["intersection"] < v["draft_vocab"]
    assert 0 < v["output_coverage"] <= 1 and "sampling" in r.modes
    assert r.hf_assisted is not None  # universal assisted generation, or its one error line
    assert "vocabulary mapping" in (tmp_path / "report.md").read_text()


def test_bench_compares_a_mapped_drafter_beside_a_shared_one(
    mapped_drafter_dir, toy_tiny, tmp_path
):
    from hydra import compose, initialize_config_module

    from specdistill.decode.bench.drafters import run_drafters

    overrides = [
        "pair=toy-tiny", f"pair.drafter={mapped_drafter_dir}", "pair.vocab=mapped",
        "pair.min_vocab_coverage=0", f"compare_drafters=[{toy_tiny.drafter_dir}]",
        f"output_dir={tmp_path}", "num_prompts=2", "max_new_tokens=8", "repeats=1",
        "step_time_iters=2", "plot=false", "both_modes=false", "hf_assisted=false",
    ]  # fmt: skip
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        rows = run_drafters(compose(config_name="validate", overrides=overrides))
    assert [r["lossless"] for r in rows] == [True, True]
    assert rows[0]["vocab_mapping"]["context"] == "tli" and rows[1]["vocab_mapping"] is None
    assert "shared ids" in (tmp_path / "drafters.md").read_text()
