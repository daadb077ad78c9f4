"""``--ephemeral-dir``: the daemon removes only what it made, and refuses a directory it could harm.

The refusals run ``python -m kvstored`` with a ``--dram`` no host has: the ephemeral
directory is checked first, and were it not, the daemon would still stop at the
``--dram`` check before it ever started serving (so it could never remove anything).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvdrive_client import Geometry, StoreClient

GEOM = Geometry(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16", page_size=16)
NO_HOST_HAS = "64T"
FIX = "choose a directory of its own that does not exist yet"


def below(ephemeral: str, tmp_path: Path) -> str:
    """``tmp_path/ssd``, spelt as a path below ``ephemeral`` (which --ssd must be)."""
    ups = [".."] * (len(Path(ephemeral).parts) - 1)
    return str(Path(ephemeral, *ups, *tmp_path.parts[1:], "ssd"))


def refused(tmp_path: Path, ephemeral: str, *extra: str) -> subprocess.CompletedProcess:
    ssd = below(ephemeral or "/", tmp_path)
    cmd = [sys.executable, "-m", "kvstored", "--ssd", ssd, "--dram", NO_HOST_HAS,
           "--listen", f"ipc://{tmp_path / 'kvstored.sock'}", *extra]
    if ephemeral:
        cmd += ["--ephemeral-dir", ephemeral]
    # Killed (not stopped) should it ever run that long: a killed daemon removes nothing.
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


def assert_refused(out: subprocess.CompletedProcess, ephemeral: str, reason: str, tmp_path: Path) -> None:
    lines = [line for line in out.stderr.splitlines() if "--ephemeral-dir" in line]
    assert out.returncode == 1, out.stderr
    assert len(lines) == 1 and f"--ephemeral-dir {ephemeral}" in lines[0], out.stderr
    assert re.search(reason, lines[0]) and FIX in lines[0], lines[0]
    assert not (tmp_path / "ssd").exists()  # refused before anything was made


def a_mount_point() -> str | None:
    """A mount point below the top level of the filesystem, if this host has one."""
    with open("/proc/self/mounts") as f:
        points = [line.split()[1] for line in f]
    return next((p for p in points if p.count("/") >= 2 and "\\" not in p and os.path.ismount(p)), None)


@pytest.mark.parametrize("ephemeral, reason", [
    ("/", "is the root of the filesystem"),
    ("/tmp", r"is the temporary files' directory|is a top-level directory"),
    ("/home", "top-level directory"),
    ("/var/tmp", "is a system directory"),
    (os.path.expanduser("~"), "home directory"),
])
def test_a_dangerous_directory_is_refused_before_anything_is_made(tmp_path, ephemeral, reason):
    assert_refused(refused(tmp_path, ephemeral), ephemeral, reason, tmp_path)


def test_a_mount_point_is_refused(tmp_path):
    point = a_mount_point()
    if point is None:
        pytest.skip("no mount point below the top level on this host")
    out = refused(tmp_path, point)
    assert out.returncode == 1 and f"--ephemeral-dir {point}" in out.stderr, out.stderr
    assert not (tmp_path / "ssd").exists()


def test_a_dangerous_directory_from_the_config_file_is_refused(tmp_path):
    config = tmp_path / "kvstored.toml"
    config.write_text('ephemeral-dir = "/"\n')
    assert_refused(refused(tmp_path, "", "--config", str(config)), "/", "is the root of the filesystem", tmp_path)


def test_a_directory_holding_files_it_did_not_make_is_refused_and_kept(tmp_path):
    keep = tmp_path / "keep.txt"
    keep.write_text("not the daemon's")
    out = refused(tmp_path, str(tmp_path))
    assert_refused(out, str(tmp_path), r"is not empty \(it holds keep.txt", tmp_path)
    assert keep.read_text() == "not the daemon's"


def test_a_symbolic_link_is_refused(tmp_path):
    target = tmp_path / "target"
    target.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(target)
    out = subprocess.run([sys.executable, "-m", "kvstored", "--ssd", str(link / "ssd"), "--dram", NO_HOST_HAS,
                          "--listen", f"ipc://{tmp_path / 'kvstored.sock'}", "--ephemeral-dir", str(link)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 1 and "is a symbolic link" in out.stderr, out.stderr
    assert target.exists() and not (target / "ssd").exists()


# ---------------------------------------------------------------- a daemon that runs


class Ephemeral:
    """A kvstored whose --ssd and socket are in ``root``, its --ephemeral-dir; its log outside it."""

    def __init__(self, root: Path, log: Path) -> None:
        self.root, self.address = root, f"ipc://{root / 'kvstored.sock'}"
        cmd = [sys.executable, "-m", "kvstored", "--ssd", str(root / "ssd"), "--dram", "8M", "--ssd-max", "64M",
               "--listen", self.address, "--ephemeral-dir", str(root)]
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
        self.log = log

    def wait_ready(self, timeout: float = 60.0) -> StoreClient:
        client = StoreClient(self.address, timeout=30)
        deadline = time.monotonic() + timeout
        while not client.ping(timeout=0.5):
            assert self.proc.poll() is None, self.log.read_text()
            assert time.monotonic() < deadline, self.log.read_text()
        return client

    def store_something(self) -> None:
        client = self.wait_ready()
        try:
            seq = client.create("t", "s", GEOM)
            client.put(seq, [0], range(4), np.ones((1, 1, 4, GEOM.block_bytes), np.uint8))
        finally:
            client.close()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def test_a_directory_it_created_goes_when_it_stops(tmp_path):
    root = tmp_path / "eph"
    daemon = Ephemeral(root, tmp_path / "kvstored.log")
    try:
        daemon.store_something()
        assert (root / "ssd").is_dir() and os.stat(root).st_mode & 0o777 == 0o700
        assert daemon.stop() == 0, daemon.log.read_text()
    finally:
        daemon.kill()
    assert not root.exists()


def test_an_existing_directory_keeps_what_the_daemon_did_not_make(tmp_path):
    root = tmp_path / "eph"
    root.mkdir(mode=0o700)
    daemon = Ephemeral(root, tmp_path / "kvstored.log")
    try:
        daemon.store_something()
        (root / "notes.txt").write_text("someone else's")
        (root / "theirs").mkdir()
        (root / "theirs" / "data").write_bytes(b"x")
        assert daemon.stop() == 0, daemon.log.read_text()
    finally:
        daemon.kill()
    assert sorted(p.name for p in root.iterdir()) == ["notes.txt", "theirs"]  # its store and sockets went
    assert (root / "notes.txt").read_text() == "someone else's" and (root / "theirs" / "data").read_bytes() == b"x"
