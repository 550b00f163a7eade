"""The exported full head of a draft-vocabulary-trained drafter drafts as our decoder does.

`export/head.pad_head_rows` sets the rows outside the draft vocabulary to the kept rows'
centroid; an engine running the full head (here `transformers`, as vLLM would) must then draft
exactly the greedy tokens our decoder drafts with `SubsetHead`, on a drafter whose untrained
rows would otherwise win; the input embeddings stay (the tied head is untied).
"""

from __future__ import annotations

import copy

import torch

from specdistill.decode.draft_vocab import subset_head, swapped_head
from specdistill.distill.export.head import TOKEN_MAP_FILE, pad_head_rows, write_token_map


def _drafter():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def _greedy(model, prompt: torch.Tensor, steps: int, head=None) -> list[int]:
    ids = prompt.clone()
    with torch.no_grad(), swapped_head(model, head):
        for _ in range(steps):
            nxt = model(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], -1)
    return ids[0, prompt.shape[1] :].tolist()


def test_padded_full_head_drafts_what_the_subset_head_drafts(tmp_path):
    from transformers import AutoModelForCausalLM

    model = _drafter()
    gen = torch.Generator().manual_seed(3)
    keep = sorted(torch.randperm(96, generator=gen)[:30].tolist())
    with torch.no_grad():  # rows outside the subset that would win (never trained down)
        outside = [t for t in range(96) if t not in keep]
        model.lm_head.weight[outside[:10]] *= 6.0
    prompts = [torch.randint(0, 96, (1, 5), generator=gen) for _ in range(6)]
    ours = [_greedy(model, p, 8, subset_head(model, keep)) for p in prompts]
    unpadded = [_greedy(model, p, 8) for p in prompts]
    assert ours != unpadded, "the test needs outside rows that win without the padding"

    exported = copy.deepcopy(model)
    embeddings = exported.get_input_embeddings().weight.detach().clone()
    assert pad_head_rows(exported, keep) == 96 - 30
    exported.save_pretrained(tmp_path / "drafter")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "drafter").eval()
    assert reloaded.config.tie_word_embeddings is False
    torch.testing.assert_close(reloaded.get_input_embeddings().weight, embeddings)
    assert [_greedy(reloaded, p, 8) for p in prompts] == ours
    with torch.no_grad():  # and at every position of random contexts, not only along drafts
        ctx = torch.randint(0, 96, (4, 12), generator=gen)
        full = reloaded(input_ids=ctx).logits.argmax(-1)
        with swapped_head(model, subset_head(model, keep)):
            sub = model(input_ids=ctx).logits.argmax(-1)
    assert torch.equal(full, sub)


def test_token_map_is_what_sglang_loads(tmp_path):
    path = write_token_map(tmp_path, [5, 1, 9])
    assert path.name == TOKEN_MAP_FILE
    loaded = torch.load(path, weights_only=True)  # SGLang's load_token_map reads it so
    assert torch.as_tensor(loaded, dtype=torch.int64).tolist() == [5, 1, 9]


def test_export_stage_pads_a_draft_vocabulary_trained_drafter(tmp_path, toy_tiny):
    """The export stage reads the distill result beside the drafter: with draft_vocab_train it
    writes the padded (untied) head, the token map and the card line; its self-check passes."""
    import json

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdistill.distill.export import stage as export
    from tests.distill.test_export import _cfg

    src = tmp_path / "run" / "best"
    model = AutoModelForCausalLM.from_pretrained(str(toy_tiny.drafter_dir))
    keep = list(range(0, model.config.vocab_size, 3))
    model.config.draft_vocab_ids = keep
    model.save_pretrained(str(src))
    AutoTokenizer.from_pretrained(str(toy_tiny.drafter_dir)).save_pretrained(str(src))
    (src.parent / "result.json").write_text(json.dumps({"data": {"draft_vocab_train": True}}))
    out = tmp_path / "drafter"
    result = export.run(_cfg(out, f"drafter={src}"))
    assert result.padded_head_rows == result.vocab_size - len(keep)
    assert torch.load(out / TOKEN_MAP_FILE, weights_only=True).tolist() == keep
    exported = AutoModelForCausalLM.from_pretrained(str(out))
    head = exported.lm_head.weight
    outside = [t for t in range(head.shape[0]) if t not in set(keep)]
    torch.testing.assert_close(head[outside[0]], head[keep].mean(0))
    assert "centroid of the rows inside" in (out / "README.md").read_text()
