"""The realistic-shape GPU benchmark runs end to end at its tiny preset on any machine."""

from __future__ import annotations

import json

from specdistill.decode.bench.gpu import main, step_bytes
from tests.conftest import tiny_llama


def test_tiny_preset_writes_every_section(tmp_path):
    args = "--preset tiny --prompts 1 --new-tokens 12 --repeats 1 --c-iters 1 --no-hf"
    main(["--out", str(tmp_path), *args.split(), "--fp32-check", "1", "--batches", "1", "2"])
    got = json.loads((tmp_path / "bench_gpu.json").read_text())
    assert [r["batch"] for r in got["batches"]] == [1, 2]
    one = got["batches"][0]
    assert one["graphs_compiled_while_timed"] == 0
    assert one["speedup"] > 0 and 0 <= one["alpha"] <= 1 and 1 <= one["tau"] <= 5
    # the pair is calibrated: agreement rises as the residual branches shrink
    ladder = [a for _, a in got["pair"]["agreement_by_scale"]]
    assert ladder[-1] > ladder[0]
    # ours (speculative and target-only) equals transformers' own greedy generate() in fp32
    assert got["fp32_lossless"] == {
        "speculative_equals_hf_greedy": "1/1",
        "baseline_equals_hf_greedy": "1/1",
    }


def test_step_bytes_counts_weights_but_one_embedding_row_plus_kv():
    model = tiny_llama(vocab=64, layers=2, hidden=32, heads=4)
    params = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight.numel()
    kv_per_token = 2 * 2 * 4 * 8 * 4  # k and v, layers, kv heads, head_dim, fp32 bytes
    assert step_bytes(model, context=10) == (params - emb) * 4 + 10 * kv_per_token
