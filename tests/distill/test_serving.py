"""The serving mode reaches every stage, and the distill-time acceptance is the decoder's."""

from __future__ import annotations

import math

import pytest
import torch
from hydra import compose, initialize_config_module

from specdistill.data.io import read_json
from specdistill.data.runtime import ConfigError
from specdistill.data.sampling import Sampling
from specdistill.decode.acceptance import verify_greedy, verify_sampling
from specdistill.distill.compose import compose_stage
from specdistill.distill.pipeline import execute
from specdistill.distill.pipeline import stage as pipeline
from specdistill.distill.pipeline.plan import serving_overrides
from specdistill.distill.pipeline.serving import check_recipe, check_serving
from specdistill.distill.train.evaluate import evaluate, serving_acceptance
from tests.distill.test_pipeline import FAST

SAMPLING_07 = ["serving=sampling", "serving.sampling.temperature=0.7", "serving.sampling.top_p=0.9"]


def _pipeline_cfg(*overrides: str):
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        return compose(config_name="pipeline", overrides=["pair=toy-tiny", *overrides])


def _stage(stage: str, cfg):
    """The stage's config exactly as the pipeline composes it."""
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        return compose_stage(stage, cfg, serving_overrides(cfg).get(stage, []))


def test_greedy_serving_reaches_generate_distill_and_validate():
    cfg = _pipeline_cfg()
    assert cfg.serving.mode == "greedy" and cfg.recipe.name == "greedy"
    gen, dis, val = (_stage(s, cfg) for s in ("generate", "distill", "validate"))
    assert gen.sampling.temperature == 0.0  # greedy Seq-KD
    assert (dis.loss.name, dis.lmbda, dis.loss.temperature) == ("fkl", 0.0, 1.0)
    assert (dis.eval.source, dis.eval.sampling.temperature) == ("target", 0.0)  # greedy acceptance
    assert val.decoder.sampling.temperature == 0.0 and val.both_modes is True
    assert val.other_sampling.temperature == 1.0  # the sampling side reported beside greedy


def test_sampling_serving_reaches_generate_distill_validate_and_online():
    cfg = _pipeline_cfg(*SAMPLING_07)
    assert cfg.recipe.name == "sampling"  # the recipe follows the serving mode
    gen, dis, val, onl = (_stage(s, cfg) for s in ("generate", "distill", "validate", "online"))
    assert gen.sampling.temperature == 0.0  # the shipped sampling recipe: greedy Seq-KD rows
    assert (dis.loss.name, dis.lmbda) == ("fkl", 1.0)
    assert dis.loss.temperature == 0.7 and dis.onpolicy.sampling.temperature == 0.7
    ev = dis.eval.sampling
    assert (dis.eval.source, ev.temperature, ev.top_p) == ("target", 0.7, 0.9)
    for d in (val.decoder, onl.decoder):
        assert (d.sampling.temperature, d.sampling.top_p) == (0.7, 0.9)
    assert val.other_sampling.temperature == 0.7


def test_sampled_seqkd_recipe_and_user_overrides_win():
    cfg = _pipeline_cfg(*SAMPLING_07, "recipe.seqkd=sampled", "recipe.seqkd_temperature=serving",
                        "++distill.lmbda=0.5", "++validate.decoder.gamma=3")  # fmt: skip
    gen, dis, val = (_stage(s, cfg) for s in ("generate", "distill", "validate"))
    assert (gen.sampling.temperature, gen.sampling.top_p) == (0.7, 0.9)  # sampled Seq-KD
    assert dis.lmbda == 0.5 and dis.loss.name == "fkl"  # the user's stage key beats the recipe
    assert val.decoder.gamma == 3 and val.decoder.sampling.temperature == 0.7


def test_mixed_seqkd_recipe_sets_the_sampled_share():
    cfg = _pipeline_cfg("recipe.seqkd=mixed", "recipe.seqkd_share=0.25")
    gen = _stage("generate", cfg)
    assert (gen.sampling.temperature, gen.sampled_share) == (1.0, 0.25)
    assert _stage("generate", _pipeline_cfg()).sampled_share == 1.0  # greedy: nothing sampled


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["recipe.seqkd=mixed", "recipe.seqkd_share=1.0"], "recipe.seqkd_share"),
        (["recipe.seqkd=mixed", "recipe.seqkd_share=0"], "recipe.seqkd_share"),
        (["serving.mode=beam"], "serving.mode"),
        (["serving=sampling", "serving.sampling.temperature=0"], "serving.sampling.temperature"),
        (["serving.sampling.temperature=0.7"], "serving.sampling.temperature"),  # greedy + T
        (["serving=sampling", "serving.sampling.top_p=1.5"], "serving.sampling.top_p"),
        (["serving=sampling", "serving.sampling.top_k=-1"], "serving.sampling.top_k"),
        (["serving.report_sampling.temperature=0"], "serving.report_sampling.temperature"),
        (["recipe.loss=mse"], "recipe.loss"),
        (["recipe.lmbda=2"], "recipe.lmbda"),
        (["recipe.seqkd=beam"], "recipe.seqkd"),
    ],
)
def test_bad_serving_settings_fail_before_any_stage(tmp_path, monkeypatch, overrides, field):
    monkeypatch.setattr(execute, "_stage_runner", lambda s: pytest.fail(f"{s} started"))
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        pipeline.run(_pipeline_cfg(f"run_dir={tmp_path}", *overrides))


def test_check_helpers_accept_the_shipped_groups():
    for mode in ("greedy", "sampling", "balanced"):
        cfg = _pipeline_cfg(f"recipe={mode}")
        check_recipe(cfg.recipe)
    assert check_serving({"mode": "greedy", "sampling": {"temperature": 0}}).sampling.greedy


def _brute_process(logits: torch.Tensor, t: float, top_p: float) -> torch.Tensor:
    """Temperature then top-p, written out token by token (independent of process_logits)."""
    probs = torch.softmax(logits.double() / t, -1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = [], 0.0
    for i in order:
        if mass >= top_p:
            break
        kept.append(i)
        mass += probs[i]
    total = sum(probs[i] for i in kept)
    return torch.tensor([probs[i] / total if i in kept else 0.0 for i in range(len(probs))])


def _accept_prob_by_enumeration(p_logits, q_logits, sampling: Sampling, grid: int = 4000) -> float:
    """P(the decoder keeps a drafted token): every draft token x weighted by Q(x), and for
    each, the share of an even grid of uniforms that `verify_sampling` accepts."""
    p = _brute_process(p_logits, sampling.temperature, sampling.top_p).float()
    q = _brute_process(q_logits, sampling.temperature, sampling.top_p).float()
    u = (torch.arange(grid, dtype=torch.float32) + 0.5) / grid
    total = 0.0
    for x in range(len(q)):
        if q[x] == 0:
            continue
        n, _ = verify_sampling(
            torch.full((grid, 1), x),
            torch.stack([p, p]).expand(grid, 2, -1),
            q.expand(grid, 1, -1),
            u.unsqueeze(1),
            u,
        )
        total += float(q[x]) * float((n == 1).float().mean())
    return total


@pytest.mark.parametrize(("t", "top_p"), [(1.0, 1.0), (0.7, 0.9), (1.3, 0.6)])
def test_sampling_acceptance_is_the_decoders_exact_acceptance_probability(t, top_p):
    gen = torch.Generator().manual_seed(3)
    p_logits, q_logits = torch.randn(2, 4, 9, generator=gen) * 2
    s = Sampling(temperature=t, top_p=top_p)
    got = serving_acceptance(p_logits, q_logits, s)
    for pos in range(4):
        want = _accept_prob_by_enumeration(p_logits[pos], q_logits[pos], s)
        assert math.isclose(float(got[pos]), want, abs_tol=2e-3), (pos, float(got[pos]), want)


def test_greedy_acceptance_is_what_verify_greedy_accepts():
    gen = torch.Generator().manual_seed(4)
    p_logits, q_logits = torch.randn(2, 64, 5, generator=gen)
    got = serving_acceptance(p_logits, q_logits, Sampling())
    draft = q_logits.argmax(-1)  # greedy drafting
    for pos in range(64):
        n, _ = verify_greedy(draft[pos].view(1, 1), p_logits[pos].view(1, 1, 5).expand(1, 2, 5))
        assert float(got[pos]) == float(n)


def test_evaluate_masks_positions_and_refuses_stored_topk_at_another_temperature():
    gen = torch.Generator().manual_seed(5)
    vocab = 7

    class Fixed(torch.nn.Module):  # returns fixed logits whatever the input
        def __init__(self, logits):
            super().__init__()
            self.l = logits

        def forward(self, input_ids, attention_mask):
            return type("Out", (), {"logits": self.l})()

    p, q = torch.randn(2, 1, 6, vocab, generator=gen)
    mask = torch.tensor([[False, True, True, False, True, False]])
    batch = {"input_ids": torch.zeros(1, 6, dtype=torch.long),
             "attention_mask": torch.ones(1, 6, dtype=torch.long), "loss_mask": mask}  # fmt: skip
    s = Sampling(temperature=0.8, top_p=0.95)
    ev = evaluate(Fixed(q), Fixed(p), [batch], vocab=vocab, sampling=s)
    want = serving_acceptance(p, q, s)[mask].mean()
    assert math.isclose(ev["alpha"], float(want), rel_tol=1e-6) and ev["tokens"] == 3
    with pytest.raises(ConfigError, match="eval.sampling"):
        evaluate(Fixed(q), None, [batch], vocab=vocab, sampling=s)


def test_toy_tiny_pipeline_serving_sampling_reaches_every_stage(tmp_path):
    """A quick real run: the sampling setting lands in each stage's own record."""
    run_dir = tmp_path / "run"
    fast = [o for o in FAST if not o.startswith("++export")]
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        cfg = compose(
            config_name="pipeline",
            overrides=[*fast, f"run_dir={run_dir}", "stages=[generate,distill,validate]",
                       "validate_base=false", "++distill.max_steps=2", "++distill.eval.limit=4",
                       "++distill.eval.max_new_tokens=8", *SAMPLING_07],
        )  # fmt: skip
    result = pipeline.run(cfg)
    gen = read_json(run_dir / "generate" / "generation_config.json")
    assert gen["sampling"]["do_sample"] is False  # the sampling recipe: greedy Seq-KD rows
    dis = result.stages["distill"]
    assert dis["loss"]["name"] == "fkl" and dis["lmbda"] == 1.0
    assert dis["data"]["eval_source"] == "target"
    assert dis["data"]["eval_sampling"] == {"temperature": 0.7, "top_k": 0, "top_p": 0.9}
    cont = read_json(run_dir / "distill" / "eval_continuations" / "generation_config.json")
    assert cont["split"] == "test" and cont["sampling"]["do_sample"] is True
    assert (cont["sampling"]["temperature"], cont["sampling"]["top_p"]) == (0.7, 0.9)
    val = result.stages["validate"]
    assert (val["temperature"], val["top_p"]) == (0.7, 0.9)
    assert set(val["modes"]) == {"greedy", "sampling"}
    assert val["modes"]["sampling"]["alpha"] == val["alpha"]
    assert val["modes"]["greedy"]["temperature"] == 0.0 and val["modes"]["greedy"]["speedup"] > 0
    text = (run_dir / "summary.md").read_text()
    assert "alpha, temperature 0.7, top_p 0.9" in text and "alpha, greedy" in text
    assert "Served sampling at temperature 0.7, top_p 0.9; recipe `sampling`" in text


def test_switch_schedule_changes_loss_and_onpolicy_share_mid_run(
    distill_cfg, tmp_path, seqkd_dir, monkeypatch
):
    """A greedy-Seq-KD-then-on-policy schedule: steps before switch.at*max_steps train FKL on
    Seq-KD rows only, the rest TVD on drafter samples only."""
    from specdistill.distill.train import shared_vocab, step
    from specdistill.distill.train import stage as train

    seen: list[tuple[str, bool]] = []
    real_loss, real_sample = shared_vocab.distill_loss, step.sample_onpolicy
    sampled = {"now": False}

    def spy_sample(*a, **k):
        sampled["now"] = True
        return real_sample(*a, **k)

    def spy_loss(*a, divergence, **k):
        seen.append((divergence, sampled["now"]))
        sampled["now"] = False
        return real_loss(*a, divergence=divergence, **k)

    monkeypatch.setattr(shared_vocab, "distill_loss", spy_loss)
    monkeypatch.setattr(step, "sample_onpolicy", spy_sample)
    cfg = distill_cfg(tmp_path / "run", f"data.path={seqkd_dir}", "max_steps=4", "eval_every=4",
                      "loss=fkl", "switch.at=0.5", "switch.loss=tvd", "switch.lmbda=1.0",
                      "onpolicy.max_new_tokens=4")  # fmt: skip
    res = train.run(cfg)
    assert seen == [("fkl", False)] * 2 + [("tvd", True)] * 2
    assert res.lmbda == 0.0 and res.switch == {"at": 0.5, "loss": "tvd", "beta": None, "lmbda": 1.0}
    with pytest.raises(ConfigError, match="switch.at"):
        train.run(distill_cfg(tmp_path / "bad", f"data.path={seqkd_dir}", "switch.at=1.5"))


def test_a_schedule_recipe_reaches_the_distill_stage():
    cfg = _pipeline_cfg("+recipe.switch={at:0.5,loss:tvd,lmbda:1.0}")
    dis = _stage("distill", cfg)
    assert (dis.loss.name, dis.lmbda) == ("fkl", 0.0)
    assert (dis.switch.at, dis.switch.loss, dis.switch.lmbda) == (0.5, "tvd", 1.0)


def test_parallel_drafting_reaches_distill_and_validate():
    cfg = _pipeline_cfg("drafting=parallel")
    dis, val, gen = (_stage(s, cfg) for s in ("distill", "validate", "generate"))
    assert dis.drafting == "parallel" and val.decoder.drafting == "parallel"
    assert val.decoder.sampling.temperature == 0.0  # the serving mode still applies
    assert "drafting" not in gen
    plain = _pipeline_cfg()
    assert _stage("distill", plain).drafting == "autoregressive"
    assert _stage("validate", plain).decoder.drafting == "autoregressive"


def test_parallel_drafting_errors_name_the_setting():
    with pytest.raises(ConfigError, match="drafting='pard'"):
        serving_overrides(_pipeline_cfg("drafting=pard"))
    with pytest.raises(ConfigError, match="online"):
        serving_overrides(
            _pipeline_cfg("drafting=parallel", "stages=[generate,distill,online,validate]")
        )
