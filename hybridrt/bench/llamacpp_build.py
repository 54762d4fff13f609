"""``hybridrt bench llamacpp-build``: llama.cpp at a pinned source, built for the benchmarks.

The source is llama.cpp as vendored in the llama-cpp-python sdist of ``VERSION`` on PyPI
(``pip download``), unpacked from its ``vendor/llama.cpp`` into ``$LLAMACPP_HOME/llama.cpp``
(``LLAMACPP_HOME`` defaulting to ``~/.cache/hybridrt-llamacpp``, where
``hybridrt bench throughput --against-llamacpp`` looks for the binaries), and ``TARGETS`` built
with cmake for this CPU (``-DGGML_NATIVE=ON``) but without ggml's AMX kernels (``NO_AMX``),
static, without tests or server. Each step is skipped when what it makes is already there (a
build configured with other settings is configured and built again). ``plan`` builds every
command and path without running anything."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

VERSION = "0.3.36"  # llama-cpp-python, whose sdist vendors the llama.cpp source built here
PACKAGE = "llama-cpp-python"
TARGETS = ("llama-bench", "llama-batched-bench", "llama-quantize", "llama-perplexity")
INSTALL_HINT = "apt-get install cmake build-essential"
# ggml's AMX matrix products (compiled in by -march=native where the CPU has AMX) crash
# llama-bench on Qwen3.5 GGUFs here (SIGSEGV in ggml_backend_amx_mul_mat, an Intel Xeon with AMX);
# explicit -mno-* flags win over -march=native. hybridrt has no AMX path either.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


class LlamaCppBuildError(RuntimeError):
    """A tool is missing or a step failed; the message is one line saying what to do."""


def default_home() -> Path:
    """``$LLAMACPP_HOME``, else ``~/.cache/hybridrt-llamacpp``."""
    return Path(os.environ.get("LLAMACPP_HOME") or Path.home() / ".cache" / "hybridrt-llamacpp")


@dataclass(frozen=True)
class Plan:
    """Every path and command of a build (``plan``)."""

    home: Path
    sdist_dir: Path  # where pip puts the sdist
    sdist: Path  # the sdist file pip writes there
    member: str  # the folder inside the sdist that is llama.cpp
    source: Path  # the unpacked llama.cpp
    build: Path
    bin: Path
    download: list[str]
    configure: list[str]
    compile: list[str]


def plan(home: str | Path | None = None, version: str = VERSION,
         python: str = sys.executable, jobs: int | None = None) -> Plan:
    """The paths and commands of building llama.cpp's ``TARGETS`` into ``home``."""
    home = Path(home) if home is not None else default_home()
    sdist_dir = home / "sdist"
    stem = f"{PACKAGE.replace('-', '_')}-{version}"
    source = home / "llama.cpp"
    build = source / "build"
    return Plan(
        home=home, sdist_dir=sdist_dir, sdist=sdist_dir / f"{stem}.tar.gz",
        member=f"{stem}/vendor/llama.cpp", source=source, build=build, bin=build / "bin",
        download=[python, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                  "--dest", str(sdist_dir), f"{PACKAGE}=={version}"],
        configure=["cmake", "-S", str(source), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                   "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                   "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_CURL=OFF",
                   f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"],
        compile=["cmake", "--build", str(build), "--config", "Release",
                 "-j", str(jobs or os.cpu_count() or 1), "--target", *TARGETS])


def configured(p: Plan) -> bool:
    """Whether ``p.build`` was configured with every ``-D`` setting of ``p.configure`` (its
    CMakeCache.txt): a build made with other settings is configured and built again."""
    try:
        cache = (p.build / "CMakeCache.txt").read_text()
    except OSError:
        return False
    values = dict(re.findall(r"^(\w+):\w+=(.*)$", cache, re.M))
    want = dict(a[2:].split("=", 1) for a in p.configure if a.startswith("-D"))
    return all(values.get(k) == v for k, v in want.items())


def built(p: Plan) -> bool:
    """Whether every target is already in ``p.bin``, built with ``p.configure``'s settings."""
    return configured(p) and all(os.access(p.bin / t, os.X_OK) for t in TARGETS)


def unpack(p: Plan) -> None:
    """llama.cpp's folder of the sdist into ``p.source``."""
    prefix = p.member + "/"
    with tarfile.open(p.sdist) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        if not members:
            raise LlamaCppBuildError(f"{p.sdist} holds no {p.member}")
        for m in members:
            m.name = m.name[len(prefix):]
        p.source.mkdir(parents=True, exist_ok=True)
        tar.extractall(p.source, members=members, filter="data")


def check_tools() -> None:
    """cmake and a C++ compiler on PATH (``LlamaCppBuildError`` naming the fix otherwise)."""
    if shutil.which("cmake") is None:
        raise LlamaCppBuildError(f"cmake not found: {INSTALL_HINT}")
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        raise LlamaCppBuildError(f"no C++ compiler found: {INSTALL_HINT}")


def _run(step: str, cmd: list[str]) -> None:
    print(f"{step}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    if subprocess.run(cmd).returncode != 0:  # its output (cmake's [ n%] progress) shown as is
        raise LlamaCppBuildError(f"{step} failed: {' '.join(cmd)}")


def build(p: Plan) -> Path:
    """Download, unpack and build what is not there yet -> the folder of the binaries."""
    if built(p):
        print(f"llama.cpp binaries already in {p.bin}", file=sys.stderr)
        return p.bin
    check_tools()
    if not p.sdist.is_file():
        _run(f"[1/4] downloading {PACKAGE} {p.sdist.name}", p.download)
    if not (p.source / "CMakeLists.txt").is_file():
        print(f"[2/4] unpacking llama.cpp into {p.source}", file=sys.stderr, flush=True)
        unpack(p)
    _run("[3/4] configuring", p.configure)
    _run("[4/4] building " + ", ".join(TARGETS), p.compile)
    if not built(p):
        raise LlamaCppBuildError(f"the build left no {', '.join(TARGETS)} in {p.bin}")
    return p.bin
