"""Online adaptation: the learning signal, the loss, lossless serving while learning, bad input."""

from __future__ import annotations

import json

import pytest
import torch
from hydra import compose, initialize_config_module

from specdistill.data.runtime import ConfigError, pad_rows, run_or_exit
from specdistill.decode.speculative import DecoderConfig, SpeculativeDecoder
from specdistill.distill.losses import DIVERGENCES, distill_loss
from specdistill.distill.online import stage as online
from specdistill.distill.online.buffer import Entry, ReplayBuffer, entries_from_output
from specdistill.distill.online.update import buffer_batch, buffer_loss

SMALL = [
    "pair=toy-tiny",
    "logger=none",
    "stream=[{dataset:toy-test,requests:4},{dataset:stdlib-gui,requests:4}]",
    "max_new_tokens=16",
    "window=2",
    "update_every=2",
    "update_steps=2",
    "guard_probe=1",
    "save_every=1",
    "plot=false",
    "device=cpu",
]


def online_cfg(out, *overrides):
    with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
        return compose(config_name="online", overrides=[*SMALL, f"output_dir={out}", *overrides])


def _decode(pair, texts, record="all", k=None, sampling=None, seed=0):
    """Decode `texts` as one left-padded batch with recorded target probabilities."""
    target, drafter, tok = pair
    rows = [tok(t, add_special_tokens=False).input_ids[-40:] for t in texts]
    ids, mask = pad_rows(rows, tok.pad_token_id)
    kw = {"sampling": sampling} if sampling is not None else {}
    cfg = DecoderConfig(gamma=3, max_new_tokens=20, record_probs=True, **kw)
    dec = SpeculativeDecoder(target, drafter, cfg, tokenizer_len=len(tok))
    out = dec.generate(ids, mask, generator=torch.Generator().manual_seed(seed))
    k = k or dec.vocab
    return rows, out, entries_from_output(out, rows, list(range(len(rows))), k, record)


PROMPTS = ['def add(a, b):\n    """Return a + b."""', "import os\n\ndef main():\n    "]


@pytest.mark.parametrize("greedy", [True, False])
def test_recorded_target_probs_equal_a_fresh_target_forward(toy_tiny_pair, greedy):
    """Every kept position's top-k (here K = V) is the target's own distribution there."""
    from specdistill.data.sampling import Sampling

    target = toy_tiny_pair[0]
    sampling = None if greedy else Sampling(temperature=1.0)
    rows, out, entries = _decode(toy_tiny_pair, PROMPTS, sampling=sampling)
    assert sum(e.tokens for e in entries) > 10
    for e, tokens in zip(entries, out.tokens):
        assert e.ids.tolist() == rows[entries.index(e)] + tokens
        with torch.no_grad():
            fresh = torch.log_softmax(target(e.ids[None].long()).logits[0].float(), -1)
        got = fresh[e.positions[:, None], e.topk_ids.long()]
        torch.testing.assert_close(got.exp(), e.topk_lp.exp(), atol=1e-5, rtol=1e-4)
        if greedy:  # the served token at every kept position is the target's argmax there
            assert e.ids[e.positions + 1].tolist() == e.topk_ids[:, 0].tolist()


def test_rejected_positions_are_the_first_rejection_of_each_round(toy_tiny_pair):
    rows, out, entries = _decode(toy_tiny_pair, PROMPTS, record="rejected", k=8)
    expected = [0] * len(rows)
    for rec in out.rounds:
        for r, active in enumerate(rec.active):
            n = int(rec.accepted[r])
            if active and n < rec.draft.shape[1] and rec.start[r] + n < len(out.tokens[r]):
                expected[r] += 1
                # the rejected draft is not the token that was served at that position
                assert int(rec.draft[r, n]) != out.tokens[r][rec.start[r] + n]
    assert [e.tokens for e in entries] == expected
    assert all(e.topk_ids.shape[1] == 8 for e in entries)


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_topk_loss_equals_full_loss_at_k_equal_v(toy_tiny_pair, divergence):
    """The buffer's (K+1)-way top-k loss at K = V is the full-vocabulary loss, value and grad."""
    target, drafter, tok = toy_tiny_pair
    _, _, entries = _decode(toy_tiny_pair, PROMPTS, record="all")
    loss_cfg = {"name": divergence, "beta": 0.5}
    params = [p for p in drafter.parameters()]
    vocab = entries[0].topk_ids.shape[1]

    topk = buffer_loss(drafter, entries, vocab=vocab, loss=_Obj(loss_cfg), pad_id=tok.pad_token_id)
    g_topk = torch.autograd.grad(topk, params)

    b = buffer_batch(entries, tok.pad_token_id, "cpu")
    logits = drafter(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    with torch.no_grad():
        t_logits = target(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits
    sel = (b["rows"], b["cols"])
    full = distill_loss(
        logits[sel][None],
        torch.ones(1, len(b["rows"]), dtype=torch.bool),
        target_logits=t_logits[sel][None],
        divergence=divergence,
        beta=0.5,
        chunk_size=None,
    )
    g_full = torch.autograd.grad(full, params)
    torch.testing.assert_close(topk, full, atol=2e-5, rtol=1e-4)
    for a, c in zip(g_topk, g_full):
        torch.testing.assert_close(a, c, atol=2e-5, rtol=1e-3)
    # and a small K is a lower bound (data processing), strictly different here
    small = [Entry(e.request, e.ids, e.positions, e.topk_ids[:, :4], e.topk_lp[:, :4])
             for e in entries]  # fmt: skip
    with torch.no_grad():
        low = buffer_loss(drafter, small, vocab=vocab, loss=_Obj(loss_cfg), pad_id=tok.pad_token_id)
    assert float(low) <= float(full.detach()) + 1e-6


class _Obj(dict):
    __getattr__ = dict.__getitem__


def test_topk_auto_keeps_all_of_p_for_sampling_and_a_few_tokens_for_greedy():
    """Sampled alpha is 1 - TV(p, q), so `auto` keeps (up to TOPK_SAMPLING) all of p there;
    greedy acceptance needs only the top tokens."""
    from specdistill.distill.online.config import TOPK_GREEDY, TOPK_SAMPLING, resolve_topk

    assert resolve_topk("auto", 0.0, 4096) == TOPK_GREEDY == 32
    assert resolve_topk("auto", 1.0, 4096) == 4096
    assert resolve_topk("auto", 0.7, 128_256) == TOPK_SAMPLING
    assert resolve_topk("auto", 1.0, 16) == 16
    assert resolve_topk(8, 1.0, 4096) == 8


@pytest.mark.parametrize("decoder", ["greedy", "sampling"])
def test_online_run_reports_the_resolved_topk_and_its_mass(tmp_path, decoder):
    cfg = online_cfg(tmp_path, f"decoder={decoder}", "guard_every=0", "record=all")
    cfg.stream = [{"dataset": "toy-test", "requests": 2}]
    result = online.run(cfg)
    from specdistill.data.models.pairs import load_tokenizer, resolve_pair

    vocab = len(load_tokenizer(resolve_pair(cfg.pair)))
    if decoder == "sampling":
        assert result.topk == min(vocab, 4096) and result.topk_mass == pytest.approx(1, abs=1e-3)
    else:
        assert result.topk == 32 and 0 < result.topk_mass < 1
    assert (
        f"top-k {result.topk} (covering {result.topk_mass}" in (tmp_path / "online.md").read_text()
    )


def test_buffer_is_bounded_in_tokens_oldest_out():
    def entry(req, n):
        return Entry(req, torch.arange(n + 1, dtype=torch.int32), torch.arange(n),
                     torch.zeros(n, 2, dtype=torch.int32), torch.zeros(n, 2))  # fmt: skip

    buf = ReplayBuffer(10)
    for req, n in enumerate([4, 4, 4, 0, 12]):
        buf.add(entry(req, n))
        assert buf.tokens <= 10
    assert [e.request for e in buf.entries] == [4] and buf.tokens == 10
    assert buf.entries[0].positions.tolist() == list(range(2, 12))  # the newest kept
    buf2 = ReplayBuffer(10)
    for req in range(3):
        buf2.add(entry(req, 4))
    assert [(e.request, e.tokens) for e in buf2.entries] == [(0, 2), (1, 4), (2, 4)]
    restored = ReplayBuffer(1)
    restored.load_state_dict(buf2.state_dict())
    assert restored.tokens == 10 and restored.nbytes == buf2.nbytes


@pytest.mark.parametrize("batch_size", [1, 2])
def test_greedy_serving_is_token_identical_with_and_without_updates(
    tmp_path, toy_tiny_pair, batch_size
):
    """Updates change the drafter (and alpha), never the output: it is the target's greedy."""
    cfg = online_cfg(
        tmp_path,
        "log_tokens=true",
        "optim.optimizer.lr=1e-2",
        "guard_every=0",
        f"batch_size={batch_size}",
    )
    result = online.run(cfg)
    assert result.updates == 4
    rows = [json.loads(x) for x in (tmp_path / "outputs.jsonl").read_text().splitlines()]
    assert [r["request"] for r in rows] == list(range(8))
    assert all(r["adapted"] == r["frozen"] for r in rows)
    windows = [json.loads(x) for x in (tmp_path / "online.jsonl").read_text().splitlines()]
    assert any(w["alpha_adapted"] != w["alpha_frozen"] for w in windows[1:])
    # and both equal the target's own greedy decoding of the same prompts
    target, drafter, tok = toy_tiny_pair
    from specdistill.distill.online.stream import load_sources, parse_stream, plan_requests

    segs = parse_stream(online_cfg(tmp_path).stream)
    sources = load_sources(segs, "toy-tiny", tok)
    plan = plan_requests(segs, {k: len(v) for k, v in sources.items()}, 0, 0)
    for req, row in zip(plan, rows):
        ids = tok(sources[req.source][req.prompt].text, add_special_tokens=False).input_ids[-192:]
        with torch.no_grad():
            ref = target.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=16,
                                  pad_token_id=tok.pad_token_id)[0, len(ids):].tolist()  # fmt: skip
        eos = tok.eos_token_id
        if eos in ref:
            ref = ref[: ref.index(eos) + 1]
        assert row["adapted"] == ref
    # the adapted drafter is an ordinary checkpoint, different from the start
    from transformers import AutoModelForCausalLM

    adapted = AutoModelForCausalLM.from_pretrained(result.drafter_path)
    assert any(not torch.equal(a, b) for a, b in zip(adapted.parameters(), drafter.parameters()))


def test_guard_rolls_back_a_harmful_update(tmp_path, caplog, toy_tiny):
    """A huge learning rate wrecks a perfect drafter (the target itself, alpha 1): the guard
    notices on the held-out probe and restores weights and optimizer."""
    cfg = online_cfg(
        tmp_path,
        f"pair.drafter={toy_tiny.target_dir}",
        "optim.optimizer.lr=5.0",
        "guard_every=1",
        "guard_margin=0.0",
        "record=all",
        "gate_agreement=null",  # the wrecking updates must be taken  # a perfect drafter has no rejections to learn from
    )
    cfg.stream = [{"dataset": "toy-test", "requests": 4}]
    with caplog.at_level("WARNING", logger="specdistill.online"):
        result = online.run(cfg)
    assert result.updates == 2 and result.rollbacks == 2
    assert caplog.text.count("rolled back") == 2
    from transformers import AutoModelForCausalLM

    from specdistill.data.models.pairs import resolve_pair

    start = AutoModelForCausalLM.from_pretrained(resolve_pair(cfg.pair).drafter)
    adapted = AutoModelForCausalLM.from_pretrained(result.drafter_path)
    # every update undone: the start drafter, exactly
    assert all(torch.equal(a, b) for a, b in zip(adapted.parameters(), start.parameters()))


BAD = [
    ("stream=[{dataset:nosuch,requests:4}]", "stream[0].dataset='nosuch'"),
    ("stream=[{dataset:toy-test,requests:0}]", "stream[0].requests=0"),
    ("stream=[]", "stream must be a non-empty list"),
    ("buffer_tokens=0", "buffer_tokens=0"),
    ("update_every=0", "update_every=0"),
    ("update_every=-2", "update_every=-2"),
    ("topk=100000", "topk=100000"),
    ("topk=0", "topk=0"),
    ("topk=many", "topk='many'"),
    ("record=some", "record='some'"),
    ("loss.temperature=2.0", "loss.temperature=2.0"),
    ("gate_agreement=1.5", "gate_agreement=1.5"),
    ("anchor_kl=-1", "anchor_kl=-1"),
    ("gate_relax_margin=1.5", "gate_relax_margin=1.5"),
    ("gate_relax_margin=-0.1", "gate_relax_margin=-0.1"),
    ("gate_relax_margin=true", "gate_relax_margin=True"),
    ("gate_relaxed=2", "gate_relaxed=2"),
    ("gate_relaxed=loose", "gate_relaxed='loose'"),
]


@pytest.mark.parametrize(("override", "message"), BAD)
def test_bad_input_is_one_line_exit_2_before_any_model_loads(
    tmp_path, monkeypatch, capsys, override, message
):
    def no_models(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(online, "load_pair", no_models)
    cfg = online_cfg(tmp_path, override)
    with pytest.raises(SystemExit) as exc:
        run_or_exit(online.run, cfg)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    with pytest.raises(ConfigError):
        online.run(cfg)


def test_cli_bad_input_line(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "specdistill.distill.online", "pair=toy-tiny", "logger=none",
         f"output_dir={tmp_path}", "update_every=0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("error: update_every=0")
    assert not (tmp_path / "online_state.pt").exists()


def test_online_refuses_parallel_drafting(tmp_path):
    from specdistill.distill.online.config import check_config

    with pytest.raises(ConfigError, match="decoder.drafting=parallel is not supported online"):
        check_config(online_cfg(tmp_path, "decoder.drafting=parallel"))
