"""The toy world's sizes: how each is built (model shapes, training steps, corpus and prompt caps).

A change here changes what a build produces: bump `world.TOY_VERSION` with it, so stale caches
are not reused.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    intermediate: int


@dataclass(frozen=True)
class ToySpec:
    """How one toy size is built; steps rather than seconds keep builds deterministic."""

    name: str
    vocab_size: int
    train_files: int | None  # cap on training files (None: all)
    seq_len: int
    max_positions: int
    target: ModelShape
    target_steps: int
    drafter: ModelShape
    drafter_steps: int
    batch_size: int
    lr: float
    max_train_prompts: int
    max_test_prompts: int


SPECS: dict[str, ToySpec] = {
    # The default run: a target that has really learned the corpus and a drafter given ~1/10 of
    # its budget, so distillation has something to show. 150 steps of 4096 tokens keep the
    # build to minutes on a 2-core CPU (build times: the root RESULTS.md, data/RESULTS.md).
    "toy": ToySpec(
        name="toy",
        vocab_size=4096,
        train_files=None,
        seq_len=256,
        max_positions=1024,
        target=ModelShape(layers=4, hidden=256, heads=4, intermediate=688),
        target_steps=150,
        drafter=ModelShape(layers=2, hidden=128, heads=2, intermediate=344),
        drafter_steps=45,
        batch_size=16,
        lr=2e-3,
        max_train_prompts=2000,
        max_test_prompts=400,
    ),
    # For tests: builds in seconds; small enough that every unit test can afford it.
    "toy-tiny": ToySpec(
        name="toy-tiny",
        vocab_size=512,
        train_files=60,
        seq_len=128,
        max_positions=512,
        target=ModelShape(layers=2, hidden=64, heads=4, intermediate=128),
        target_steps=80,
        drafter=ModelShape(layers=1, hidden=32, heads=2, intermediate=64),
        drafter_steps=15,
        batch_size=8,
        lr=3e-3,
        max_train_prompts=400,
        max_test_prompts=300,
    ),
}
