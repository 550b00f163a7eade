"""Where the distill stage's rows come from: Seq-KD folders (or the generate stage run for them
when `data.path` is null), reference completions, the dataset's prompts alone (lmbda = 1), and
the held-out rows that pick best/ (`eval.source`).

What only the files can tell (no rows, no stored top-k where asked) is a ConfigError naming the
field, raised before any model trains.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from specdistill.data.prompts import load_prompts
from specdistill.data.runtime import ConfigError
from specdistill.distill.train.data import Example, load_seqkd, reference_examples
from specdistill.distill.train.seqkd_rows import chain, has_topk, topk_width, without_topk
from specdistill.distill.train.settings import TrainSettings

log = logging.getLogger("specdistill.distill.train.setup")


def _dataset_cfg(cfg: DictConfig, split: str | None) -> DictConfig:
    ds = OmegaConf.to_container(cfg.dataset, resolve=True)
    if split is not None:
        ds["split"] = split
    return OmegaConf.create(ds)


def build_seqkd(s: TrainSettings, cfg: DictConfig, accelerator) -> Path:
    """Run the generate stage into output_dir/seqkd (main process; reused when complete)."""
    return run_generate(s, cfg, accelerator, s.output_dir / "seqkd", "train", s.data.generate)


def run_generate(
    s: TrainSettings, cfg: DictConfig, accelerator, path: Path, split: str, settings: dict
) -> Path:
    """The generate stage over the dataset's `split` into `path` (main process; a finished
    run with the same config is reused by the generate stage itself)."""
    if accelerator.is_main_process:
        try:
            from specdistill.data.generate.stage import run as generate
        except ImportError as e:
            raise ConfigError(
                "the generate stage is not available to build target continuations: pass "
                "data.path / eval.path, or data.seq_kd=false with data.reference=true"
            ) from e
        from hydra import compose, initialize_config_module
        from hydra.core.global_hydra import GlobalHydra

        overrides = [f"output_dir={path}", f"split={split}", f"seed={s.seed}"]
        if GlobalHydra.instance().is_initialized():
            gcfg = compose(config_name="generate", overrides=overrides)
        else:
            with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
                gcfg = compose(config_name="generate", overrides=overrides)
        try:  # merged, not written as overrides: nested settings (`sampling`) keep their shape
            gcfg = OmegaConf.merge(gcfg, settings)
        except Exception as e:  # a key the generate stage does not have
            raise ConfigError(f"data.generate: {e}".splitlines()[0]) from e
        OmegaConf.set_struct(gcfg, False)
        gcfg.pair = cfg.pair
        # the eval rows come from eval.split even where the set names one split for every stage
        # (data/splits.py; the plan's held-out check reads them the same way)
        gcfg.dataset = _dataset_cfg(cfg, None if split == "train" else split)
        if split != "train":
            gcfg.dataset.limit = s.eval.limit
        gcfg.shard = {"index": 0, "count": 1}
        gcfg.progress = False
        if s.device == "cpu":
            gcfg.device = "cpu"
        log.info("target continuations (%s split) with the generate stage -> %s", split, path)
        generate(gcfg)
    accelerator.wait_for_everyone()
    return path


def build_train_examples(
    s: TrainSettings, cfg: DictConfig, tokenizer, accelerator, *, target: str | None = None
) -> tuple[Sequence[Example], bool]:
    """(examples, top-k mode). Sources mix: Seq-KD rows (read lazily) + reference completions;
    with lmbda = 1 and neither, the dataset's prompts alone (every batch is drafter-generated).
    `target`: the resolved target path (`source: self` samples its queries from it)."""
    parts: list[Sequence[Example]] = []
    data = s.data
    paths = list(data.paths)
    if not paths and data.seq_kd:
        paths = [build_seqkd(s, cfg, accelerator)]
    use_topk = data.use_topk
    for path in paths:  # several: one Seq-KD set per chat mode, each capped at data.limit
        parts.append(load_seqkd(path, limit=data.limit, use_topk=use_topk in ("auto", True)))
    if data.reference:
        prompts = load_prompts(
            _dataset_cfg(cfg, None), tokenizer, default_split="train", target=target
        )
        parts.append(reference_examples(prompts[: data.limit or None], tokenizer))
    examples = chain(parts)
    if not examples and s.lmbda >= 1.0:
        prompts = load_prompts(
            _dataset_cfg(cfg, None), tokenizer, default_split="train", target=target
        )
        ids = [tokenizer(p.text, add_special_tokens=False)["input_ids"] for p in prompts]
        examples = [Example(prompt_ids=i, completion_ids=[]) for i in ids]
    if not examples:
        raise ConfigError(
            "no training data: set data.path (a Seq-KD dataset), data.seq_kd=true, "
            "data.reference=true or lmbda=1 (on-policy only)"
        )
    topk = has_topk(examples)
    if use_topk is True and not topk:
        raise ConfigError("data.use_topk=true but the training rows carry no stored top-k")
    if topk and s.most_onpolicy > 0:
        if use_topk is True:
            raise ConfigError(
                f"data.use_topk=true with lmbda={cfg.lmbda}: on-policy batches need the target "
                "loaded; set lmbda=0 or data.use_topk=false"
            )
        examples = without_topk(examples)
        topk = False
    if topk and s.loss.temperature != 1.0:
        raise ConfigError("loss.temperature must be 1 with stored top-k log-probs (stored at T=1)")
    return examples, topk


def eval_topk(s: TrainSettings, train_examples: Sequence[Example], train_topk: bool) -> int:
    """K of the top-k log-probs stored with the target's held-out continuations (0: none).

    `eval.topk_logprobs: auto` stores the training rows' K when training reads stored top-k
    and the serving mode is one stored log-probs measure exactly (greedy: the stored top-1 is
    argmax p) or as the documented lower bound (T = 1, nothing cut): then the distill stage
    never loads the target. Otherwise 0 (the target is loaded for the held-out figure).
    """
    k = s.eval.topk_logprobs
    if k != "auto":
        return int(k)
    sp = s.eval.sampling
    stored_ok = sp.greedy or (sp.temperature == 1.0 and sp.top_k == 0 and sp.top_p == 1.0)
    if not (train_topk and stored_ok):
        return 0
    return topk_width(train_examples)


def build_eval_examples(
    s: TrainSettings,
    cfg: DictConfig,
    tokenizer,
    accelerator,
    topk: int = 0,
    *,
    target: str | None = None,
) -> list[Example]:
    """Held-out rows: reference completions, a given generate run, or (`target`) the target's
    own continuations in the serving mode (greedy, or sampled at eval.sampling), with the
    target's top-`topk` log-probs stored when `topk` > 0 (see `eval_topk`)."""
    ev = s.eval
    if ev.source == "target":
        settings = {
            "max_new_tokens": ev.max_new_tokens,
            "sampling": ev.sampling.as_dict(),
            "topk_logprobs": int(topk),
        }
        path = Path(str(ev.path or s.output_dir / "eval_continuations"))
        run_generate(s, cfg, accelerator, path, str(ev.split), settings)
        return load_seqkd(path, limit=ev.limit, use_topk=topk > 0)
    if ev.source == "path":
        if ev.path is None:
            raise ConfigError("eval.source=path needs eval.path (a generate-stage dataset)")
        return load_seqkd(ev.path, limit=ev.limit)
    prompts = load_prompts(
        _dataset_cfg(cfg, ev.split), tokenizer, default_split="test", target=target
    )
    return reference_examples(prompts[: ev.limit or None], tokenizer)
