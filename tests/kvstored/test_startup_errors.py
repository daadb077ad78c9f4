"""Start-up mistakes a person can fix: one line naming the option and the fix, a non-zero exit,
no traceback, and before the DRAM tier is pre-faulted (the store never opens)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvstored.cli import build_parser
from kvstored.preflight import meminfo

# Generous for a loaded 2-core host: each of these takes a fraction of a second on an idle one.
QUICK_S = 10.0


def kvstored(*args: str) -> tuple[int, str, float]:
    t0 = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "kvstored", *args], capture_output=True, text=True, timeout=120)
    return result.returncode, result.stdout + result.stderr, time.monotonic() - t0


def refused(tmp_path: Path, *args: str, dram: str = "64M", ssd: Path | None = None) -> str:
    """Run a kvstored that must refuse to start; its one line of output."""
    rc, out, took = kvstored("--ssd", str(ssd or tmp_path / "ssd"), "--dram", dram, *args)
    assert rc == 1, out
    assert "Traceback" not in out and "pre-faulted" not in out, out  # the store never opened
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    assert took < QUICK_S, f"took {took:.1f} s"
    return lines[0]


def listening_socket() -> socket.socket:
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


def test_another_daemon_on_the_socket(daemon, tmp_path):
    line = refused(tmp_path, "--listen", daemon.address)
    assert line.endswith(f"cannot start: another kvstored is serving {daemon.address}; stop it or choose another --listen")
    assert daemon.client().ping()  # the first daemon is untouched


def test_another_program_on_the_tcp_port(tmp_path):
    with listening_socket() as s:
        port = s.getsockname()[1]
        line = refused(tmp_path, "--listen", f"tcp://127.0.0.1:{port}")
    assert f"tcp://127.0.0.1:{port} is in use by another program; choose another --listen port" in line


def test_dram_larger_than_the_host(tmp_path):
    total, _ = meminfo()
    too_much = f"{(total >> 30) * 4 + 64}G"
    line = refused(tmp_path, dram=too_much)
    assert re.search(rf"--dram {too_much} is more than this host's [\d.]+ GiB of memory \([\d.]+ GiB available\); "
                     r"choose a smaller --dram$", line), line


def test_ssd_that_cannot_be_created(tmp_path):
    # Root may write anywhere, but not make a directory under a regular file.
    (tmp_path / "file").write_text("not a directory")
    bad = tmp_path / "file" / "sub"
    line = refused(tmp_path, ssd=bad)
    assert line.endswith(f"--ssd {bad}: cannot create the directory (Not a directory); "
                         "choose a directory kvstored may create, read and write")


def test_metrics_port_in_use(tmp_path):
    with listening_socket() as s:
        port = s.getsockname()[1]
        line = refused(tmp_path, "--listen", f"ipc://{tmp_path / 'k.sock'}", "--metrics", f"127.0.0.1:{port}")
    assert f"--metrics 127.0.0.1:{port}: port {port} is already in use" in line
    assert line.endswith("choose another --metrics port")


def test_a_malformed_metrics_address_is_a_usage_error(tmp_path):
    rc, out, _ = kvstored("--ssd", str(tmp_path / "ssd"), "--dram", "1M", "--metrics", "9464")
    assert rc == 2 and out.strip() == "kvstored: --metrics '9464' is not HOST:PORT with a port in 1..65535 (e.g. 127.0.0.1:9464)"


def test_a_write_behind_backlog_under_1m_is_a_usage_error(tmp_path):
    rc, out, _ = kvstored("--ssd", str(tmp_path / "ssd"), "--dram", "1M", "--sync", "write-behind",
                          "--write-behind-backlog", "512K")
    assert rc == 2 and out.strip() == "kvstored: --write-behind-backlog must be at least 1M, got 524288"


@pytest.mark.parametrize("listen_bytes", [108, 108 - len(".session")], ids=["listen", "session socket"])
def test_a_socket_path_too_long_for_a_unix_socket_is_a_usage_error(tmp_path, listen_bytes):
    # One byte over sockaddr_un's limit: --listen's path, then the session socket kept beside it.
    sock = tmp_path / ("d" * (listen_bytes - len(str(tmp_path)) - len("/") - len("/k.sock"))) / "k.sock"
    assert len(str(sock)) == listen_bytes
    rc, out, _ = kvstored("--ssd", str(tmp_path / "ssd"), "--dram", "1M", "--listen", f"ipc://{sock}")
    what, path = ("--listen", sock) if listen_bytes == 108 else ("the session socket", f"{sock}.session")
    assert rc == 2, out
    assert out.strip().startswith(f"kvstored: {what} {path} is 108 bytes long, and a Unix socket's path may be "
                                  "at most 107"), out
    assert not (tmp_path / "ssd").exists()


@pytest.mark.alone
def test_help_states_each_default_once_and_is_quick():
    rc, out, took = kvstored("--help")
    assert rc == 0
    assert took < 3.0, f"kvstored --help took {took:.2f} s"
    text = re.sub(r"\s+", " ", out)
    stated = 0
    for action in build_parser()._actions:  # noqa: SLF001 - every option, help included
        if "-h" in action.option_strings or "--version" in action.option_strings:
            continue  # they print and exit: nothing to default
        assert action.help, f"{action.option_strings[0]} has no help text"
        if action.dest in ("ssd", "dram"):
            assert "(default" not in action.help and "required" in action.help
        else:
            assert action.help.count("(default:") == 1, f"{action.option_strings[0]}: {action.help!r}"
            stated += 1
    assert text.count("(default:") == stated, "the formatter must not add defaults of its own"


def test_enomem_while_mapping_the_dram_tier_names_dram():
    policy = Path("/proc/sys/vm/overcommit_memory")
    if not policy.exists() or policy.read_text().strip() not in ("0", "2"):
        pytest.skip("this kernel may grant any mapping (vm.overcommit_memory=1): mapping 1 PiB would not fail")
    from kvstored.dram import DramAllocationError, DramTier  # noqa: PLC0415 - numba loads slowly

    with pytest.raises(DramAllocationError, match=r"^--dram 1024\.0 TiB: the kernel refused .* choose a smaller --dram$"):
        DramTier(1 << 50)


def test_a_socket_directory_others_may_write(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    line = refused(tmp_path, "--listen", f"ipc://{shared / 'kvstored.sock'}")
    assert f"--listen: socket directory {shared} is writable by group or others (mode 777)" in line
