"""Builds the kernels (*.c, simd.h here) into one shared library on first use, cached per
source, compiler and flags.

A plain C library called through ctypes, not a torch C++ extension: it compiles in under a
second with no torch headers, pybind11 or ninja, and a ctypes call costs a few microseconds,
small beside the kernels' milliseconds. The library is rebuilt only when the source, the
compiler or the flags change (the cache key), written under a temporary name and renamed, so
concurrent workers never load a half-written file.

``CLEAVE_NATIVE_KERNELS=0`` turns the kernels off (the stock torch path runs instead): for A/B
runs and as an escape hatch.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cleave.runtime.models.loader import default_cache_dir

HERE = Path(__file__).parent
SOURCES = tuple(sorted(HERE.glob("*.c")))
HEADERS = tuple(sorted(HERE.glob("*.h")))
FLAGS = ("-O3", "-shared", "-fPIC", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16")
LIBS = ("-lm",)  # sqrtf, expf: linked, not borrowed from whatever the process loaded
CPU_FLAGS = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16"})
ENV_SWITCH = "CLEAVE_NATIVE_KERNELS"


@dataclass(frozen=True)
class Built:
    """Where the library is, or why there is none (``path`` None)."""

    path: Path | None
    reason: str


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The CPU's feature flags (Linux); empty where they cannot be read."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def cache_dir() -> Path:
    """``<Cleave cache>/native``: CLEAVE_CACHE_DIR where set (pods: their writable /cache
    volume, as the root filesystem is read-only), else ~/.cache/cleave."""
    return default_cache_dir() / "native"


def unavailable(flags: frozenset[str], compiler: str | None, switch: str | None) -> str | None:
    """Why the kernels cannot be used here, or None: a pure decision, tested on its own."""
    if switch is not None and switch.strip().lower() in {"0", "off", "false", "no"}:
        return f"{ENV_SWITCH}={switch}"
    missing = sorted(CPU_FLAGS - flags)
    if missing:
        return "the CPU lacks " + ", ".join(missing)
    if compiler is None:
        return "no C compiler (cc or $CC) on PATH"
    return None


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def build(directory: Path | None = None) -> Built:
    """The library's path, compiling it if this source/compiler/flags has not been built; any
    failure (no cache directory, a compiler error or hang) is a reason, never an exception."""
    compiler = _compiler()
    reason = unavailable(cpu_flags(), compiler, os.environ.get(ENV_SWITCH))
    if reason is not None or compiler is None:
        return Built(None, reason or "no compiler")
    try:
        return _compile(compiler, directory or cache_dir())
    except (OSError, subprocess.SubprocessError) as e:
        return Built(None, f"could not build the kernels: {e}")


def _compile(compiler: str, directory: Path) -> Built:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             check=False, timeout=60).stdout
    texts = [path.read_text() for path in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join([*texts, version, *FLAGS, *LIBS]).encode())
    target = directory / f"kernels-{key.hexdigest()[:16]}.so"
    if target.exists():
        return Built(target, "cached")
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        out = Path(tmp) / target.name
        done = subprocess.run([compiler, *FLAGS, *map(str, SOURCES), *LIBS, "-o", str(out)],
                              capture_output=True, text=True, check=False, timeout=300)
        if done.returncode != 0:
            return Built(None, f"{compiler} failed: {done.stderr.strip()[-500:]}")
        os.replace(out, target)
    return Built(target, "built")
