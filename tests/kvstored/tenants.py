"""Two tenants of one kvstored: this test process, and a forked child that has become ``nobody``.

The kernel reports each connection's uid to the daemon, so the child is another user to it.
Dropping to another uid needs root: tests that use it are marked :data:`needs_root`.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Iterator

import pytest

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another OS user needs root")


def other_user() -> pwd.struct_passwd:
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("this host has no 'nobody' user to act as the other tenant")


def as_other_user(fn: Callable[[], dict]) -> dict:
    """Run ``fn`` in a child process that has become ``nobody``; return what it returned."""
    user = other_user()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(user.pw_gid)
            os.setuid(user.pw_uid)
            try:
                out = {"ok": True, **fn()}
            except BaseException:  # reported to the parent, which fails the test
                out = {"ok": False, "error": traceback.format_exc()}
            os.write(w, json.dumps(out).encode() + b"\n")
        finally:
            os._exit(0)
    os.close(w)
    # Up to the newline only: a process the child started may hold the pipe open longer.
    chunks = []
    while (chunk := os.read(r, 1 << 16)) and not chunk.endswith(b"\n"):
        chunks.append(chunk)
    chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    result = json.loads(b"".join(chunks) or b'{"ok": false, "error": "the child wrote nothing"}')
    assert result.pop("ok"), result.get("error")
    return result


def shared_dir() -> Iterator[Path]:
    """A daemon directory every user can reach (pytest's own temp dirs are owner-only)."""
    root = Path(tempfile.mkdtemp(prefix="kvdrive-tenants-", dir="/tmp"))
    root.chmod(0o755)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def verify_clean(ssd: Path) -> None:
    """The stopped store's catalog and data file agree (kvstore-inspect --verify)."""
    result = subprocess.run([sys.executable, "-m", "kvdrive.tools.inspect", str(ssd), "--verify"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def settled(figures: Callable[[], object], d, step: float = 1.0, timeout: float = 60.0):
    """``figures()`` once they have stayed the same for ``step`` seconds."""
    deadline = time.monotonic() + timeout
    last = None
    while (now := figures()) != last:
        assert d.alive(), f"kvstored died (exit {d.proc.returncode}):\n{d.log()[-2000:]}"
        assert time.monotonic() < deadline, f"still changing after {timeout} s: {now}"
        last = now
        time.sleep(step)
    return now
