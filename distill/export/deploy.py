"""The lines a user deploys the exported drafter with, in every engine, built in one place.

`deployment(...)` is a pure function of what decides them: the target (id or path), the drafter
(the exported folder, or its hub id when the export is pushed), K, the drafting mode
(autoregressive or parallel), the vocabulary kind and the GGUF files export wrote. The card and
export.json both print its `Deployment`, so the Python block, the shell lines and the JSON that
records them can never disagree.

- vLLM: `speculative_config` is validate's own (decode/validate/vllm_engine.speculative_config:
  `draft_model`, `parallel_drafting` for a parallel drafter, `use_heterogeneous_vocab` for a
  drafter with its own tokenizer), as an `LLM(...)` block and as
  `vllm serve T --speculative-config JSON`.
- SGLang: `--speculative-algorithm STANDALONE` (flag names of sglang's `server_args.py`): K draft
  steps of one token each (`--speculative-eagle-topk 1`), K + 1 tokens verified. Its standalone
  drafter shares the target's vocabulary, so a drafter with its own tokenizer gets no line.
- llama.cpp: `llama-server -m T.gguf -md D.gguf --spec-type draft-simple --spec-draft-n-max K
  --spec-draft-n-min 0` (flag names of the release decode/llamacpp builds; `--draft-max` and
  `--draft-min` are their older spellings), only when GGUF files were exported; otherwise the
  line says how to write them.

Shell arguments are quoted with `shlex`, so a path with spaces survives a copy and paste.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from typing import Any

from specdistill.data.models.pairs import PairSpec
from specdistill.decode.validate.vllm_engine import speculative_config

VOCAB_KINDS = ("shared", "draft_vocab", "mapped")  # same tokenizer / a draft vocabulary / TLI
DRAFTING = ("autoregressive", "parallel")


@dataclass(frozen=True)
class GGUFFiles:
    """The GGUF pair export wrote: the target's file and the drafter's file name in its folder."""

    target: str
    drafter_file: str


@dataclass(frozen=True)
class Deployment:
    """Every engine's lines for one exported drafter (None: the engine cannot serve it; the
    matching `*_note` says why or what to run first)."""

    k: int
    target: str
    drafter: str
    drafting: str  # DRAFTING
    vocab: str  # VOCAB_KINDS
    vllm_speculative_config: dict[str, Any]
    vllm_python: str  # an `LLM(...)` statement
    vllm_serve: str
    transformers: str  # one line of `transformers` assisted generation
    sglang: str | None
    llama_fetch: str | None  # the drafter's GGUF file fetched from the hub first
    llama_server: str | None
    notes: dict[str, str]  # engine -> why it has no line, or what its line assumes


def python_value(value: Any) -> str:
    """A value as the card's Python writes it: strings double-quoted (as in the engines' docs,
    unescaped, like the paths around them), True and numbers as Python spells them."""
    return f'"{value}"' if isinstance(value, str) else repr(value)


def transformers_line(target: str, drafter: str, *, own_tokenizer: bool = False) -> str:
    """One line that serves the pair with `transformers` assisted generation (universal assisted
    generation, with both tokenizers, for a drafter with its own tokenizer)."""
    tokenizers = (
        f", tokenizer=AutoTokenizer.from_pretrained({target!r}), "
        f"assistant_tokenizer=AutoTokenizer.from_pretrained({drafter!r})"
        if own_tokenizer
        else ""
    )
    return (
        f"AutoModelForCausalLM.from_pretrained({target!r}).generate(**inputs, "
        f"assistant_model=AutoModelForCausalLM.from_pretrained({drafter!r}){tokenizers})"
    )


def _llama_cpp(
    drafter: str, k: int, vocab: str, gguf: GGUFFiles | None, drafter_on_hub: bool
) -> tuple[str | None, str | None, str | None]:
    """(fetch line, llama-server line, note)."""
    flags = ["--spec-type", "draft-simple", "--spec-draft-n-max", str(k), "--spec-draft-n-min", "0"]
    if vocab == "mapped":
        note = (
            "llama.cpp pairs a drafter only with a target of the same vocabulary (it has no "
            "vocabulary mapping): serve this drafter in vLLM or `transformers`"
        )
        return None, None, note
    if gguf is None:
        note = (
            "no GGUF files were exported: rerun the export with `gguf.enabled=true` (pipeline: "
            "`specdistill llamacpp=true`) to write drafter-*.gguf checked against the target's "
            "GGUF, then serve with `"
            + shlex.join(["llama-server", "-m", "TARGET.gguf", "-md", "DRAFTER.gguf", *flags])
            + "`"
        )
        return None, None, note
    fetch = None
    drafter_gguf = f"{drafter}/{gguf.drafter_file}"
    if drafter_on_hub:  # llama-server reads a local file: fetch it into a folder named as the repo
        local = drafter.rsplit("/", 1)[-1]
        fetch = shlex.join(["hf", "download", drafter, gguf.drafter_file, "--local-dir", local])
        drafter_gguf = f"{local}/{gguf.drafter_file}"
    server = shlex.join(["llama-server", "-m", gguf.target, "-md", drafter_gguf, *flags])
    return fetch, server, None


def deployment(
    target: str,
    drafter: str,
    k: int,
    *,
    drafting: str = "autoregressive",
    vocab: str = "shared",
    gguf: GGUFFiles | None = None,
    drafter_on_hub: bool = False,
) -> Deployment:
    """Every engine's lines for serving `drafter` with `target` at K drafts a round (module
    docstring). `drafter_on_hub`: `drafter` is a hub id (the GGUF file is fetched first)."""
    if vocab not in VOCAB_KINDS:
        raise ValueError(f"vocab={vocab!r}: one of {VOCAB_KINDS}")
    if drafting not in DRAFTING:
        raise ValueError(f"drafting={drafting!r}: one of {DRAFTING}")
    mapped = vocab == "mapped"
    pair = PairSpec(target, drafter, target, vocab="mapped" if mapped else "shared")
    config = speculative_config(pair, k, parallel=drafting == "parallel")
    items = ", ".join(f'"{key}": {python_value(v)}' for key, v in config.items())
    vllm_serve = shlex.join(["vllm", "serve", target, "--speculative-config", json.dumps(config)])
    notes: dict[str, str] = {}
    sglang = None
    if mapped:
        notes["sglang"] = (
            "SGLang's standalone drafter must share the target's vocabulary: serve this drafter "
            "in vLLM (use_heterogeneous_vocab) or transformers"
        )
    else:
        sglang = shlex.join(
            ["python", "-m", "sglang.launch_server", "--model-path", target,
             "--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", drafter,
             "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
             "--speculative-num-draft-tokens", str(k + 1)]
        )  # fmt: skip
        if drafting == "parallel":
            notes["sglang"] = "SGLang drafts with it autoregressively (no parallel drafting)"
    if vocab == "draft_vocab":
        notes["head"] = (
            "vLLM, SGLang and llama.cpp run the full exported head (config.json's "
            "draft_vocab_ids is read by specdistill's decoder only)"
        )
    fetch, server, llama_note = _llama_cpp(drafter, k, vocab, gguf, drafter_on_hub)
    if llama_note:
        notes["llama_cpp"] = llama_note
    return Deployment(
        k=k,
        target=target,
        drafter=drafter,
        drafting=drafting,
        vocab=vocab,
        vllm_speculative_config=config,
        vllm_python=f'llm = LLM(model="{target}", speculative_config={{{items}}})',
        vllm_serve=vllm_serve,
        transformers=transformers_line(target, drafter, own_tokenizer=mapped),
        sglang=sglang,
        llama_fetch=fetch,
        llama_server=server,
        notes=notes,
    )
