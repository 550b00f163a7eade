"""Each planned step's Slurm job: its resources from the pipeline's `slurm` node, then the
cluster settings (SPECDISTILL_*), then the placement rules below.

    slurm:                          # conf/pipeline.yaml; a pair's sizing file may fill it
      time: "04:00:00"              # every job's, unless its section says otherwise
      gpus_per_node: 8              # the GPUs of a node: distill takes them all, a one-GPU step one
      distill: {nodes: 2, time: "1-00:00:00", signal_delay_s: 300}
      generate: {array: 8}
      validate: {gpus_per_node: 1}

A key is looked up in the step's own section (`validate_base`), then its stage's
(`validate`), then the node's top level, then the cluster settings; what none sets takes the
placement rule: a one-GPU step gets one of the node's GPUs, generate with `backend=vllm` its
engine's `tensor_parallel_size`, distill every GPU of its nodes, one process per GPU, report none.
The pipeline's `slurm` keys win over the cluster settings: they size one run's steps (a pair's
preset), where SPECDISTILL_* describe the cluster. Every value is checked here, before anything is
written or submitted, and a bad one is one `error:` line naming the key.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from omegaconf import DictConfig, OmegaConf

from specdistill.data.runtime import ConfigError

STAGE_ONLY = {  # keys a section may set only for its stage's steps
    "nodes": "distill",
    "tasks_per_node": "distill",
    "array": "generate",
}
ENV = {  # the cluster setting each key falls back to
    "partition": "SPECDISTILL_PARTITION",
    "time": "SPECDISTILL_TIME",
    "gpus_per_node": "SPECDISTILL_GPUS_PER_NODE",
    "cpus_per_task": "SPECDISTILL_CPUS_PER_TASK",
    "nodes": "SPECDISTILL_NODES",
    "tasks_per_node": "SPECDISTILL_PROCS_PER_NODE",
    "array": "SPECDISTILL_GENERATE_TASKS",
}
SECTION_STAGES = ("generate", "distill", "online", "validate", "export", "report")
MAX_INT_MINUTES = 7 * 24 * 60  # a longer limit is written D-HH:MM:SS


@dataclass(frozen=True)
class Requeue:
    """How a job ends near its time limit: submitit sends USR2 `signal_delay_s` seconds before
    it (distill saves a checkpoint on it, distill/train/preempt.py) and requeues the job at most
    `max_num_timeout` times. The defaults are submitit's; conf/pipeline.yaml lists the same."""

    max_num_timeout: int = 3
    signal_delay_s: int = 90


@dataclass(frozen=True)
class Job:
    """One step's Slurm resources, checked."""

    partition: str
    time: str  # as given (Slurm's own formats); `minutes` is what submitit requeues by
    minutes: int
    nodes: int
    tasks_per_node: int
    gpus_per_node: int
    cpus_per_task: int | None
    array: int
    max_num_timeout: int
    signal_delay_s: int

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


KEYS = tuple(f.name for f in fields(Job) if f.name != "minutes")


def time_minutes(text: Any, field: str = "SPECDISTILL_TIME") -> int:
    """Slurm's time formats (MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS) in minutes."""
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", str(text).strip())
    if not m or isinstance(text, bool):
        raise ConfigError(f"{field}={text!r}: use HH:MM:SS (or D-HH:MM:SS, or minutes)")
    days, a, b, c = (int(x) if x else None for x in m.groups())
    if days is not None:  # D-HH[:MM[:SS]]
        hours, minutes, seconds = a, b or 0, c or 0
    elif c is not None:  # HH:MM:SS
        hours, minutes, seconds = a, b, c
    elif b is not None:  # MM:SS
        hours, minutes, seconds = 0, a, b
    else:  # MM
        hours, minutes, seconds = 0, a, 0
    return max(1, ((days or 0) * 24 + (hours or 0)) * 60 + (minutes or 0) + (1 if seconds else 0))


def _int(value: Any, field: str, minimum: int) -> int:
    """An integer >= minimum, or one line naming the field."""
    try:
        out = int(str(value)) if not isinstance(value, bool) else minimum - 1
    except ValueError:
        out = minimum - 1
    if out < minimum:
        raise ConfigError(f"{field}={value!r} must be an integer >= {minimum}")
    return out


def _sections(node: Mapping[str, Any], steps: list[Any]) -> dict[str, dict[str, Any]]:
    """The node's step and stage sections, each key checked to be one a job has."""
    stage_of = {stage: stage for stage in SECTION_STAGES} | {s.name: s.stage for s in steps}
    top = set(KEYS) - set(STAGE_ONLY)
    out = {}
    for key, value in node.items():
        if key in top:
            continue
        if key in STAGE_ONLY:
            raise ConfigError(
                f"slurm.{key}: set it in the {STAGE_ONLY[key]} section "
                f"(slurm.{STAGE_ONLY[key]}.{key}); only {STAGE_ONLY[key]} has it"
            )
        if key not in stage_of:
            raise ConfigError(
                f"slurm.{key}: no step or stage of this plan is named {key!r}; use one of "
                f"{sorted(stage_of)} or a job key {sorted(top)}"
            )
        section = dict(value or {})
        for k in section:
            if k not in KEYS:
                raise ConfigError(f"slurm.{key}.{k}: not a job key; use one of {list(KEYS)}")
            if k in STAGE_ONLY and stage_of[key] != STAGE_ONLY[k] and section[k] is not None:
                raise ConfigError(f"slurm.{key}.{k}: only {STAGE_ONLY[k]} steps have {k}; drop it")
        out[str(key)] = section
    return out


@dataclass(frozen=True)
class _StepKeys:
    """One step's view of the keys: its section, its stage's, the node's top level, then the
    cluster settings; each value with the field it came from, for the error line."""

    step: Any
    node: Mapping[str, Any]
    sections: Mapping[str, Mapping[str, Any]]
    settings: Mapping[str, str]
    source: str  # where the cluster settings come from

    def get(self, key: str) -> tuple[Any, str]:
        """(value, field); (None, "") when nothing sets it."""
        for name in (self.step.name, self.step.stage):
            value = self.sections.get(name, {}).get(key)
            if value is not None:
                return value, f"slurm.{name}.{key}"
        if key not in STAGE_ONLY and self.node.get(key) is not None:
            return self.node[key], f"slurm.{key}"
        if key in ENV and self.settings.get(ENV[key]):
            return self.settings[ENV[key]], ENV[key]
        return None, ""

    def required(self, key: str) -> tuple[Any, str]:
        value, field = self.get(key)
        if value is None or value == "":
            raise ConfigError(
                f"{ENV[key]} is not set: export it or add it to {self.source}, or set "
                f"slurm.{key} (or slurm.{self.step.stage}.{key}) (see slurm/README.md)"
            )
        return value, field

    def count(self, key: str, minimum: int, default: int) -> int:
        """An integer key, checked; `default` when nothing sets it."""
        value, field = self.get(key)
        return default if value is None else _int(value, field, minimum)

    def optional(self, key: str, minimum: int) -> int | None:
        """An integer key, checked; None when nothing sets it (Slurm's own default)."""
        value, field = self.get(key)
        return None if value is None else _int(value, field, minimum)

    def own(self, key: str) -> bool:
        """Whether the step's own section or its stage's sets `key`."""
        return self.get(key)[1] in (
            f"slurm.{self.step.name}.{key}",
            f"slurm.{self.step.stage}.{key}",
        )


def _minutes(value: Any, field: str) -> int:
    """A time limit in minutes; an integer is minutes already. A yaml `12:00:00` left unquoted
    reads as a base-60 integer (43200), which no limit of minutes means: refused, not run for
    a month."""
    if isinstance(value, int) and not isinstance(value, bool) and value > MAX_INT_MINUTES:
        raise ConfigError(
            f"{field}={value}: more than {MAX_INT_MINUTES} minutes as a number; an unquoted "
            'HH:MM:SS in yaml reads as one, so quote it ("12:00:00"), or use D-HH:MM:SS'
        )
    return time_minutes(value, field)


def _job(k: _StepKeys, requeue: Requeue) -> Job:
    """One step's Job from its keys, each value checked."""
    step = k.step
    partition, _ = k.required("partition")
    time, time_field = k.required("time")
    minutes = _minutes(time, time_field)
    gpus = _gpus(k)
    distill, generate = step.stage == "distill", step.stage == "generate"
    job = Job(
        partition=str(partition),
        time=str(time),
        minutes=minutes,
        nodes=k.count("nodes", 1, 1) if distill else 1,
        tasks_per_node=k.count("tasks_per_node", 1, max(gpus, 1)) if distill else 1,
        gpus_per_node=gpus,
        cpus_per_task=k.optional("cpus_per_task", 1),
        array=k.count("array", 1, 1) if generate else 1,
        max_num_timeout=k.count("max_num_timeout", 0, requeue.max_num_timeout),
        signal_delay_s=k.count("signal_delay_s", 1, requeue.signal_delay_s),
    )
    if job.signal_delay_s >= minutes * 60:  # requeued the moment it starts, until the cap
        field = k.get("signal_delay_s")[1] or "slurm.signal_delay_s"
        raise ConfigError(
            f"{field}={job.signal_delay_s}: the {step.name} job's signal would come before it "
            f"starts (time {time}); lower it or raise the time"
        )
    return job


def jobs(
    steps: list[Any], node: Any, settings: Mapping[str, str], source: str = "the cluster settings"
) -> dict[str, Job]:
    """Every step's Job. `node`: the pipeline's `slurm` node (None: empty); `settings`: the
    cluster settings (slurm.py's load_settings); `source` says where those come from, for the
    line a missing required value gets."""
    if isinstance(node, DictConfig):
        node = OmegaConf.to_container(node, resolve=True)
    node = dict(node or {})
    sections = _sections(node, steps)
    return {
        step.name: _job(_StepKeys(step, node, sections, settings, source), Requeue())
        for step in steps
    }


def _gpus(k: _StepKeys) -> int:
    """The step's GPUs per node: its own section's value as given, else the placement rule on
    the node's GPUs (slurm.gpus_per_node or SPECDISTILL_GPUS_PER_NODE)."""
    step = k.step
    if step.stage == "report":  # summary.md and a plot
        return 0
    if k.own("gpus_per_node"):
        value, field = k.get("gpus_per_node")
        return _int(value, field, 0)
    value, field = k.required("gpus_per_node")
    node_gpus = _int(value, field, 0)
    if step.stage == "distill":
        return node_gpus
    if step.stage == "generate" and step.config.get("backend") == "vllm":
        per_engine = int((step.config.get("vllm") or {}).get("tensor_parallel_size") or 1)
        return min(node_gpus, per_engine)
    return min(node_gpus, 1)
