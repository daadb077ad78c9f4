"""Every ```python block of README.md runs as written, against a kvstored started with its defaults.

The daemon gets no --listen and a private XDG_RUNTIME_DIR (RUNTIME_DIRECTORY and
KVDRIVE_ADDRESS unset), so the blocks' ``connect()`` reaches it through the default
address, as a reader's would after ``kvstored --ssd DIR --dram SIZE``. Each block runs in
a fresh namespace: the README's blocks stand alone.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from default_daemon import DefaultDaemon
from kvdrive_client import connect

README = Path(__file__).resolve().parents[2] / "README.md"
BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def python_blocks() -> list[tuple[int, str]]:
    """``(line, code)`` of every python block of the README, in order."""
    text = README.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in BLOCK.finditer(text)]


@pytest.fixture(scope="module")
def default_daemon(tmp_path_factory):
    d = DefaultDaemon(tmp_path_factory.mktemp("readme"))
    with pytest.MonkeyPatch.context() as mp:
        d.wait_ready(mp)
        yield d
    d.stop()


def test_the_readme_has_the_blocks_it_should():
    blocks = [code for _, code in python_blocks()]
    assert len(blocks) >= 3
    assert any("connect()" in b for b in blocks) and any("attach(" in b for b in blocks)
    assert any("SparseKV(" in b for b in blocks)


@pytest.mark.parametrize("line, code", [pytest.param(line, code, id=f"line{line}") for line, code in python_blocks()])
def test_readme_block_runs(default_daemon, monkeypatch, line, code):
    for name in ("KVDRIVE_ADDRESS", "RUNTIME_DIRECTORY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(default_daemon.runtime_dir))
    namespace: dict = {"__name__": f"README.md:{line}"}
    exec(compile(code, f"README.md:{line}", "exec"), namespace)  # noqa: S102 - the README's own code
    assert default_daemon.proc.poll() is None, default_daemon.log()


def test_connect_with_no_argument_reaches_a_daemon_started_with_defaults(default_daemon, monkeypatch):
    monkeypatch.delenv("KVDRIVE_ADDRESS", raising=False)
    monkeypatch.delenv("RUNTIME_DIRECTORY", raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(default_daemon.runtime_dir))
    with connect() as store:
        assert store.address == f"ipc://{default_daemon.socket}"
        assert store.server_info["pid"] == default_daemon.proc.pid
