"""A private kvstored in a temporary directory, started and stopped by its client.

``connect(None)`` starts one. Its directory (``kvdrive-XXXXXXXX`` in the temp root:
``$TMPDIR``, else ``/tmp``) holds the store, both sockets and the daemon's log, and
goes when the daemon does, whichever way its client ends:

- the client closes (or is collected, or exits): it stops the daemon and removes
  the directory;
- the client dies (SIGKILL, a crash): the daemon, started with ``--parent-pid``,
  sees its parent gone, shuts down and, started with ``--ephemeral-dir``, removes
  the directory itself;
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
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "kvdrive-"
OWNER_FILE = "owner.json"


class EmbeddedDaemon:
    """One private ``kvstored`` process over a fresh temporary directory (see the module docstring)."""

    def __init__(self, dram: str = "256M", ssd_max: str = "8G", extra_args: list[str] | None = None,
                 root: str | os.PathLike | None = None) -> None:
        temp_root = Path(root if root is not None else tempfile.gettempdir())
        sweep_stale(temp_root)
        self.root = Path(tempfile.mkdtemp(prefix=PREFIX, dir=temp_root))
        # Written before the daemon exists: a sweep meanwhile sees a live client and leaves it.
        _write_owner(self.root, os.getpid(), None)
        self.address = f"ipc://{self.root / 'kvstored.sock'}"
        self.log_path = self.root / "kvstored.log"
        cmd = [
            sys.executable, "-m", "kvstored", "--ssd", str(self.root / "ssd"), "--dram", dram,
            "--ssd-max", ssd_max, "--listen", self.address, "--parent-pid", str(os.getpid()),
            "--ephemeral-dir", str(self.root), *(extra_args or []),
        ]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        _write_owner(self.root, os.getpid(), self.proc.pid)
        log.info("embedded kvstored (pid %d) in %s, DRAM %s", self.proc.pid, self.root, dram)

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"embedded kvstored exited with {self.proc.returncode}:\n{self.log_tail()}")

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

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
        # The daemon removes its directory as it stops; not when it was killed or failed to start.
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
