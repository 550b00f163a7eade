"""`llama-server` as a managed engine: started on a free loopback port, asked for completions by
token id, stopped on exit. Standard library only (subprocess, socket, urllib, json).

Why token ids: both our decoder and llama.cpp must see the same prompt tokens, so the prompt
is posted as a list of ids, which the server (b11434, `tokenize_input_subprompt`) takes as
they are: no BOS is added to a token-id prompt, only to a string (or a list whose first
element is a string). A caller that wants a BOS puts it in the list.

Flags (as named in this build's `common/arg.cpp`): `-m`, `-c`, `-t`, `-np 1` (one slot: one
request at a time, the slot holding the whole `-c`), `--no-ui`, `--host 127.0.0.1`,
`--port`, `--poll 0` (no spinning workers; `poll=None` keeps llama.cpp's 50); with a drafter `-md DRAFT --spec-type draft-simple --spec-draft-n-max K
--spec-draft-n-min N --spec-draft-p-min P` and, optionally, `--spec-draft-sampling
{greedy,probabilistic}`. Greedy (the default) drafts q's argmax and the target checks by
sample-and-match: at temperature > 0 it emits the plain run's tokens seed for seed, but accepts
little. Probabilistic samples drafts and verifies by rejection sampling, with q = the
drafter's top 10 at the request's temperature (`spec_retune` in common/speculative.cpp), not its
full softmax: a model drafting for itself accepted 0.55 at temperature 1, not 1. At
temperature 0 the server always matches. llama.cpp's defaults are n_max 3, n_min 0, p_min 0.0,
and these are ours. The server's log (stdout and stderr) goes to a file, whose last lines
every startup failure quotes.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdistill.data.runtime import ConfigError
from specdistill.data.sampling import Sampling

HOST = "127.0.0.1"
DRAFT_SAMPLING = ("greedy", "probabilistic")
_BIND_FAILED = "couldn't bind HTTP server socket"  # server-http.cpp's message


class LlamaServerError(RuntimeError):
    """llama-server failed to start, died, or answered a request with an error."""


@dataclass
class Completion:
    """One `/completion` answer: the generated ids and the server's `timings` for the request.

    `predicted_n` counts every generated token, the first included; `predicted_ms` runs from
    the first token to the last, so the first (sampled from the prompt's forward) is free:
    `predicted_per_second` is (predicted_n - 1) / predicted_ms. `draft_n` / `draft_n_accepted`
    are the drafter's proposed / accepted tokens (0 when the server has no drafter: the server
    leaves the fields out then).
    """

    tokens: list[int]
    predicted_n: int
    predicted_ms: float
    predicted_per_second: float
    prompt_n: int
    prompt_ms: float
    draft_n: int = 0
    draft_n_accepted: int = 0
    stop_type: str = ""
    raw_timings: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_response(cls, body: dict[str, Any]) -> Completion:
        t = body.get("timings") or {}
        return cls(
            tokens=[int(x) for x in body.get("tokens") or []],
            predicted_n=int(t.get("predicted_n", 0)),
            predicted_ms=float(t.get("predicted_ms", 0.0)),
            predicted_per_second=float(t.get("predicted_per_second", 0.0)),
            prompt_n=int(t.get("prompt_n", 0)),
            prompt_ms=float(t.get("prompt_ms", 0.0)),
            draft_n=int(t.get("draft_n", 0)),
            draft_n_accepted=int(t.get("draft_n_accepted", 0)),
            stop_type=str(body.get("stop_type", "")),
            raw_timings=dict(t),
        )


def free_port(host: str = HOST) -> int:
    """A port the OS has just handed out (bind to 0); released for the server to take."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def version(binary: str | Path) -> str:
    """`llama-server --version`'s first line, e.g. `version: 0.6.0-dev (build 11434, commit ...)`."""
    done = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False
    )
    lines = [x.strip() for x in (done.stdout + done.stderr).splitlines() if x.strip()]
    found = [x for x in lines if x.startswith("version:")]
    if done.returncode != 0 or not found:
        raise LlamaServerError(f"{binary} --version exited {done.returncode}: {lines[-1:]}")
    return found[0]


def _die_with_parent() -> None:
    """Run in the child before exec (Linux): SIGTERM when the process that started the server
    dies, so that a killed stage leaves no server holding a port, memory and its model file."""
    import contextlib
    import ctypes

    with contextlib.suppress(OSError):  # no glibc: the server outlives a killed parent
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _temp_log() -> str:
    fd, name = tempfile.mkstemp(prefix="llama-server-", suffix=".log")
    os.close(fd)
    return name


def _tail(path: Path, n: int = 15) -> str:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(lines[-n:])


class LlamaServer:
    """A `llama-server` process serving `model` (and, with `draft`, speculative decoding).

    Use as a context manager: `with LlamaServer(binary, target_gguf, draft=drafter_gguf) as s:
    s.complete(ids, 64)`. One slot, so requests are served one at a time and the timings are
    the request's own.
    """

    def __init__(
        self,
        binary: str | Path,
        model: str | Path,
        *,
        draft: str | Path | None = None,
        draft_max: int = 3,
        draft_min: int = 0,
        draft_p_min: float = 0.0,
        draft_sampling: str | None = None,
        ctx: int = 2048,
        threads: int = 2,
        poll: int | None = 0,
        startup_timeout: float = 120.0,
        log_path: str | Path | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.binary, self.model = Path(binary), Path(model)
        self.draft = Path(draft) if draft is not None else None
        for name, path in (("model", self.model), ("draft", self.draft)):
            if path is not None and not path.is_file():
                raise ConfigError(f"llamacpp.{name}: {path} is not a file (a .gguf model)")
        if draft_sampling is not None and draft_sampling not in DRAFT_SAMPLING:
            raise ConfigError(
                f"llamacpp.draft_sampling={draft_sampling!r}: choose one of {DRAFT_SAMPLING}"
            )
        if draft_max < 1 or draft_min < 0 or draft_min > draft_max:
            raise ConfigError(
                f"llamacpp.draft_max={draft_max}, draft_min={draft_min}: need 0 <= min <= max, max >= 1"
            )
        if threads < 1 or ctx < 16:
            raise ConfigError(
                f"llamacpp.threads={threads}, ctx={ctx}: need threads >= 1, ctx >= 16"
            )
        self.draft_max, self.draft_min, self.draft_p_min = draft_max, draft_min, draft_p_min
        self.draft_sampling, self.ctx, self.threads = draft_sampling, ctx, threads
        self.startup_timeout, self.extra_args = startup_timeout, tuple(extra_args)
        self.poll = poll
        self._log_given = Path(log_path) if log_path is not None else None
        self.log_path: Path | None = None
        self.port: int | None = None
        self.process: subprocess.Popen[bytes] | None = None

    # ------------------------------------------------------------------ lifecycle

    def command(self, port: int) -> list[str]:
        """The argv the server is started with (tested: every flag exists in this build)."""
        cmd = [str(self.binary), "-m", str(self.model), "-c", str(self.ctx)]
        cmd += ["-t", str(self.threads), "-np", "1", "--no-ui", "--host", HOST]
        cmd += ["--port", str(port)]
        if self.draft is not None:
            cmd += ["-md", str(self.draft), "--spec-type", "draft-simple"]
            cmd += ["--spec-draft-n-max", str(self.draft_max)]
            cmd += ["--spec-draft-n-min", str(self.draft_min)]
            cmd += ["--spec-draft-p-min", repr(float(self.draft_p_min))]
            if self.draft_sampling is not None:
                cmd += ["--spec-draft-sampling", self.draft_sampling]
        if self.poll is not None:
            # llama.cpp's worker threads spin (--poll 50) between graph runs; with a drafter, the
            # draft and target contexts' spinning pools starve each other when they hold every
            # core: speculative decoding slows down many times on a small CPU, plain decoding not
            # (figures: decode/RESULTS.md). None keeps llama.cpp's default.
            cmd += ["--poll", str(self.poll)]
            if self.draft is not None:
                cmd += ["--spec-draft-poll", str(self.poll)]
        return cmd + list(self.extra_args)

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> LlamaServer:
        """Start the process and wait until GET /health answers 200 (the model is loaded).

        The port is free when chosen but another process may take it before the server binds:
        a bind failure is retried on a fresh port, twice.
        """
        if self.process is not None:
            return self
        for attempt in range(3):
            try:
                self._launch()
                return self
            except LlamaServerError:
                lost_port = self.log_path is not None and _BIND_FAILED in _tail(self.log_path)
                if not lost_port or attempt == 2:
                    raise
        return self

    def _launch(self) -> None:
        self.port = free_port()
        if self.log_path is None:
            self.log_path = self._log_given or Path(_temp_log())
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                self.command(self.port),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
            )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        assert self.process is not None and self.log_path is not None
        while True:
            status = self.process.poll()
            if status is not None:
                raise LlamaServerError(
                    f"llama-server exited with status {status} before it was ready; last lines "
                    f"of {self.log_path}:\n{_tail(self.log_path)}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass  # not listening yet, or 503 while the model loads
            if time.monotonic() > deadline:
                raise LlamaServerError(
                    f"llama-server did not answer {self.url}/health within "
                    f"{self.startup_timeout:.0f} s; last lines of {self.log_path}:\n"
                    f"{_tail(self.log_path)}"
                )
            time.sleep(0.1)

    def stop(self, grace: float = 10.0) -> None:
        """Terminate, wait up to `grace` seconds, then kill; the port is free afterwards."""
        proc, self.process = self.process, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def __enter__(self) -> LlamaServer:
        return self.start()

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.stop()
        if exc_type is None and self._log_given is None and self.log_path is not None:
            self.log_path.unlink(missing_ok=True)  # a temp log is kept only after a failure

    # ------------------------------------------------------------------ requests

    def post(self, path: str, payload: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
        """POST JSON, return the decoded answer; an HTTP error carries the server's message."""
        if self.process is None:
            raise LlamaServerError("llama-server is not running (use it as a context manager)")
        data = json.dumps(payload).encode()
        req = urllib.request.Request(
            self.url + path, data=data, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            body = e.read().decode(errors="replace")
            raise LlamaServerError(f"POST {path}: HTTP {e.code}: {body[:500]}") from e
        except (urllib.error.URLError, ConnectionError) as e:
            state = self.process.poll() if self.process else None
            raise LlamaServerError(
                f"POST {path} failed ({e}); server status {state}; last lines of "
                f"{self.log_path}:\n{_tail(self.log_path) if self.log_path else ''}"
            ) from e

    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        """The served model's token ids for `text` (`/tokenize`; BOS only with add_special)."""
        body = self.post("/tokenize", {"content": text, "add_special": bool(add_special)})
        return [int(x) for x in body["tokens"]]

    def complete(
        self,
        prompt_ids: list[int],
        n_predict: int,
        temperature: float = 0.0,
        seed: int = 0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        ignore_eos: bool = False,
    ) -> Completion:
        """Generate up to `n_predict` tokens after `prompt_ids` (posted as ids: no BOS added).

        The defaults make temperature 1 plain sampling from the target's softmax: top_k 0,
        top_p 1 and min_p 0 switch off llama.cpp's own defaults (40, 0.95, 0.05); the
        repetition, DRY, XTC and typical samplers are off by default. Temperature 0 is
        greedy. `cache_prompt` is off so every request processes its prompt afresh.
        """
        if not prompt_ids:
            raise ConfigError("llamacpp.complete: prompt_ids is empty")
        payload = {
            "prompt": [int(x) for x in prompt_ids],
            "n_predict": int(n_predict),
            "temperature": float(temperature),
            "seed": int(seed),
            "top_k": int(top_k),
            "top_p": float(top_p),
            "min_p": float(min_p),
            "n_probs": 0,
            "ignore_eos": bool(ignore_eos),
            "cache_prompt": False,
            "return_tokens": True,
            "stream": False,
        }
        return Completion.from_response(self.post("/completion", payload))


def interleaved(plain, spec, prompts, s: Sampling, max_new: int, seed: int, repeats: int):
    """([plain completions per repeat], [speculative completions per repeat]): each prompt
    asked of the plain server, then of the speculative one, with the same sampling and seed."""
    plains, specs = [], []
    for _ in range(repeats):
        p_pass, s_pass = [], []
        for i, ids in enumerate(prompts):
            kw = dict(temperature=s.temperature, seed=seed + i, top_k=s.top_k, top_p=s.top_p)
            p_pass.append(plain.complete(ids, max_new, **kw))
            s_pass.append(spec.complete(ids, max_new, **kw))
        plains.append(p_pass)
        specs.append(s_pass)
    return plains, specs
