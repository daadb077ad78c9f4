"""The shipped unit file passes systemd's own checks."""

import shutil
import subprocess
from pathlib import Path

import pytest

UNIT = Path(__file__).resolve().parents[2] / "systemd" / "kvstored.service"
ANALYZE = shutil.which("systemd-analyze")

pytestmark = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed on this machine")


def exec_start(unit_text: str) -> str:
    lines = [l for l in unit_text.splitlines() if l.startswith("ExecStart=")]
    assert len(lines) == 1, "the unit should have exactly one ExecStart"
    return lines[0]


def verify(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([ANALYZE, "verify", "--man=no", str(path)], capture_output=True, text=True, timeout=60)


def test_unit_verifies_except_for_the_absent_binary():
    binary = exec_start(UNIT.read_text())[len("ExecStart="):].split()[0]
    result = verify(UNIT)
    complaints = [l for l in (result.stdout + result.stderr).splitlines() if l.strip()]
    if Path(binary).exists():
        assert result.returncode == 0 and not complaints, complaints
        return
    allowed = f"Command {binary} is not executable"
    unexpected = [l for l in complaints if allowed not in l]
    assert not unexpected, f"systemd-analyze verify complained: {unexpected}"


def test_unit_with_an_existing_binary_verifies_cleanly(tmp_path):
    text = UNIT.read_text()
    line = exec_start(text)
    args = line[len("ExecStart="):].split()
    assert args[1:3] == ["--ssd", "/var/lib/kvstored"], "the daemon should serve its StateDirectory"
    copy = tmp_path / UNIT.name
    copy.write_text(text.replace(line, "ExecStart=" + " ".join([shutil.which("true") or "/bin/true", *args[1:]])))
    result = verify(copy)
    complaints = [l for l in (result.stdout + result.stderr).splitlines() if l.strip()]
    assert result.returncode == 0 and not complaints, complaints
