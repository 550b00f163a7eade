"""The embedded toy world: real code data and real checkpoints, built offline from the stdlib.

No hub is reachable in CI and a first run should not need one, so the toy world trains its own
byte-level BPE tokenizer, a small Llama target and a much smaller base drafter on the Python
standard library's source, and extracts HumanEval-like prompts (signature + docstring) from
held-out modules. Everything is an ordinary `transformers` checkpoint, loaded downstream with
`from_pretrained` exactly like a hub model. Builds are deterministic, cached under
`$SPECDISTILL_HOME` (default `~/.cache/specdistill`), locked against concurrent builders and
published atomically (temp dir + rename).
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import math
import os
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from specdistill.data.io import build_once
from specdistill.data.runtime import specdistill_home

log = logging.getLogger(__name__)

# Bump when anything below changes what a build produces, so stale caches are not reused.
TOY_VERSION = 2
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "__pycache__", "turtledemo", "ensurepip"}


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
    # build to minutes on a 2-core CPU (build times: RESULTS.md, data/RESULTS.md).
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


@dataclass(frozen=True)
class ToyWorld:
    """Paths of one built toy world."""

    name: str
    root: Path

    @property
    def tokenizer_dir(self) -> Path:
        return self.root / "tokenizer"

    @property
    def target_dir(self) -> Path:
        return self.root / "target"

    @property
    def drafter_dir(self) -> Path:
        return self.root / "drafter"

    @property
    def train_prompts(self) -> Path:
        return self.root / "prompts" / "train.jsonl"

    @property
    def test_prompts(self) -> Path:
        return self.root / "prompts" / "test.jsonl"

    @property
    def build_info(self) -> dict:
        return json.loads((self.root / "build.json").read_text())


def _stdlib_dir() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _cache_dir(name: str) -> Path:
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return specdistill_home() / "toy" / f"{name}-v{TOY_VERSION}-{py}"


def ensure_toy_world(name: str = "toy-tiny") -> ToyWorld:
    """Return the toy world `name`, building it first if it is not cached."""
    if name not in SPECS:
        from specdistill.data.runtime import ConfigError

        raise ConfigError(f"pair.toy={name!r} is not a toy world; choose one of {sorted(SPECS)}")
    root = build_once(
        _cache_dir(name), "build.json", lambda tmp: _build(SPECS[name], ToyWorld(name, tmp))
    )
    return ToyWorld(name=name, root=root)


def toy_prompts(name: str, split: str) -> list[dict]:
    """The toy world `name`'s prompt set without building its models: read from the built world
    when there is one, else extracted from the stdlib exactly as its build would (same modules,
    same cap, same order) and cached beside it. A real pair reads toy prompts this way: the full
    world's 2000 training prompts cost seconds, not its minutes of model training."""
    if name not in SPECS:
        from specdistill.data.runtime import ConfigError

        raise ConfigError(f"dataset.toy={name!r} is not a toy world; choose one of {sorted(SPECS)}")
    world = ToyWorld(name=name, root=_cache_dir(name))
    path = world.train_prompts if split == "train" else world.test_prompts
    if (world.root / "build.json").exists():
        return read_jsonl(path)
    cached = _cache_dir(name).with_name(_cache_dir(name).name + "-prompts") / f"{split}.jsonl"
    if not cached.exists():
        spec = SPECS[name]
        train_paths, held_paths = _spec_files(spec)
        paths, cap = (
            (train_paths, spec.max_train_prompts)
            if split == "train"
            else (held_paths, spec.max_test_prompts)
        )
        tmp = cached.with_name(f"{cached.name}.tmp-{os.getpid()}")
        _write_jsonl(tmp, _prompt_set(paths, cap))
        os.replace(tmp, cached)
    return read_jsonl(cached)


def toy_tokenizer_dir(name: str) -> Path:
    """The toy world `name`'s tokenizer folder without building its models: the built world's,
    else trained alone exactly as its build would (same texts, same settings; ~10 s for `toy`)
    and cached beside it. The vocabulary mapping of the toy drafter against another target needs
    only this."""
    if name not in SPECS:
        from specdistill.data.runtime import ConfigError

        raise ConfigError(f"toy world {name!r} does not exist; choose one of {sorted(SPECS)}")
    world = ToyWorld(name=name, root=_cache_dir(name))
    if (world.root / "build.json").exists():
        return world.tokenizer_dir
    spec = SPECS[name]

    def build(tmp: Path) -> None:
        tokenizer = train_tokenizer(_texts(_spec_files(spec)[0]), spec.vocab_size)
        tokenizer.model_max_length = spec.max_positions
        tokenizer.save_pretrained(tmp)
        (tmp / "done").write_text("1")

    return build_once(
        _cache_dir(name).with_name(_cache_dir(name).name + "-tokenizer"), "done", build
    )


def _spec_files(spec: ToySpec) -> tuple[list[Path], list[Path]]:
    """(train, held-out) stdlib files of a spec: tiny worlds take a deterministic spread of
    training files, not the alphabetically first ones."""
    train_paths, held_paths = corpus_files()
    if spec.train_files is not None:
        train_paths = sorted(train_paths, key=lambda p: hashlib.md5(p.name.encode()).hexdigest())
        train_paths = sorted(train_paths[: spec.train_files])
    return train_paths, held_paths


# ----------------------------------------------------------------------------- corpus


def is_held_out(key: str) -> bool:
    """The split rule, one place for every prompt set: a document (a stdlib module's relative
    path, or a long document's key) is held out (test) for 1 in 10 hashes, else train."""
    return int(hashlib.md5(key.encode()).hexdigest(), 16) % 10 == 0


def corpus_files() -> tuple[list[Path], list[Path]]:
    """Stdlib modules split into (train, held-out) by a hash of the relative path."""
    base = _stdlib_dir()
    train, held = [], []
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(base)
        if any(part in _SKIP_DIRS for part in rel.parts[:-1]):
            continue
        (held if is_held_out(rel.as_posix()) else train).append(path)
    return train, held


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def _texts(paths: list[Path]) -> list[str]:
    return [t for t in (_read(p) for p in paths) if t and t.strip()]


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    """A byte-level BPE (GPT-2 style pre-tokenisation) wrapped as a fast HF tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=None,
        padding_side="left",
    )
    return hf


def _token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """All documents concatenated, each followed by EOS, as one long id stream."""
    eos = tokenizer.eos_token_id
    ids: list[int] = []
    # The raw backend: documents are longer than the model context, which is fine here.
    for enc in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


# ----------------------------------------------------------------------------- models


def make_llama(shape: ModelShape, vocab_size: int, max_positions: int, tokenizer, seed: int):
    """A small Llama with the tokenizer's special ids wired into its config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def _batches(stream: torch.Tensor, seq_len: int, batch: int, seed: int) -> Iterator[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hi = len(stream) - seq_len - 1
    while True:
        starts = torch.randint(0, hi, (batch,), generator=gen)
        yield torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])


@torch.no_grad()
def heldout_loss(model, stream: torch.Tensor, seq_len: int, n_windows: int = 32) -> float:
    """Mean next-token loss on evenly spaced held-out windows (deterministic)."""
    model.eval()
    step = max(1, (len(stream) - seq_len - 1) // n_windows)
    losses = []
    for i in range(n_windows):
        w = stream[i * step : i * step + seq_len + 1]
        if len(w) < seq_len + 1:
            break
        logits = model(input_ids=w[None, :-1]).logits
        losses.append(float(torch.nn.functional.cross_entropy(logits[0].float(), w[1:])))
    model.train()
    return float(sum(losses) / max(1, len(losses)))


def train_lm(model, stream: torch.Tensor, spec: ToySpec, steps: int, seed: int, desc: str):
    """Plain next-token training with warm-up + cosine decay; returns tokens/s."""
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup = max(1, steps // 10)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    batches = _batches(stream, spec.seq_len, spec.batch_size, seed)
    t0 = time.perf_counter()
    bar = tqdm(range(steps), desc=desc, leave=False, disable=None)
    log_every = max(1, steps // 10)  # tqdm is silent without a TTY: logs show progress too
    for step in bar:
        b = next(batches)
        logits = model(input_ids=b[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), b[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        bar.set_postfix(loss=f"{loss.item():.3f}")
        if (step + 1) % log_every == 0:
            rate = (step + 1) * spec.batch_size * spec.seq_len / (time.perf_counter() - t0)
            log.info(
                "%s: step %d/%d loss %.3f (%.0f tokens/s)", desc, step + 1, steps, loss.item(), rate
            )
    elapsed = time.perf_counter() - t0
    return steps * spec.batch_size * spec.seq_len / max(elapsed, 1e-9)


# ----------------------------------------------------------------------------- prompts


def extract_prompts(text: str, module: str) -> list[dict]:
    """Functions with a docstring, cut right after the docstring's closing quotes.

    The prompt is the dedented signature + docstring; the completion is the rest of the body,
    used as the reference answer by fixed-data distillation.
    """
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    rows = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if ast.get_docstring(node) is None or len(node.body) < 2:
            continue
        doc = node.body[0]
        indent = lines[node.lineno - 1][: node.col_offset]
        if indent.strip():  # e.g. `class A: def f(): ...` on one line
            continue
        last = lines[doc.end_lineno - 1].encode("utf-8")
        head = last[: doc.end_col_offset].decode("utf-8", errors="ignore")
        tail = last[doc.end_col_offset :].decode("utf-8", errors="ignore")
        prompt_lines = [*lines[node.lineno - 1 : doc.end_lineno - 1], head]
        completion_lines = [tail, *lines[doc.end_lineno : node.end_lineno]]
        prompt = "".join(_dedent(prompt_lines, indent))
        completion = "".join(_dedent(completion_lines, indent))
        if not completion.strip() or len(prompt) > 800:
            continue
        rows.append(
            {
                "prompt": prompt,
                "completion": completion[:1500],
                "module": module,
                "name": node.name,
            }
        )
    return rows


def _dedent(lines: list[str], indent: str) -> list[str]:
    return [ln[len(indent) :] if ln.startswith(indent) else ln for ln in lines]


def _prompt_set(paths: list[Path], limit: int) -> list[dict]:
    base = _stdlib_dir()
    rows: list[dict] = []
    for p in paths:
        text = _read(p)
        if text:
            rows.extend(extract_prompts(text, p.relative_to(base).as_posix()))

    # Spread the cap over modules instead of taking the first few files whole.
    def key(r: dict) -> str:
        return hashlib.md5(f"{r['module']}:{r['name']}:{r['prompt'][:64]}".encode()).hexdigest()

    return sorted(rows, key=key)[:limit]


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    with Path(path).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ----------------------------------------------------------------------------- build


def _build(spec: ToySpec, world: ToyWorld) -> None:
    t_start = time.perf_counter()
    torch_threads = torch.get_num_threads()
    log.info("building toy world %r under %s (one-off; cached afterwards)", spec.name, world.root)
    world.root.mkdir(parents=True)
    train_paths, held_paths = _spec_files(spec)
    train_texts, held_texts = _texts(train_paths), _texts(held_paths)

    t = time.perf_counter()
    tokenizer = train_tokenizer(train_texts, spec.vocab_size)
    tokenizer.model_max_length = spec.max_positions
    tokenizer.save_pretrained(world.tokenizer_dir)
    t_tok = time.perf_counter() - t

    train_stream = _token_stream(tokenizer, train_texts)
    held_stream = _token_stream(tokenizer, held_texts[:40])
    vocab = len(tokenizer)

    info: dict = {"spec": asdict(spec), "torch_threads": torch_threads, "version": TOY_VERSION}
    info["corpus"] = {
        "train_files": len(train_texts),
        "heldout_files": len(held_texts),
        "train_tokens": len(train_stream),
        "train_bytes": sum(len(t.encode()) for t in train_texts),
        "tokenizer_seconds": round(t_tok, 2),
    }
    for role, shape, steps, seed, out in (
        ("target", spec.target, spec.target_steps, 1, world.target_dir),
        ("drafter", spec.drafter, spec.drafter_steps, 2, world.drafter_dir),
    ):
        model = make_llama(shape, vocab, spec.max_positions, tokenizer, seed)
        t = time.perf_counter()
        tps = train_lm(model, train_stream, spec, steps, seed, desc=f"toy {role}")
        info[role] = {
            "params": sum(p.numel() for p in model.parameters()),
            "train_seconds": round(time.perf_counter() - t, 1),
            "train_tokens_per_s": round(tps),
            "heldout_loss": round(heldout_loss(model, held_stream, spec.seq_len), 4),
        }
        model.generation_config.pad_token_id = tokenizer.pad_token_id
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
        log.info("toy %s: %s", role, info[role])

    _write_jsonl(world.train_prompts, _prompt_set(train_paths, spec.max_train_prompts))
    _write_jsonl(world.test_prompts, _prompt_set(held_paths, spec.max_test_prompts))
    info["prompts"] = {
        "train": sum(1 for _ in world.train_prompts.open()),
        "test": sum(1 for _ in world.test_prompts.open()),
    }
    info["build_seconds"] = round(time.perf_counter() - t_start, 1)
    (world.root / "build.json").write_text(json.dumps(info, indent=2))


def main() -> None:
    """`python -m specdistill.data.toy.world [toy|toy-tiny]`: build (or find) a toy world."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    name = sys.argv[1] if len(sys.argv) > 1 else "toy"
    world = ensure_toy_world(name)
    print(json.dumps({"root": str(world.root), **world.build_info}, indent=2))


if __name__ == "__main__":
    main()
