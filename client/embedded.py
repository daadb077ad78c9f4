"""A private kvstored in a temporary directory, started and stopped by its client.

``connect(None)`` starts one. Its directory (``kvdrive-XXXXXXXX`` in the temp root:
``$TMPDIR``, else ``/tmp``) is created by the daemon itself (``--ephemeral-dir`` of a
path that does not exist yet), so that the daemon may remove it; it holds the store,
both sockets and the owner file, and goes when the daemon does, whichever way its
client ends. The daemon's log is an unnamed temporary file in the temp root (nothing
of it outlives its holders); :meth:`EmbeddedDaemon.log_tail` reads it. A Unix socket's
path may be at most 107 bytes: where ``$TMPDIR`` is too long for the daemon's sockets,
the temp root is ``/tmp`` (logged); a ``root`` given that is too long is a ValueError.

- the client closes (or is collected, or exits): it stops the daemon, which removes
  the directory;
- the client dies (SIGKILL, a crash): the daemon, started with ``--parent-pid``,
  sees its parent gone, shuts down and removes the directory;
- both die at once (the machine's OOM killer, ``kill -9`` of the process group): the
  directory stays, and the next embedded daemon started in the same temp root by
  the same user removes it. Each directory names its client's and its daemon's
  process in ``owner.json`` (pid and start time, so a reused pid does not count);
  one whose processes are both gone is removed.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvdrive.protocol.address import SESSION_SUFFIX, SOCKET_NAME, UNIX_PATH_MAX

log = logging.getLogger(__name__)

PREFIX = "kvdrive-"
OWNER_FILE = "owner.json"
# How long the daemon may take to create its directory (Python's start and kvstored's checks).
CREATE_DEADLINE_S = 60.0
# The temp root when $TMPDIR is too long for the daemon's sockets.
SHORT_ROOT = Path("/tmp")


class EmbeddedDaemon:
    """One private ``kvstored`` process over a fresh temporary directory (see the module docstring)."""

    def __init__(self, dram: str = "256M", ssd_max: str = "8G", extra_args: list[str] | None = None,
                 root: str | os.PathLike | None = None) -> None:
        temp_root = _temp_root(root)
        sweep_stale(temp_root)
        # A fresh name the daemon creates (it refuses one that appeared meanwhile and is not empty).
        self.root = _fresh_name(temp_root)
        self._owned = False
        self.address = f"ipc://{self.root / 'kvstored.sock'}"
        cmd = [
            sys.executable, "-m", "kvstored", "--ssd", str(self.root / "ssd"), "--dram", dram,
            "--ssd-max", ssd_max, "--listen", self.address, "--parent-pid", str(os.getpid()),
            "--ephemeral-dir", str(self.root), *(extra_args or []),
        ]
        self._log = tempfile.TemporaryFile(dir=temp_root, prefix=PREFIX)
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        self._claim_root()
        log.info("embedded kvstored (pid %d) in %s, DRAM %s", self.proc.pid, self.root, dram)

    def _claim_root(self) -> None:
        """Wait for the daemon to create its directory, then name both processes in it, so that a later
        sweep removes it only once both are gone (until then it has no owner file: sweeps leave it)."""
        deadline = time.monotonic() + CREATE_DEADLINE_S
        while not self.root.is_dir():
            self.check_alive()
            if time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait()
                raise TimeoutError(f"embedded kvstored did not create {self.root} within {CREATE_DEADLINE_S:.0f} s:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.01)
        try:
            _write_owner(self.root, os.getpid(), self.proc.pid)
        except FileNotFoundError:  # the daemon failed to start and removed it
            self.proc.wait(CREATE_DEADLINE_S)
            self.check_alive()
            raise
        self._owned = True

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"embedded kvstored exited with {self.proc.returncode}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20, max_bytes: int = 64 << 10) -> str:
        """The last ``lines`` lines of the daemon's log (read without moving the offset it writes at)."""
        try:
            fd = self._log.fileno()
            size = os.fstat(fd).st_size
            text = os.pread(fd, max_bytes, max(0, size - max_bytes)).decode(errors="replace")
        except (OSError, ValueError):  # ValueError: the log is closed
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("embedded kvstored did not stop in %.0f s; killing it", timeout)
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        # The daemon removes its directory as it stops; not when it was killed.
        if self._owned:
            shutil.rmtree(self.root, ignore_errors=True)

    def wait_ready(self, ping, deadline_s: float = 60.0) -> None:
        deadline = time.monotonic() + deadline_s
        while True:
            self.check_alive()
            if ping():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"embedded kvstored did not answer within {deadline_s:.0f} s:\n{self.log_tail()}")


def sweep_stale(temp_root: Path) -> list[Path]:
    """Remove this user's embedded-daemon directories under ``temp_root`` whose client and daemon
    are both gone; return them. Directories without an owner file are never touched."""
    removed: list[Path] = []
    if _start_time(os.getpid()) is None:  # no /proc: no way to tell a live owner from a dead one
        return removed
    try:
        entries = list(temp_root.glob(PREFIX + "*"))
    except OSError as exc:
        log.info("not sweeping %s for stale embedded daemons: %s", temp_root, exc)
        return removed
    for path in entries:
        owners = _read_owner(path)
        if owners is None or any(_alive(pid, start) for pid, start in owners):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(path)
            log.info("removed %s, left by an embedded kvstored whose client and daemon are both gone", path)
    return removed


def _socket_bytes(temp_root: Path) -> int:
    """The length of the longest socket path a daemon in ``temp_root`` binds: its session socket."""
    return len(os.fsencode(temp_root / f"{PREFIX}{'0' * 8}" / f"{SOCKET_NAME}{SESSION_SUFFIX}"))


def _temp_root(root: str | os.PathLike | None) -> Path:
    """Where the daemon's directory goes: ``root``, else the temp dir, else (the temp dir being
    too long for a socket's path) :data:`SHORT_ROOT`, logged."""
    if root is not None:
        path = Path(root)
        if _socket_bytes(path) > UNIX_PATH_MAX:
            raise ValueError(f"the embedded kvstored's directory in {path} would hold a socket path of "
                             f"{_socket_bytes(path)} bytes; a Unix socket's path may be at most {UNIX_PATH_MAX}: "
                             f"choose a shorter root")
        return path
    path = Path(tempfile.gettempdir())
    if _socket_bytes(path) <= UNIX_PATH_MAX:
        return path
    if not (SHORT_ROOT.is_dir() and os.access(SHORT_ROOT, os.W_OK | os.X_OK)):
        raise ValueError(f"the temp dir {path} is too long for the embedded kvstored's sockets "
                         f"({_socket_bytes(path)} bytes, at most {UNIX_PATH_MAX}), and {SHORT_ROOT} is not writable: "
                         f"set TMPDIR to a shorter directory")
    log.warning("the embedded kvstored goes in %s: the temp dir %s is too long for its sockets (%d bytes, at most %d)",
                SHORT_ROOT, path, _socket_bytes(path), UNIX_PATH_MAX)
    return SHORT_ROOT


def _fresh_name(temp_root: Path) -> Path:
    """A path in ``temp_root`` that names nothing yet."""
    for _ in range(100):
        path = temp_root / f"{PREFIX}{secrets.token_hex(4)}"
        if not os.path.lexists(path):
            return path
    raise FileExistsError(f"no free {PREFIX}XXXXXXXX name in {temp_root} after 100 tries")


def _write_owner(root: Path, client_pid: int, daemon_pid: int | None) -> None:
    owners = {"client": [client_pid, _start_time(client_pid)]}
    if daemon_pid is not None:
        owners["daemon"] = [daemon_pid, _start_time(daemon_pid)]
    tmp = root / f".{OWNER_FILE}.tmp"
    tmp.write_text(json.dumps(owners))
    os.replace(tmp, root / OWNER_FILE)


def _read_owner(path: Path) -> list[tuple[int, int | None]] | None:
    """The (pid, start time) pairs a directory names, or None when it is not one of this user's
    embedded-daemon directories (another user's, a symbolic link, no or unreadable owner file)."""
    try:
        st = os.lstat(path)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return None
        owners = json.loads((path / OWNER_FILE).read_text())
        return [(int(pid), None if start is None else int(start)) for pid, start in owners.values()]
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22); None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == b"Z":  # exited, not yet reaped
        return None
    return int(fields[19])


def _alive(pid: int, start: int | None) -> bool:
    now = _start_time(pid)
    return now is not None and (start is None or now == start)
