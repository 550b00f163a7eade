"""validate's timed repeats interleave target-only and speculative decoding batch by batch (as the
bench does), with each side's outputs what a whole pass with its own generator gives."""

from __future__ import annotations

import pytest
import torch

from specdistill.decode.outputs import DecodeOutput
from specdistill.decode.validate.modes import run_each, speedup_range, speedup_text, timed_repeats


class Recorder:
    """A stand-in decoder: records the call order; each output draws from its generator, so a
    changed random stream would change the tokens."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def _out(self, name: str, ids: torch.Tensor, generator: torch.Generator) -> DecodeOutput:
        self.calls.append((name, int(ids[0, 0])))
        draw = torch.randint(0, 100, (3,), generator=generator).tolist()
        return DecodeOutput(tokens=[draw])

    def baseline(self, ids, mask, generator=None):
        return self._out("baseline", ids, generator)

    def generate(self, ids, mask, generator=None):
        return self._out("speculative", ids, generator)


def test_batches_interleave_and_outputs_match_whole_passes():
    batches = [(torch.tensor([[b]]), torch.ones(1, 1)) for b in range(3)]
    dec = Recorder()
    passes: list = []
    base, spec, base_out, spec_out = timed_repeats(dec, batches, seed=5, repeats=2, passes=passes)
    order = [("baseline", 0), ("speculative", 0), ("baseline", 1), ("speculative", 1)]
    assert dec.calls[:4] == order and len(dec.calls) == 12
    assert len(base) == len(spec) == 2 and len(passes) == 2
    _, whole_base = run_each(Recorder().baseline, batches, 5)
    _, whole_spec = run_each(Recorder().generate, batches, 5)
    assert base_out.tokens == [t for o in whole_base for t in o.tokens]
    assert spec_out.tokens == [t for o in whole_spec for t in o.tokens]
    assert [o.tokens for o in passes[1].base_outs] != [o.tokens for o in whole_base]  # seed + 1


def test_speedup_range_pairs_each_repeats_own_passes():
    """Repeat i's speculative rate over repeat i's target-only rate (never across repeats):
    the range's ends are the lowest and highest of those ratios."""
    base, spec = [100.0, 200.0, 50.0], [110.0, 180.0, 60.0]
    assert speedup_range(base, spec) == [0.9, 1.2]
    # the medians' ratio (110 / 100 = 1.1, validate's `speedup`) alone hides that spread
    assert speedup_range([10.0], [9.0]) == [0.9, 0.9]
    with pytest.raises(ValueError):
        speedup_range([1.0, 2.0], [1.0])


def test_speedup_text_prints_the_range_only_where_repeats_differ():
    assert speedup_text(1.09, [1.05, 1.12]) == "1.09x (1.05-1.12)"
    assert speedup_text(1.09, [1.09, 1.09]) == "1.09x"
    assert speedup_text(1.09, None) == "1.09x"  # a report written before the range existed


def test_progress_bar_counts_every_batch_and_leaves_outputs_alone(capsys):
    """validate's bar (stderr) names the pass and counts each batch of each repeat; the decodes
    and their random streams are the same with and without it."""
    batches = [(torch.tensor([[b]]), torch.ones(1, 1)) for b in range(3)]
    quiet = timed_repeats(Recorder(), batches, seed=5, repeats=2)
    assert capsys.readouterr().err == ""
    shown = timed_repeats(Recorder(), batches, seed=5, repeats=2, progress="validate greedy")
    err = capsys.readouterr().err
    assert "validate greedy" in err and "6/6" in err and "prompt" in err
    assert shown[2].tokens == quiet[2].tokens and shown[3].tokens == quiet[3].tokens
