"""Draft vocabulary (decode.draft_vocab): the drafter's head over a token subset, still lossless."""

from __future__ import annotations

import copy

import pytest
import torch

from specdistill.data.runtime import ConfigError
from specdistill.data.sampling import Sampling
from specdistill.decode.draft_vocab import (
    CONFIG_KEY,
    SubsetHead,
    choose_draft_vocab,
    draft_vocab_of,
    draft_vocab_size,
    subset_head,
    swapped_head,
)
from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from tests.conftest import tiny_llama
from tests.decode.test_distribution import (
    PROMPT,
    H,
    chi2_pvalue,
    empirical,
    exact_sequence_probs,
    models,  # noqa: F401  (fixture)
)
from tests.decode.test_speculative import greedy_reference, left_pad, prompts, truncated_copy


def test_choose_draft_vocab_ranks_by_count_then_pads_with_low_ids():
    seqs = [[5, 5, 5, 9, 9, 2], [9, 7, 7, 5]]  # counts: 5 x4, 9 x3, 7 x2, 2 x1
    assert choose_draft_vocab(seqs, 16, 3) == [5, 9, 7]
    assert choose_draft_vocab(seqs, 16, 3, always=[11]) == [11, 5, 9]  # EOS first
    assert choose_draft_vocab([[3, 4], [4, 3]], 16, 2) == [3, 4]  # ties: lower id first
    # fewer distinct tokens than asked: the lowest unused ids fill it
    assert choose_draft_vocab(seqs, 16, 7) == [5, 9, 7, 2, 0, 1, 3]
    assert choose_draft_vocab(seqs, 4, 8) == [0, 1, 2, 3]
    assert choose_draft_vocab([[99, -1, 3]], 16, 2) == [3, 0]  # out-of-range ids ignored


def test_draft_vocab_size_setting():
    assert draft_vocab_size("auto", 49152) == 4096
    assert draft_vocab_size("auto", 4096) == 0  # the toy vocabulary keeps its full head
    assert draft_vocab_size("none", 49152) == draft_vocab_size(0, 49152) == 0
    assert draft_vocab_size(100, 64) == 64
    for bad in (-3, "many", True, 1.5):
        with pytest.raises(ConfigError, match="draft_vocab="):
            draft_vocab_size(bad, 100)


@torch.no_grad()
def test_subset_head_scores_the_subset_only_and_follows_updates():
    model = tiny_llama(vocab=64, layers=1, hidden=32, seed=3)
    ids = [7, 3, 60, 12]
    x = torch.randn(2, 5, 32)
    name, head = subset_head(model, ids)
    full = model.lm_head(x)
    out = head(x)
    assert torch.allclose(out[..., ids], full[..., ids], atol=1e-6)
    rest = [t for t in range(64) if t not in ids]
    assert bool((out[..., rest] == torch.finfo(out.dtype).min).all())
    assert torch.softmax(out, -1)[..., rest].sum() == 0  # q = 0 outside the subset
    # an in-place update of the full head (an optimizer step) reaches the copy
    model.lm_head.weight.mul_(2.0)
    with swapped_head(model, (name, head)):
        assert model.lm_head is head
        assert torch.allclose(model.lm_head(x)[..., ids], 2 * full[..., ids], atol=1e-5)
    assert isinstance(model.lm_head, torch.nn.Linear) and not isinstance(
        model.lm_head, SubsetHead
    )  # restored: training forwards see the full head


def _with_vocab(model, ids):
    m = copy.deepcopy(model)
    setattr(m.config, CONFIG_KEY, list(ids))
    return m


@pytest.fixture(scope="module")
def pair():
    target = tiny_llama(vocab=64, layers=3, hidden=32, seed=0)
    return target, truncated_copy(target)


@pytest.mark.parametrize("gamma", [1, 3])
def test_greedy_stays_token_identical_with_a_draft_vocab(pair, gamma):
    target, drafter = pair
    g = torch.Generator().manual_seed(1)
    subset = torch.randperm(64, generator=g)[:24].tolist()
    small = _with_vocab(drafter, subset)
    cfg = DecoderConfig(gamma=gamma, max_new_tokens=20, record_probs=True)  # rounds kept
    dec = SpeculativeDecoder(target, small, cfg)
    full = SpeculativeDecoder(
        target, small, DecoderConfig(gamma=gamma, max_new_tokens=20, draft_vocab="full")
    )
    assert dec.draft_head is not None and full.draft_head is None
    rows = prompts(4, 64, seed=gamma)
    drafted, alpha_sub, alpha_full = set(), [], []
    for prompt in rows:  # batch 1
        out = dec.generate(torch.tensor([prompt]))
        assert out.tokens[0] == greedy_reference(target, prompt, 20)
        drafted.update(t for r in out.rounds for t in r.draft.flatten().tolist())
        alpha_sub.append(out.alpha)
        alpha_full.append(full.generate(torch.tensor([prompt])).alpha)
    assert drafted and drafted <= set(subset)  # every draft came from the subset
    assert sum(alpha_sub) < sum(alpha_full)  # and it mattered: tokens outside were never drafted
    ids, mask = left_pad(rows)  # batched, uneven prompts
    out = dec.generate(ids, mask)
    assert out.tokens == [greedy_reference(target, p, 20) for p in rows]
    # the drafter itself is untouched outside decode steps
    assert isinstance(small.lm_head, torch.nn.Linear) and not isinstance(small.lm_head, SubsetHead)


def test_sampling_with_a_draft_vocab_matches_the_target_distribution(models):  # noqa: F811
    """q is 0 outside the subset, so the residual alone must produce those tokens: chi-square."""
    target, drafter = models
    s = Sampling(1.0)
    exact = exact_sequence_probs(target, s)
    small = _with_vocab(drafter, [0, 2, 3, 5])  # half the vocabulary of 8
    dec = SpeculativeDecoder(target, small, DecoderConfig(gamma=2, max_new_tokens=H, sampling=s))
    n = 8192
    counts = empirical(dec, n, seed=21)
    rec = SpeculativeDecoder(
        target, small, DecoderConfig(gamma=2, max_new_tokens=H, sampling=s, record_probs=True)
    )
    outside = {t for seq in counts for t in seq} - {0, 2, 3, 5}
    assert outside  # tokens the drafter can never propose still come out, at the target's rate
    assert chi2_pvalue(exact, counts, n) > 1e-3
    ids = torch.tensor([PROMPT] * 256)
    out = rec.generate(ids, generator=torch.Generator().manual_seed(0))
    assert out.rounds and {t for r in out.rounds for t in r.draft.flatten().tolist()} <= {
        0,
        2,
        3,
        5,
    }


def test_broken_draft_vocab_is_one_clear_error(pair):
    target, drafter = pair
    for bad in ([1, 1, 2], [3, 64], [], ["a"]):
        with pytest.raises(ConfigError, match=CONFIG_KEY):
            SpeculativeDecoder(target, _with_vocab(drafter, bad), DecoderConfig())
    with pytest.raises(ConfigError, match="decoder.draft_vocab="):
        SpeculativeDecoder(target, drafter, DecoderConfig(draft_vocab="small"))
    assert draft_vocab_of(drafter) is None


def test_distill_stores_the_draft_vocab_in_the_checkpoint(tmp_path):
    from specdistill.distill.train.data import Example
    from specdistill.distill.train.setup import set_draft_vocab

    class Tok:
        eos_token_id = 63

    model = tiny_llama(vocab=64, layers=1, hidden=32, seed=4)
    rows = [Example([1, 2, 3], [9, 9, 8]), Example([2], [9, 8, 7, 7])]
    assert set_draft_vocab(5, model, rows, Tok(), mask_id=None) == 5
    assert getattr(model.config, CONFIG_KEY) == [63, 9, 2, 7, 8]
    model.save_pretrained(tmp_path)
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert draft_vocab_of(loaded) == [63, 9, 2, 7, 8]
    # auto keeps a small vocabulary's full head; none drops an earlier run's list
    assert set_draft_vocab("auto", loaded, rows, Tok(), None) == 0
    assert draft_vocab_of(loaded) == [63, 9, 2, 7, 8]
    assert set_draft_vocab("none", loaded, rows, Tok(), None) == 0
    assert draft_vocab_of(loaded) is None
    # the parallel mask token is never in it
    ids = set_draft_vocab(5, model, rows, Tok(), mask_id=9)
    assert ids == 4 and 9 not in getattr(model.config, CONFIG_KEY)


def test_attach_draft_vocab_cli_writes_a_loadable_checkpoint(tmp_path, capsys):
    """The CLI stores the Seq-KD rows' most frequent ids (EOS in, the mask id out) in a copy
    of a trained drafter; the decoder then drafts over them; bad input is one error line."""
    import json

    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from specdistill.decode.draft_vocab import draft_vocab_of, main

    model = tiny_llama(vocab=64, layers=1, hidden=32, seed=2)
    model.config.eos_token_id = 0
    model.config.mask_token_id = 5
    src, out, data = tmp_path / "d", tmp_path / "dv", tmp_path / "seqkd"
    model.save_pretrained(src)
    Dataset.from_dict(
        {"prompt_ids": [[5, 7, 7, 9], [9, 9]], "completion_ids": [[7, 9, 11], [11, 12, 5]]}
    ).save_to_disk(str(data))
    main(["--drafter", str(src), "--data", str(data), "--size", "6", "--out", str(out)])
    printed = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(printed)["draft_vocab"] == 5  # 6 chosen, the mask dropped
    loaded = AutoModelForCausalLM.from_pretrained(out)
    # EOS first, then by count (9: 4, 7: 3, 11: 2, 5 (the mask): 2, 12: 1)
    assert draft_vocab_of(loaded) == [0, 9, 7, 11, 12]
    assert "draft_vocab_ids" not in json.loads((src / "config.json").read_text())
    for bad, field in ((["--size", "64"], "--size"), (["--data", str(tmp_path)], "--data")):
        args = ["--drafter", str(src), "--data", str(data), "--size", "6", *bad]
        with pytest.raises(SystemExit) as e:
            main(args)
        assert e.value.code == 2 and field in capsys.readouterr().err
