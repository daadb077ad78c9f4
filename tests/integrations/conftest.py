"""The serving engines' real packages, for the adapters' contract tests: each pinned engine
and the few light packages its base modules import, installed once per machine without
their dependencies (:mod:`kvdrive.tools.engines`) and put on ``sys.path``."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdrive.tools.engines import put_on_path


@pytest.fixture(scope="session")
def vllm_installed() -> Path:
    return put_on_path("vllm")


@pytest.fixture(scope="session")
def sglang_installed() -> Path:
    return put_on_path("sglang")
