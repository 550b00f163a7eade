"""`pair.attn_implementation`: which attention kernel `transformers` loads the pair's models with.

None leaves `transformers`' own choice (`sdpa` where the architecture has it). On GPUs,
`flash_attention_2` (the `flash-attn` package) is the kernel that packed training rows
(distill.packing) are attended with sequence by sequence, at no padding cost; `flash_attention_3`
is its Hopper build (`flash_attn_interface`). One rule for every stage that loads a model: a
name `transformers` does not know, or a flash kernel whose package is missing, is refused when
the plan is built (`check_attn_implementation`). A flash kernel runs on CUDA only: a step on
another device (the export's CPU self-check, a CPU run of a GPU preset) loads with
`transformers`' own choice instead and says so (`kernel_on`), since one pair serves every step.
"""

from __future__ import annotations

import importlib.util
import logging

import torch

from specdistill.data.runtime import ConfigError

log = logging.getLogger(__name__)

FIELD = "pair.attn_implementation"
# The kernels `transformers` loads by name, and the package each flash kernel imports.
KERNELS = ("eager", "sdpa", "flex_attention", "flash_attention_2", "flash_attention_3")
PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


def check_attn_implementation(value: object) -> str | None:
    """`value` as the kernel's name (None: `transformers`' choice); a refusal in one line."""
    if value is None or value == "":
        return None
    name = str(value)
    if name not in KERNELS:
        raise ConfigError(
            f"{FIELD}={name!r} is not an attention kernel `transformers` loads by name: use one "
            f"of {', '.join(KERNELS)}, or null for transformers' own choice"
        )
    package = PACKAGES.get(name)
    if package is not None and importlib.util.find_spec(package) is None:
        raise ConfigError(
            f"{FIELD}={name} needs the `{package}` package, which is not installed here: "
            "pip install flash-attn --no-build-isolation (on the GPU machines), or use sdpa"
        )
    return name


def kernel_on(name: str | None, device: torch.device | str, field: str) -> str | None:
    """The kernel `field`'s model loads with on `device`: `name`, or None (transformers' choice)
    where `name` is a flash kernel and `device` is not CUDA."""
    if name in PACKAGES and torch.device(device).type != "cuda":
        log.warning("%s=%s runs on CUDA only: %s loads on %s with transformers' default kernel",
                    FIELD, name, field, torch.device(device))  # fmt: skip
        return None
    return name
