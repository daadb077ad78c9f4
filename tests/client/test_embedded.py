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


LONG_TMPDIR = """
from kvdrive_client import connect
c = connect(None, dram="8M")
print(c._daemon.root, c.server_info["pid"], flush=True)
c.close()
"""


def long_dir(base, size):
    """A directory under ``base`` whose path is ``size`` bytes long."""
    path = base / ("t" * (size - len(os.fsencode(base)) - 1))
    path.mkdir()
    assert len(os.fsencode(path)) == size
    return path


def test_a_temp_dir_too_long_for_a_socket_puts_the_daemon_in_tmp_and_says_so(tmp_path):
    """With $TMPDIR 80 bytes long the session socket's path would be 119 bytes: the daemon goes in
    /tmp, the log says why, and its directory goes with it."""
    env = {**os.environ, "TMPDIR": str(long_dir(tmp_path, 80))}
    out = subprocess.run([sys.executable, "-c", LONG_TMPDIR], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    root, pid = out.stdout.split()
    assert os.path.dirname(root) == "/tmp" and os.path.basename(root).startswith("kvdrive-")
    assert f"the embedded kvstored goes in /tmp: the temp dir {env['TMPDIR']} is too long for its sockets " \
           "(119 bytes, at most 107)" in out.stderr
    assert not os.path.exists(root) and not alive(int(pid))


def test_a_root_too_long_for_a_socket_is_refused_before_a_daemon_starts(tmp_path):
    from kvdrive_client.embedded import EmbeddedDaemon

    root = long_dir(tmp_path, 80)
    with pytest.raises(ValueError, match=r"a socket path of 119 bytes; a Unix socket's path may be at most 107"):
        EmbeddedDaemon(dram="8M", root=root)
    assert list(root.iterdir()) == []  # nothing started there: no log, no directory
