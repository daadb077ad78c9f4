"""The shipped unit file passes systemd's own checks, and its config file is one the daemon takes."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvstored.cli import build_parser, config_from_args, parse_args

SYSTEMD = Path(__file__).resolve().parents[2] / "systemd"
UNIT = SYSTEMD / "kvstored.service"
EXAMPLE_CONFIG = SYSTEMD / "kvstored.toml"
INSTALLED_CONFIG = "/etc/kvdrive/kvstored.toml"
ANALYZE = shutil.which("systemd-analyze")

needs_analyze = pytest.mark.skipif(ANALYZE is None, reason="systemd-analyze is not installed on this machine")


def exec_start(unit_text: str) -> str:
    lines = [l for l in unit_text.splitlines() if l.startswith("ExecStart=")]
    assert len(lines) == 1, "the unit should have exactly one ExecStart"
    return lines[0]


def unit_setting(name: str) -> str:
    match = re.search(rf"^{name}=(.*)$", UNIT.read_text(), re.MULTILINE)
    assert match, f"the unit has no {name}="
    return match.group(1).strip()


def verify(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([ANALYZE, "verify", "--man=no", str(path)], capture_output=True, text=True, timeout=60)


@needs_analyze
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


@needs_analyze
def test_unit_with_an_existing_binary_verifies_cleanly(tmp_path):
    text = UNIT.read_text()
    line = exec_start(text)
    args = line[len("ExecStart="):].split()
    assert args[1:] == ["--config", INSTALLED_CONFIG], "the daemon should read its options from the installed file"
    copy = tmp_path / UNIT.name
    copy.write_text(text.replace(line, "ExecStart=" + " ".join([shutil.which("true") or "/bin/true", *args[1:]])))
    result = verify(copy)
    complaints = [l for l in (result.stdout + result.stderr).splitlines() if l.strip()]
    assert result.returncode == 0 and not complaints, complaints


def test_example_config_loads_and_matches_the_unit():
    """systemd/kvstored.toml (installed as /etc/kvdrive/kvstored.toml) through the daemon's own loader."""
    parser = build_parser()
    cfg = config_from_args(parse_args(parser, ["--config", str(EXAMPLE_CONFIG)]))
    assert cfg.ssd_dir == Path("/var/lib") / unit_setting("StateDirectory"), "the SSD tier is the unit's StateDirectory"
    assert cfg.ssd_dir == Path(unit_setting("RequiresMountsFor"))
    socket_dir = Path("/run") / unit_setting("RuntimeDirectory")
    assert cfg.bind_address == f"ipc://{socket_dir}/kvstored.sock"
    assert cfg.session_socket_path.parent == socket_dir
    for path in (cfg.ssd_dir, socket_dir):
        assert str(path) in unit_setting("ReadWritePaths").split(), f"the unit must let the daemon write {path}"
    assert cfg.socket_mode == 0o660
    assert cfg.dram_bytes == 96 << 30
    assert cfg.metrics_endpoint == ("127.0.0.1", 9464)
    assert "AF_INET" in unit_setting("RestrictAddressFamilies").split(), "the metrics endpoint needs AF_INET"
    assert unit_setting("Environment") == f"KVDRIVE_CACHE=/var/cache/{unit_setting('CacheDirectory')}", \
        "kvstored keeps its compiled functions where the unit lets it write"
