"""The private daemon of connect(None) does not outlive its client."""

import os
import subprocess
import sys
import time

import pytest

CHILD = """
import os
from kvdrive_client import connect
c = connect(None, dram="8M")
print(c.server_info["pid"], flush=True)
os._exit(3)  # dies without close()
"""


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_embedded_daemon_stops_when_its_client_dies():
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120)
    assert out.returncode == 3, out.stderr
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 30
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pid)


UNCLOSED = """
import gc, sys
from kvdrive_client import connect
c = connect(None, dram="8M")
c.cycle = c  # garbage only the cycle collector finds, as a handle left on a model would be
print(c.server_info["pid"], c._daemon.root, flush=True)
if sys.argv[1] == "collect":
    del c
    gc.collect()
"""



@pytest.mark.parametrize("how", ["collect", "exit"])
def test_a_client_nobody_closed_neither_hangs_the_exit_nor_leaves_its_daemon(how):
    out = subprocess.run([sys.executable, "-c", UNCLOSED, how], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    pid, root = out.stdout.split()
    deadline = time.monotonic() + 30
    while alive(int(pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(int(pid))
    assert not os.path.exists(root)  # the embedded daemon's directory went with it
