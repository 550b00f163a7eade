"""A stage's config composed from conf/ with the user's overrides, and a bad key named in one line.

Hydra refuses an override of a key the config lacks with three lines that suggest appending it
(`+decoder.gama=3`), which for a typo is the wrong fix, and it cannot know that a key was
removed on purpose. Every stage's own command (`python -m specdistill.decode.validate ...`,
`check_command_line`) and the pipeline's `STAGE.KEY=VALUE` keys (distill/compose.py) go
through `compose_checked` instead: a removed key is refused with its reason, and when Hydra
fails the key at fault is named, with the closest key the stage has, as one `error:` line
(exit 2), before any model loads. Hydra still decides what composes: a key is only called
unknown after Hydra itself refused the overrides, so anything Hydra accepts (`+key=value`,
group choices such as `pair=toy-tiny`, `hydra.*` keys) still works.

It lives on the ground floor so that the generate stage, which imports neither `decode/` nor
`distill/`, uses the same check as the others; each stage passes its own removed keys.
"""

from __future__ import annotations

import contextlib
import difflib
import io
import sys
from collections.abc import Iterator, Mapping, Sequence
from importlib.resources import files
from typing import Any

import hydra
from hydra import initialize_config_module
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from hydra.errors import MissingConfigException
from omegaconf import DictConfig, OmegaConf

from specdistill.data.runtime import ConfigError, run_or_exit

_CONF = files("specdistill.conf")


def conf_values(name: str) -> dict[str, Any]:
    """conf/<name> (one YAML file of the config package, e.g. `decoder/greedy.yaml`) as plain
    values: how a library type whose defaults have their one home in that file (`DecoderConfig`)
    reads them, so a Python caller's default and a composed stage's are the same value."""
    node = OmegaConf.load(str(_CONF.joinpath(*name.split("/"))))
    values = OmegaConf.to_container(node, resolve=True)
    assert isinstance(values, dict), name
    return {str(k): v for k, v in values.items()}


def removed_message(key: str, why: str) -> str:
    """The one line that refuses a removed setting: what replaced it, and to drop the key."""
    return f"{key} was removed: {why}; drop the key"


@contextlib.contextmanager
def config_module() -> Iterator[None]:
    """Hydra's config search path (the `specdistill.conf` package), initialised once for a run
    of compositions."""
    if GlobalHydra.instance().is_initialized():
        yield
    else:
        with initialize_config_module(config_module="specdistill.conf", version_base="1.3"):
            yield


def picks_group(key: str) -> bool:
    """Whether `key=...` picks a config group (`decoder=sampling`) rather than setting a value:
    groups are the folders of conf/."""
    return _CONF.joinpath(*key.split(".")).is_dir()


def _is_hydra(key: str) -> bool:
    """Hydra's own settings (`hydra.run.dir=...`, `hydra/launcher=slurm`): Hydra's business."""
    return key == "hydra" or key.startswith(("hydra.", "hydra/"))


def _parse(overrides: Sequence[str]) -> list[Override]:
    """Each override read by Hydra's grammar; one that does not parse is named with the reason."""
    parser, out = OverridesParser.create(), []
    for text in overrides:
        try:
            out.append(parser.parse_override(text))
        except Exception as e:
            reason = " ".join(str(e).split())
            raise ConfigError(f"cannot read the override {text!r}: {reason}") from e
    return out


def _missing(cfg: DictConfig, key: str) -> tuple[str, list[str]] | None:
    """(the dotted key up to its first part `cfg` lacks, the keys beside that part) when `key`
    is not in `cfg`; None when it is, or when a part on the way is not a mapping (a null, a
    list or an interpolation, which Hydra judges itself)."""
    node: object = cfg
    parts = key.split(".")
    for i, part in enumerate(parts):
        if not isinstance(node, DictConfig):
            return None
        keys = [str(k) for k in node]  # the keys only: no value is resolved
        if part not in keys:
            prefix = "".join(f"{p}." for p in parts[:i])
            return prefix + part, [prefix + k for k in keys]
        node = node._get_node(part)  # the child node itself, unresolved
    return None


class _Refusal:
    """The one-line refusals, worded for a stage's own command or, with `section`, for the
    pipeline's `STAGE.KEY=VALUE` keys: then the line starts with the stage and names the key
    as the user wrote it (`validate.decoder.gama`)."""

    def __init__(self, stage: str, section: str | None) -> None:
        self.stage, self.section = stage, section
        self.prefix = f"{stage}: " if section else ""

    def unknown(self, key: str, known: list[str]) -> str:
        near = difflib.get_close_matches(key, known, n=1)
        hint = f"; did you mean `{near[0]}`?" if near else ""
        given = f"from `{self.section}.{key}`; " if self.section else ""
        return (
            f"{self.prefix}no key `{key}` in the {self.stage} stage "
            f"({given}its keys are in conf/{self.stage}.yaml){hint}"
        )

    def added_twice(self, key: str) -> str:
        return (
            f"{self.prefix}`+{key}` adds a key, but the {self.stage} stage already has `{key}`: "
            f"set it with `{key}=...`"
        )

    def no_choice(self, path: str, options: Sequence[str]) -> str:
        group, _, name = path.rpartition("/")
        return (
            f"{self.prefix}{group}={name}: conf/{group}/ has no {name}.yaml; "
            f"use one of {', '.join(options)}"
        )

    def hydra(self, e: Exception) -> str:
        text = " ".join(str(e).split())
        if self.section:
            return (
                f"{self.prefix}{text} (check the `{self.section}:` section of the pipeline config)"
            )
        return text


def _diagnose(stage: str, parsed: list[Override], say: _Refusal, e: Exception) -> str:
    """Hydra refused the overrides: the key at fault, found against the config composed with
    the group choices alone, or else Hydra's own message on one line."""
    groups = [o.input_line for o in parsed if picks_group(o.key_or_group)]
    try:
        with config_module():
            base = hydra.compose(config_name=stage, overrides=groups)
    except MissingConfigException as group_error:  # a choice that does not exist: pair=nope
        path, options = str(group_error.missing_cfg_file or ""), group_error.options
        return say.no_choice(path, options) if "/" in path and options else say.hydra(group_error)
    except Exception as group_error:
        return say.hydra(group_error)
    for o in parsed:
        if picks_group(o.key_or_group):
            continue
        gone = _missing(base, o.key_or_group)
        if o.type == OverrideType.CHANGE and gone is not None:
            return say.unknown(*gone)
        if o.type == OverrideType.ADD and gone is None:
            return say.added_twice(o.key_or_group)
    return say.hydra(e)


def compose_checked(
    stage: str,
    overrides: Sequence[str],
    removed: Mapping[str, str] | None = None,
    section: str | None = None,
) -> DictConfig:
    """conf/<stage>.yaml composed with `overrides` (Hydra's command-line grammar), or a
    ConfigError naming the key at fault: a key in `removed` (dotted key -> its one-line
    refusal, given first), a key the stage does not have (with the closest one it has), an
    existing key added with `+`. `section`: the pipeline section the keys came from
    (`validate` for `validate.decoder.gamma=3`), named in the message. Hydra's own settings
    (`hydra.*`) are left out: Hydra's main applies them."""
    say, removed = _Refusal(stage, section), removed or {}
    parsed = [o for o in _parse(overrides) if not _is_hydra(o.key_or_group)]
    for o in parsed:
        if o.key_or_group in removed and not o.is_delete():
            raise ConfigError(say.prefix + removed[o.key_or_group])
    try:
        with config_module():
            return hydra.compose(config_name=stage, overrides=[o.input_line for o in parsed])
    except Exception as e:
        raise ConfigError(_diagnose(stage, parsed, say, e)) from e


def command_line_overrides(argv: Sequence[str]) -> list[str] | None:
    """The overrides of a stage command, read with Hydra's own argument parser; None when the
    command composes no config of ours to check (`--help`, `--info`, shell completion, another
    config name, path or folder) or is a multirun, whose sweeps compose one job at a time."""
    from hydra._internal.utils import get_args_parser

    try:  # quietly: what argparse prints (a refused flag, --version), Hydra's main prints itself
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            args = get_args_parser().parse_args(list(argv))
    except SystemExit:
        return None
    skip = (args.help, args.hydra_help, args.info, args.shell_completion, args.multirun)
    other = (args.config_name, args.config_path, args.config_dir, args.experimental_rerun)
    if any(skip) or any(x is not None for x in other):
        return None
    return list(args.overrides)


def check_command_line(
    stage: str, removed: Mapping[str, str] | None = None, argv: Sequence[str] | None = None
) -> None:
    """A stage command's overrides checked before its Hydra main runs: a bad key is one
    `error:` line and exit 2, before any model loads (`run_or_exit`)."""
    overrides = command_line_overrides(sys.argv[1:] if argv is None else argv)
    if overrides is not None:
        run_or_exit(lambda keys: compose_checked(stage, keys, removed), overrides)
