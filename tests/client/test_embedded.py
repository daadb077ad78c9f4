"""The private daemon of connect(None) does not outlive its client."""

import os
import subprocess
import sys
import time

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
