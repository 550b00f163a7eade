"""`chat_template_kwargs` reach every place a template is applied: generate (its rows and
recorded config), distill's held-out evaluation prompts, validate's decoded prompts, online's
stream and the card's serving line. The toy template's `think` argument marks a prompt."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from specdistill.data.prompts import load_prompts
from tests.data.chat_fixtures import chat_tokenizer, conversation, write_jsonl

MARK = "<|assistant|><think>"


@pytest.fixture
def chat_set(toy_tiny, tmp_path):
    tok_dir = tmp_path / "tok"
    tok = chat_tokenizer(toy_tiny, tok_dir)
    path = write_jsonl(tmp_path / "c.jsonl", [conversation(k, 2, system="S") for k in range(4)])
    node = {"source": "jsonl", "path": str(path), "format": "messages", "field": "messages",
            "split": "test", "chat_template_kwargs": {"think": True}}  # fmt: skip
    return tok, tok_dir, node


def test_distill_eval_and_online_render_with_the_kwargs(chat_set):
    from specdistill.distill.online.stream import Segment, load_sources
    from specdistill.distill.train.sources import _dataset_cfg

    tok, _, node = chat_set
    evaluation = load_prompts(
        _dataset_cfg(OmegaConf.create({"dataset": node}), "test"), tok, default_split="test"
    )
    online = load_sources([Segment("mine", node, 4)], None, tok)["mine"]
    for prompts in (evaluation, online):
        assert len(prompts) == 4 and all(p.text.endswith(MARK) for p in prompts)
        assert all(dict(p.template_kwargs) == {"think": True} for p in prompts)


def test_validate_decodes_prompts_rendered_with_the_kwargs(chat_set):
    from specdistill.decode.validate.setup import setup

    tok, tok_dir, node = chat_set
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        cfg = compose(
            config_name="validate",
            overrides=["pair=toy-tiny", f"+pair.tokenizer={tok_dir}", "max_new_tokens=4"],
        )
    cfg.dataset = OmegaConf.create(node)
    st = setup(cfg, 4)
    texts = [tok.decode(ids[m.bool()]) for b in st.batches for ids, m in zip(*b)]
    assert len(texts) == 8  # both turns of the 4 conversations
    assert all(t.endswith(MARK) for t in texts)
    # turn 2 follows the target's own turn-1 reply, a finished assistant turn (no <think>)
    assert sum(t.count("<think>") for t in texts) == 8


def test_the_card_serves_with_the_recorded_kwargs(chat_set, generate_cfg, tmp_path):
    from specdistill.data.generate import stage as gen
    from specdistill.distill.export.card import _chat_line
    from specdistill.distill.train.data import chat_record

    _, tok_dir, node = chat_set
    overrides = [f"pair.tokenizer={tok_dir}", "dataset.source=jsonl", f"+dataset.path={node['path']}",
                 "+dataset.format=messages", "dataset.field=messages",
                 "+dataset.chat_template_kwargs={think: true}", "max_new_tokens=4"]  # fmt: skip
    gen.run(generate_cfg(*overrides))
    chat = chat_record(tmp_path / "gen")["chat"]
    assert chat == {"turns": 2, "template_kwargs": {"think": True}}
    assert "`chat_template_kwargs={'think': True}`" in " ".join(_chat_line(chat))
