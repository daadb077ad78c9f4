"""A private daemon's directory goes with it, however its client ends."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvdrive_client.embedded import OWNER_FILE, EmbeddedDaemon, sweep_stale

# A client that stores something, says where, and waits to be killed.
CHILD = """
import sys, time
import numpy as np
from kvdrive_client import Geometry, connect
store = connect(None, dram="8M", ssd_max="64M")
geo = Geometry(1, 1, 64, "float16", 16)
seq = store.create("t", "s", geo)
store.put(seq, [0], range(4), np.ones((1, 1, 4, geo.block_bytes), np.uint8))
print(store.server_info["pid"], store._daemon.root, flush=True)
time.sleep(600)
"""


def gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_for(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def start_child(tmp_path: Path) -> tuple[subprocess.Popen, int, Path]:
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env)
    line = child.stdout.readline()
    assert line, child.stderr.read()
    pid, root = line.split()
    return child, int(pid), Path(root)


def test_the_daemon_of_a_killed_client_removes_its_directory(tmp_path):
    child, daemon_pid, root = start_child(tmp_path)
    assert root.parent == tmp_path and (root / "ssd").is_dir() and (root / OWNER_FILE).is_file()
    child.kill()
    child.wait()
    assert wait_for(lambda: gone(daemon_pid)), f"kvstored {daemon_pid} outlived its client"
    assert wait_for(lambda: not root.exists()), f"{root} is still there: {os.listdir(root)}"


def test_a_new_embedded_daemon_removes_what_killed_ones_left(tmp_path):
    child, daemon_pid, root = start_child(tmp_path)
    os.kill(daemon_pid, signal.SIGKILL)  # the daemon first: nothing is left to clean up after the client
    assert wait_for(lambda: gone(daemon_pid))
    child.kill()
    child.wait()
    assert root.exists()
    # Not this user's embedded directories: no owner file, or an owner still alive.
    unmarked = tmp_path / "kvdrive-unmarked"
    unmarked.mkdir()
    alive = tmp_path / "kvdrive-alive"
    alive.mkdir()
    (alive / OWNER_FILE).write_text(json.dumps({"client": [os.getpid(), None]}))
    daemon = EmbeddedDaemon(dram="8M", ssd_max="64M", root=tmp_path)
    try:
        assert not root.exists()
        assert unmarked.exists() and alive.exists() and daemon.root.exists()
    finally:
        daemon.stop()
    assert not daemon.root.exists()


def test_a_pid_reused_by_another_process_does_not_keep_a_directory(tmp_path):
    stale = tmp_path / "kvdrive-reused"
    stale.mkdir()
    # Our own pid, but a start time it never had: the owner it names is gone.
    (stale / OWNER_FILE).write_text(json.dumps({"client": [os.getpid(), 1], "daemon": [os.getpid(), 1]}))
    assert sweep_stale(tmp_path) == [stale] and not stale.exists()
