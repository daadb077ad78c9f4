"""A kvstored started as a user would start it: no --listen, a private runtime directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvdrive_client import StoreUnavailableError, connect

# The variables that choose the default address; the test sets its own runtime directory.
ADDRESS_VARS = ("KVDRIVE_ADDRESS", "RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR")


def default_env(runtime_dir: Path) -> dict[str, str]:
    """This process's environment with ``runtime_dir`` as the only say in the default address."""
    env = {k: v for k, v in os.environ.items() if k not in ADDRESS_VARS}
    env["XDG_RUNTIME_DIR"] = str(runtime_dir)
    return env


class DefaultDaemon:
    """``kvstored --ssd ROOT/ssd --dram DRAM`` with XDG_RUNTIME_DIR=ROOT/run and nothing else."""

    def __init__(self, root: Path, dram: str = "64M") -> None:
        self.runtime_dir = root / "run"
        self.runtime_dir.mkdir(mode=0o700)
        self.env = default_env(self.runtime_dir)
        self.socket = self.runtime_dir / "kvstored.sock"
        self.log_path = root / "kvstored.log"
        cmd = [sys.executable, "-m", "kvstored", "--ssd", str(root / "ssd"), "--dram", dram]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)

    def wait_ready(self, monkeypatch, timeout: float = 60.0) -> None:
        """Wait until ``connect()`` in this process (with the daemon's environment) reaches it."""
        for name in ADDRESS_VARS:
            monkeypatch.delenv(name, raising=False)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(self.runtime_dir))
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvstored exited with {self.proc.returncode}:\n{self.log()}")
            try:
                connect(timeout=5).close()
                return
            except StoreUnavailableError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"kvstored did not answer within {timeout:g} s:\n{self.log()}") from None
                time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
