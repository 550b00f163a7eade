"""`pair.attn_implementation` reaches `from_pretrained` for every model the pair loads, and a
kernel name or a missing flash package is refused when the plan is built, in one line."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdistill.data.models import attention
from specdistill.data.models.attention import check_attn_implementation, kernel_on
from specdistill.data.models.pairs import load_role, resolve_pair
from specdistill.data.runtime import ConfigError
from tests.data.vocab_fixtures import TEXT_B, byte_level, save


def _no_flash(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        attention.importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith("flash_attn") else real(name, *a),
    )


@pytest.mark.parametrize("value", [None, ""])
def test_unset_is_transformers_choice(value):
    assert check_attn_implementation(value) is None


@pytest.mark.parametrize("name", ["eager", "sdpa", "flex_attention"])
def test_kernels_without_a_package_pass(name):
    assert check_attn_implementation(name) == name


def test_an_unknown_kernel_is_one_line_naming_the_field_and_the_names():
    with pytest.raises(ConfigError) as e:
        check_attn_implementation("flash2")
    (line,) = str(e.value).splitlines()
    assert line.startswith("pair.attn_implementation='flash2' is not an attention kernel")
    assert "flash_attention_2" in line and "sdpa" in line


@pytest.mark.parametrize(
    ("name", "package"),
    [("flash_attention_2", "flash_attn"), ("flash_attention_3", "flash_attn_interface")],
)
def test_a_flash_kernel_needs_its_package(monkeypatch, name, package):
    _no_flash(monkeypatch)
    with pytest.raises(ConfigError, match=f"needs the `{package}` package"):
        check_attn_implementation(name)
    monkeypatch.setattr(attention.importlib.util, "find_spec", lambda *_: object())
    assert check_attn_implementation(name) == name


def test_flash_kernels_fall_back_off_cuda_and_stay_on_cuda(caplog):
    assert kernel_on("flash_attention_2", "cpu", "pair.target") is None
    assert "runs on CUDA only" in caplog.text and "pair.target" in caplog.text
    assert kernel_on("flash_attention_2", torch.device("cuda"), "pair.target") == (
        "flash_attention_2"
    )
    assert kernel_on("eager", "cpu", "pair.target") == "eager"
    assert kernel_on(None, "cpu", "pair.target") is None


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    """A target and a drafter folder sharing one tokenizer (the vocabulary fixtures' BPE)."""
    root = tmp_path_factory.mktemp("pair")
    tok = byte_level(TEXT_B, 300, ["<eos>"])
    cfg = LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=32, intermediate_size=64,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    for name in ("target", "drafter"):
        torch.manual_seed(0)
        LlamaForCausalLM(cfg).save_pretrained(root / name)
        save(tok, root / name, eos_token="<eos>", pad_token="<eos>")
    return root


@pytest.mark.parametrize("kernel", ["eager", "sdpa"])
def test_the_pair_kernel_reaches_both_models(tiny_pair, kernel):
    spec = resolve_pair(
        {
            "target": str(tiny_pair / "target"),
            "drafter": str(tiny_pair / "drafter"),
            "attn_implementation": kernel,
        }
    )
    assert spec.attn_implementation == kernel
    for role in ("target", "drafter"):
        assert load_role(spec, role).config._attn_implementation == kernel


def test_a_bad_kernel_is_refused_by_the_plan(tmp_path):
    from hydra import compose, initialize_config_module

    from specdistill.distill.pipeline.plan import build_plan

    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        cfg = compose(
            "pipeline", overrides=[f"run_dir={tmp_path}", "pair.attn_implementation=flash2"]
        )
    with pytest.raises(ConfigError) as e:
        build_plan(cfg)
    (line,) = str(e.value).splitlines()
    assert line.startswith("generate: pair.attn_implementation='flash2' is not an attention")
