"""The lean decode step (decode.lean_step) against the model's own forward: the same logits for
every step the decoder runs (1-token, multi-token, batched with holes and positions, grouped-query
heads, a draft-vocabulary head, the few-row linears), the same decodes, and who qualifies."""

from __future__ import annotations

import pytest
import torch

from specdistill.decode.cache import ModelRunner
from specdistill.decode.cpu_matmul import LINEAR, WEIGHT_MAJOR
from specdistill.decode.draft_vocab import SubsetHead
from specdistill.decode.lean_step import (
    RotaryTable,
    causal_mask,
    lean_problem,
    rms_norm,
    rotary_table_problem,
    rotary_tables,
)
from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from tests.conftest import tiny_llama


def _gqa_llama(seed: int = 3):
    return tiny_llama(hidden=48, seed=seed, heads=6, kv_heads=2)


def _qwen2(seed: int = 4):
    """Biased q/k/v projections; `sliding_window` set but unused (use_sliding_window off)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
                      use_sliding_window=False, sliding_window=4, pad_token_id=0,
                      bos_token_id=None, eos_token_id=None)  # fmt: skip
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # random biases: an init of zeros would not test them
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_()
    return model


def _mistral(seed: int = 5):
    from tests.decode.sliding_models import mistral

    return mistral(window=None, seed=seed).eval()


MODELS = [lambda: tiny_llama(seed=2), _gqa_llama, _qwen2, _mistral]
MODEL_IDS = ["mha", "gqa", "qwen2", "mistral"]


def _pair(model, steps: list[int], mask=None, pos=None, **runner):
    """Two runners on one model, lean and not, fed the same prompt then the same steps: the
    logits of every step from each (all positions kept)."""
    out = []
    for lean in (False, True):
        r = ModelRunner(model, static=False, capacity=64, lean=lean, **runner)
        assert r._lean is lean
        g = torch.Generator().manual_seed(7)
        b = 1 if mask is None else mask.shape[0]
        prompt = torch.randint(1, 64, (b, 10), generator=g)
        pmask = None if mask is None else mask[:, :10]
        ppos = None if pos is None else pos[:, :10]
        r.forward(prompt, pmask, ppos, prefill=True)
        got, at = [], 10
        for n in steps:
            ids = torch.randint(1, 64, (b, n), generator=g)
            m = None if mask is None else mask[:, : at + n]
            p = None if pos is None else pos[:, at : at + n]
            got.append(r.forward(ids, m, p))
            at += n
        r.rollback(12)  # and a step after a rollback sees only the kept slots
        ids = torch.randint(1, 64, (b, 2), generator=g)
        got.append(
            r.forward(
                ids, None if mask is None else mask[:, :14], None if pos is None else pos[:, 12:14]
            )
        )
        out.append(got)
    return out


@torch.inference_mode()
@pytest.mark.parametrize("make", MODELS, ids=MODEL_IDS)
@pytest.mark.parametrize("weight_major", [False, True])
def test_dense_steps_match_the_model(make, weight_major):
    model = make()
    assert lean_problem(model) is None
    layout = WEIGHT_MAJOR if weight_major else LINEAR
    hf, lean = _pair(model, [1, 3, 1, 5], layout=layout)
    for a, b in zip(hf, lean):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
@pytest.mark.parametrize("make", MODELS, ids=MODEL_IDS)
def test_batched_steps_with_holes_and_positions_match_the_model(make):
    """Row 0 left-padded by 2, row 1 with a hole at slot 11 (a rejected draft) and its
    positions counting only real tokens."""
    model = make()
    width = 30
    mask = torch.ones(2, width, dtype=torch.bool)
    mask[0, :2] = False
    mask[1, 11] = False
    pos = (mask.long().cumsum(-1) - 1).clamp(min=0)
    hf, lean = _pair(model, [1, 4, 2], mask=mask, pos=pos)
    for a, b in zip(hf, lean):
        # padded slots' own logits are garbage in both paths: compare the real positions
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_draft_vocab_head_matches_the_model():
    model = tiny_llama(seed=5)
    head = ("lm_head", SubsetHead(model.lm_head, list(range(0, 64, 3))))
    hf, lean = _pair(model, [1, 2], head=head)
    for a, b in zip(hf, lean):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
@pytest.mark.parametrize("make", MODELS, ids=MODEL_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_and_rotations_are_the_models_own_bits(make, dtype):
    """`rms_norm` and `rotary_tables` write out the model's RMSNorm and `apply_rotary_pos_emb`
    op for op: equal to the last bit (not within a tolerance), so the lean step's logits are the
    ones the written-out modules would give."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = make().to(dtype)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(2, 5, model.config.hidden_size, generator=g) * 3).to(dtype)
    for norm in (model.model.norm, model.model.layers[0].input_layernorm):
        with torch.no_grad():
            norm.weight.copy_(torch.rand(norm.weight.shape, generator=g) + 0.5)
        assert torch.equal(rms_norm(norm, x), norm(x))
    heads, dim = model.config.num_attention_heads, model.model.layers[0].self_attn.head_dim
    q = torch.randn(2, heads, 5, dim, generator=g).to(dtype)
    k = torch.randn(2, 2, 5, dim, generator=g).to(dtype)
    cos, sin = model.model.rotary_emb(x, torch.tensor([[3, 9, 10, 11, 40], [0, 1, 2, 3, 4]]))
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    cos1, sin1, half = rotary_tables(cos, sin)
    assert torch.equal(q * cos1 + q.roll(half, -1) * sin1, want_q)
    assert torch.equal(k * cos1 + k.roll(half, -1) * sin1, want_k)


@torch.inference_mode()
def test_the_plan_reads_weights_at_each_step():
    """A runner resolves the modules once; weights replaced after that (a new Parameter, as
    loading or a layout change may do) are what its next step computes with."""
    model = tiny_llama(seed=6)
    runners = [ModelRunner(model, static=False, capacity=32, lean=lean) for lean in (False, True)]
    assert runners[1]._lean
    prompt = torch.randint(1, 64, (1, 8), generator=torch.Generator().manual_seed(2))
    for r in runners:
        r.forward(prompt, prefill=True)
    layer = model.model.layers[1]
    g = torch.Generator().manual_seed(3)
    layer.post_attention_layernorm.weight = torch.nn.Parameter(torch.rand(32, generator=g) + 0.5)
    layer.mlp.up_proj.weight = torch.nn.Parameter(torch.randn(64, 32, generator=g))
    hf, lean = (r.forward(torch.tensor([[5]]), keep=1) for r in runners)
    torch.testing.assert_close(lean, hf, rtol=1e-5, atol=1e-5)


def _roped(rope: dict | None, hidden: int = 32, heads: int = 4, seed: int = 8):
    """A tiny Llama with the given `rope_parameters` (None: the default rope)."""
    model = tiny_llama(hidden=hidden, heads=heads, seed=seed)
    if rope is None:
        return model
    from transformers import LlamaForCausalLM

    cfg = model.config
    cfg.rope_parameters = {"rope_theta": 10000.0, **rope}
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg).eval()


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}  # fmt: skip
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}


@torch.inference_mode()
@pytest.mark.parametrize(
    "rope, hidden, heads",
    [(None, 32, 4), (None, 128, 2), (None, 256, 2), (None, 80, 1), (LLAMA3, 32, 4), (YARN, 64, 2)],
    ids=["hd8", "hd64", "hd128", "hd80", "llama3", "yarn"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_table_rows_are_the_per_step_bits(rope, hidden, heads, dtype):
    """Every row a dense step slices from the table equals, to the last bit, what the model's
    rotary embedding gives that step (widths 1, 3 and 9, at every start up to positions in the
    thousands, where the angles are large)."""
    model = _roped(rope, hidden, heads).to(dtype)
    rotary = model.model.rotary_emb
    assert rotary_table_problem(model) is None
    like = torch.empty(0, dtype=dtype)
    capacity = 2100
    table = RotaryTable(rotary, like, capacity)
    assert table.cos.dtype == dtype and table.cos.shape[2] == capacity
    for n in (1, 3, 9):
        for start in range(0, capacity - n + 1, 1 if n == 1 else 7):
            want = rotary_tables(*rotary(like, torch.arange(start, start + n)[None]))
            cos, sin = table.rows(start, n)
            assert torch.equal(cos, want[0]) and torch.equal(sin, want[1]), (n, start)
            assert table.half == want[2]


@torch.inference_mode()
@pytest.mark.parametrize("make", MODELS, ids=MODEL_IDS)
def test_dense_steps_from_the_table_give_the_same_logits(make):
    """A lean runner's dense steps with the table against the same runner's steps without it:
    equal logits, bit for bit, through steps of several widths and a rollback."""
    model = make()
    out = []
    for tabled in (False, True):
        r = ModelRunner(model, static=False, capacity=80, lean=True)
        assert r._tabled  # a static rope: tabled unless turned off here
        r._tabled = tabled
        g = torch.Generator().manual_seed(4)
        r.forward(torch.randint(1, 64, (1, 10), generator=g), prefill=True)
        got = [r.forward(torch.randint(1, 64, (1, n), generator=g)) for n in (1, 3, 1, 9, 2)]
        r.rollback(14)
        got.append(r.forward(torch.randint(1, 64, (1, 4), generator=g), keep=2))
        assert (r._table is not None) is tabled
        out.append(got)
    for a, b in zip(*out):
        assert torch.equal(a, b)


@torch.inference_mode()
def test_the_table_is_shared_and_rebuilt_when_it_must_be():
    """Runners of one model share its table (decodes do not recompute it); a longer cache grows
    it; frequencies changed in place rebuild it, and its rows are then the new embedding's."""
    model = tiny_llama(seed=9)
    rotary, like = model.model.rotary_emb, torch.empty(0)

    def step(capacity):
        r = ModelRunner(model, static=False, capacity=capacity, lean=True)
        r.forward(torch.tensor([[1, 2, 3]]), prefill=True)
        r.forward(torch.tensor([[4]]))
        return r._table

    first = step(40)
    assert first is step(60) and first.capacity >= 60
    longer = step(700)
    assert longer is not first and longer.capacity >= 700
    assert step(40) is longer
    rotary.inv_freq.mul_(1.5)  # what a rope scaling applied after loading would do
    again = step(40)
    assert again is not longer
    want = rotary_tables(*rotary(like, torch.arange(5, 8)[None]))
    assert torch.equal(again.rows(5, 3)[0], want[0]) and torch.equal(again.rows(5, 3)[1], want[1])
    assert not torch.equal(longer.rows(5, 3)[0], want[0])


@torch.inference_mode()
def test_a_dynamic_rope_runs_its_embedding_each_step():
    """A rope whose frequencies change with the sequence gets no table, and its lean steps still
    match the model's forward."""
    model = _roped({"rope_type": "dynamic", "factor": 2.0})
    assert "changes with the sequence" in rotary_table_problem(model)
    r = ModelRunner(model, static=False, capacity=64, lean=True)
    assert r._lean and not r._tabled
    hf, lean = _pair(model, [1, 3, 1])
    for a, b in zip(hf, lean):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5)


def test_causal_mask_is_bottom_right_and_keeps_the_slot_mask():
    m = causal_mask(None, 3, 2, 1, "cpu")[0, 0]
    assert m.tolist() == [[True] * 4 + [False], [True] * 5]
    assert causal_mask(None, 3, 1, 1, "cpu") is None
    slots = torch.tensor([[False, True, True, True, True, True]])
    m = causal_mask(slots, 4, 2, 1, "cpu")[0, 0]
    assert m.tolist() == [[False, True, True, True, True, False], [False] + [True] * 5]


def test_who_qualifies():
    from tests.decode.sliding_models import gemma2, mistral, qwen2

    for model in (tiny_llama(), _qwen2(), _mistral()):
        assert lean_problem(model) is None
    for sliding in (mistral(), qwen2()):  # a window: the model's own masks and forward
        assert lean_problem(sliding) == "layers other than full attention"
    assert lean_problem(gemma2()).startswith("not a ")
    eager = tiny_llama()
    eager.config._attn_implementation = "eager"
    assert "sdpa" in lean_problem(eager)
    assert not ModelRunner(tiny_llama(), static=True, capacity=8, lean=True)._lean
    swapped = tiny_llama()  # a norm of another formula: `rms_norm` would not compute it
    swapped.model.layers[1].post_attention_layernorm = torch.nn.LayerNorm(32)
    assert lean_problem(swapped) == "a norm other than the model type's own RMSNorm"


@torch.inference_mode()
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_decodes_agree_with_and_without_lean_steps(temperature):
    """The same decoder settings with `lean_steps` on and off: the same tokens, greedy and
    sampled (the same uniforms, the same probabilities), and greedy equal to the target's own."""
    from specdistill.data.sampling import Sampling

    target, drafter = _gqa_llama(1), _gqa_llama(2)
    prompt = torch.randint(1, 64, (1, 12), generator=torch.Generator().manual_seed(3))
    outs = []
    for lean in (True, False):
        cfg = DecoderConfig(gamma=3, max_new_tokens=24, lean_steps=lean,
                            sampling=Sampling(temperature=temperature))  # fmt: skip
        dec = SpeculativeDecoder(target, drafter, cfg)
        spec = dec.generate(prompt, generator=torch.Generator().manual_seed(11))
        base = dec.baseline(prompt, generator=torch.Generator().manual_seed(12))
        outs.append((spec.tokens, base.tokens))
    assert outs[0] == outs[1]
    if temperature == 0.0:
        assert outs[0][0] == outs[0][1]


@torch.inference_mode()
@pytest.mark.parametrize("make", MODELS, ids=MODEL_IDS)
def test_the_cache_goes_by_the_name_the_forward_takes(make):
    """`transformers` 5 renamed the forward's cache argument `cache` and deprecated
    `past_key_values` (due to go within the versions pyproject allows): a runner passes the
    name the model's forward takes, so prefills and `model.forward` steps warn of nothing; a
    forward that knows only the old name (older models, remote code) still gets its cache."""
    import inspect
    import warnings

    model = make()
    takes_cache = "cache" in inspect.signature(model.forward).parameters
    prompt = torch.randint(1, 64, (1, 9), generator=torch.Generator().manual_seed(4))
    runner = ModelRunner(model, static=False, capacity=32, lean=False)
    assert runner._cache_arg == ("cache" if takes_cache else "past_key_values")
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*")
        runner.forward(prompt, prefill=True)
        want = runner.forward(torch.tensor([[3, 4]]))

    plain = model.forward
    got_names: list[str] = []

    def old_style(input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                  use_cache=None, logits_to_keep=0):  # fmt: skip
        got_names.append("past_key_values")
        kw = {"cache" if takes_cache else "past_key_values": past_key_values}
        return plain(input_ids=input_ids, attention_mask=attention_mask,
                     position_ids=position_ids, use_cache=use_cache,
                     logits_to_keep=logits_to_keep, **kw)  # fmt: skip

    model.forward = old_style
    try:
        old = ModelRunner(model, static=False, capacity=32, lean=False)
        assert old._cache_arg == "past_key_values"
        old.forward(prompt, prefill=True)
        torch.testing.assert_close(old.forward(torch.tensor([[3, 4]])), want, rtol=0, atol=0)
    finally:
        del model.forward
    assert got_names == ["past_key_values"] * 2 and model.forward == plain
