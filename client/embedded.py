"""A private kvstored in a temporary directory, started and stopped by its client."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)


class EmbeddedDaemon:
    def __init__(self, dram: str = "256M", ssd_max: str = "8G", extra_args: list[str] | None = None,
                 root: str | os.PathLike | None = None) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="kvdrive-", dir=root))
        self.address = f"ipc://{self.root / 'kvstored.sock'}"
        self.log_path = self.root / "kvstored.log"
        cmd = [
            sys.executable, "-m", "kvstored", "--ssd", str(self.root / "ssd"), "--dram", dram,
            "--ssd-max", ssd_max, "--listen", self.address, "--parent-pid", str(os.getpid()), *(extra_args or []),
        ]
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
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
        shutil.rmtree(self.root, ignore_errors=True)

    def wait_ready(self, ping, deadline_s: float = 60.0) -> None:
        deadline = time.monotonic() + deadline_s
        while True:
            self.check_alive()
            if ping():
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"embedded kvstored did not answer within {deadline_s:.0f} s:\n{self.log_tail()}")
