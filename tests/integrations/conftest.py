"""The serving engines' real packages, for the adapters' contract tests.

vLLM and SGLang do not run on a CPU-only host, and their full dependency trees are
gigabytes; their tier/backend base modules need only a few light packages. Each engine
is installed once per machine with ``pip install --no-deps --target`` (its pinned
version plus exactly those imports) under KVDrive's cache directory, and put on
``sys.path`` for the tests that ask for it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvdrive.kernels.jit import cache_root

# The engine at the version the adapters are built against, then what its base modules import.
ENGINES = {
    "vllm": ["vllm==0.34.0", "msgspec==0.23.0"],
    "sglang": ["sglang==0.5.23", "orjson==3.13.0", "starlette==1.10.0", "ipython==9.18.1", "traitlets==5.16.1"],
}


def install_engine(name: str) -> Path:
    """The directory holding ``name``'s pinned packages, installed there on first use."""
    pins = ENGINES[name]
    digest = hashlib.sha256(" ".join(pins).encode()).hexdigest()[:12]
    target = cache_root() / "test-engines" / f"{name}-{digest}"
    if (target / ".installed").exists():
        return target
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile", "--no-cache-dir",
           "--disable-pip-version-check", "--target", str(tmp), *pins]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"installing {' '.join(pins)} failed:\n{out.stderr[-3000:]}")
    (tmp / ".installed").write_text(" ".join(pins) + "\n")
    try:
        tmp.rename(target)
    except OSError:  # another process installed it first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _on_path(name: str) -> Path:
    path = install_engine(name)
    if str(path) not in sys.path:
        sys.path.append(str(path))  # after the venv: the engine's packages never shadow ours
    return path


@pytest.fixture(scope="session")
def vllm_installed() -> Path:
    return _on_path("vllm")


@pytest.fixture(scope="session")
def sglang_installed() -> Path:
    return _on_path("sglang")
