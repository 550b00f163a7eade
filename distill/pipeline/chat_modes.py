"""The pipeline's `chat_modes`: the chat template modes a drafter is trained and validated in.

A model whose template renders one request several ways (Qwen3's `enable_thinking`: the
target reasons in a <think> block, or answers at once) serves a drafter traffic of every mode
it is asked in. `chat_modes: {thinking: {enable_thinking: true}, direct: {enable_thinking:
false}}` makes the plan (distill/pipeline/plan.py) generate the target's rows once per mode
(step generate_<label>, the dataset's `chat_template_kwargs` set to the mode's), train distill on
all of them, and validate the drafter in each mode (validate in the served one, validate_<label>
in each other). The served mode (`served_chat_mode`, else the first) also renders distill's
held-out eval and validate_base, and is the one the model card tells engines to serve with.
"""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from specdistill.data.runtime import ConfigError


def chat_modes(cfg: DictConfig) -> list[tuple[str, dict[str, Any]]]:
    """[(label, chat_template_kwargs)], the served mode first; [] when `chat_modes` is unset."""
    raw = cfg.get("chat_modes") or {}
    if OmegaConf.is_config(raw):
        raw = OmegaConf.to_container(raw, resolve=True)
    if not isinstance(raw, dict):
        raise ConfigError(
            f"chat_modes={raw!r} must map labels to chat_template_kwargs, e.g. "
            "{thinking: {enable_thinking: true}, direct: {enable_thinking: false}}"
        )
    modes = []
    for label, kwargs in raw.items():
        if not str(label).isidentifier():
            raise ConfigError(f"chat_modes.{label}: use an identifier (it names generate_{label})")
        if not isinstance(kwargs, dict):
            raise ConfigError(
                f"chat_modes.{label}={kwargs!r} must be a mapping of template arguments, "
                "e.g. {enable_thinking: false}"
            )
        modes.append((str(label), kwargs))
    served = cfg.get("served_chat_mode")
    if served is None:
        return modes
    labels = [label for label, _ in modes]
    if served not in labels:
        raise ConfigError(
            f"served_chat_mode={served!r} is not a chat_modes label: use one of {labels}"
        )
    return sorted(modes, key=lambda m: m[0] != served)
