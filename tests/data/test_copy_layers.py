"""copy:K: the induction score, the layer search against brute force, and the cached build."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from specdistill.data.models.copy_layers import _stack_scores, choose_copy_layers, induction_score
from specdistill.data.models.drafter_from_target import CopyLayers, ensure_drafter, parse_layers
from specdistill.data.runtime import ConfigError
from tests.data.gguf_models import tiny_bpe, tiny_llama


def test_induction_score_reads_the_token_after_the_first_occurrence():
    n = 5
    uniform = torch.full((1, 2, 2 * n, 2 * n), 1 / (2 * n))
    induct = uniform.clone()
    for i in range(n, 2 * n):  # head 1 of this layer attends only to i - n + 1
        induct[0, 1, i] = 0
        induct[0, 1, i, i - n + 1] = 1
    prev = uniform.clone()
    for i in range(1, 2 * n):  # a previous-token head is not an induction head
        prev[0, 0, i] = 0
        prev[0, 0, i, i - 1] = 1
    got = induction_score([uniform, induct, prev], n)
    assert got[0] == pytest.approx(1 / (2 * n)) and got[1] == pytest.approx(1.0)
    assert got[2] == pytest.approx(1 / (2 * n))


def _table_score(seed: int):
    """A deterministic score per layer set, so the search can be replayed by brute force."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(12, 12, generator=g)

    def score(layers):
        return float(sum(w[a, b] for a, b in itertools.pairwise(layers)) + 0.01 * len(layers))

    return score


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("k", [3, 4, 6])
def test_search_is_the_best_pair_then_greedy(seed, k):
    score, num = _table_score(seed), 12
    first = list(range(min(2, k - 2)))
    pairs = [[*first, p, t] for t in range(len(first) + 1, num) for p in range(len(first), t)]
    want = max(pairs, key=score)  # brute force over every (previous, induction) pair
    while len(want) < k:  # then each added layer the best of all the rest
        want = max(
            (sorted([*want, i]) for i in range(num) if i not in want),
            key=score,
        )
    got = choose_copy_layers(score, num, k)
    assert got == want and len(got) == k == len(set(got)) and got == sorted(got)
    assert got[: len(first)] == first


def test_candidates_limit_the_induction_layer():
    score = _table_score(0)
    got = choose_copy_layers(score, 12, 4, candidates=[7])
    assert got[-1] == 7 and got[:2] == [0, 1]


def test_parse_copy_choice():
    assert parse_layers("copy:4", 30) == CopyLayers(4)
    assert parse_layers(CopyLayers(5), 30) == CopyLayers(5)
    cases = [
        ("copy:2", 30, r"copy:K needs K >= 3 .* 30 layers: use copy:3 or more"),
        ("copy:1", 2, r"copy:K needs K >= 3 .* 2 layers: use first:K or spread:K instead"),
        ("copy:31", 30, r"K=31 is more layers than the target has \(30\)"),
        ("copy:x", 30, r"must be a positive integer"),
    ]
    for bad, n, match in cases:
        with pytest.raises(ConfigError, match=r"pair\.drafter_layers=.*" + match):
            parse_layers(bad, n)


@pytest.fixture
def target_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_HOME", str(tmp_path / "home"))
    tok = tiny_bpe()
    tiny_llama(len(tok), layers=6).save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    return tmp_path / "target"


def test_stack_scores_are_those_of_the_built_drafter(target_dir):
    """The probe cuts the stack in place: its attentions equal a drafter built from the layers."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, attn_implementation="eager")
    n = 6
    run = torch.randint(10, 100, (2, n), generator=torch.Generator().manual_seed(0))
    ids = torch.cat([run, run], 1)
    built = ensure_drafter(str(target_dir), "1,3,4")
    drafter = AutoModelForCausalLM.from_pretrained(built, attn_implementation="eager")
    with torch.no_grad():
        want = induction_score(drafter.model(input_ids=ids, output_attentions=True).attentions, n)
    assert _stack_scores(target.eval(), [1, 3, 4], ids, n) == pytest.approx(want, abs=1e-6)
    assert target.config.num_hidden_layers == 6 and len(target.model.layers) == 6  # restored


def test_copy_choice_builds_once_and_caches_the_probe(target_dir, monkeypatch):
    import specdistill.data.models.copy_layers as probe
    from specdistill.data.models.drafter_from_target import INFO_FILE

    out = ensure_drafter(str(target_dir), "copy:4")
    info = json.loads((out / INFO_FILE).read_text())
    layers = info["layers"]
    assert len(layers) == 4 and layers[:2] == [0, 1] and layers == sorted(set(layers))
    found = json.loads(next(out.parent.glob("copy-4-v*.json")).read_text())
    assert found["layers"] == layers and len(found["induction_by_layer"]) == 6

    def no_probe(*a, **k):
        raise AssertionError("probed again")

    monkeypatch.setattr(probe, "copy_layers", no_probe)
    assert ensure_drafter(str(target_dir), "copy:4") == out
