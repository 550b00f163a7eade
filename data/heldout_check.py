"""Evaluation prompts checked against the training rows: a figure measured on prompts the
drafter trained on says nothing about serving, so validate refuses such a set in one line.

The training rows are a generate-stage dataset (Seq-KD): its `prompt` column holds each row's
prompt as the target saw it (a chat row's turn rendered with the template), so an evaluation
prompt rendered the same way is found by its text.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from specdistill.data.prompt_record import Prompt
from specdistill.data.runtime import ConfigError


def training_prompts(path: str | Path) -> set[str]:
    """The prompt texts of a generate-stage dataset (every turn's)."""
    import datasets

    p = Path(str(path)).expanduser()
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:  # not a saved dataset: say which path
        raise ConfigError(
            f"training_data={str(path)!r} is not a generate-stage dataset ({e!r}); point it at "
            "the Seq-KD run the drafter trained on, or null"
        ) from e
    return {t.strip() for t in ds["prompt"]}


def check_disjoint(prompts: Sequence[Prompt], path: str | Path | None) -> int:
    """How many training prompts `path` holds (0 when null), after refusing, in one line, an
    evaluation set with any prompt among them."""
    if path is None:
        return 0
    seen = training_prompts(path)
    hits = [p for p in prompts if p.text.strip() in seen]
    if hits:
        raise ConfigError(
            f"{len(hits)} of {len(prompts)} evaluation prompts (e.g. prompt {hits[0].index}"
            f"{f' of {hits[0].source}' if hits[0].source else ''}) are training rows of "
            f"training_data={str(path)!r}: validate on held-out prompts (dataset.holdout, or the "
            "set's test split)"
        )
    return len(seen)
