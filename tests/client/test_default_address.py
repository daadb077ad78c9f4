"""Which kvstored connect() reaches with no argument, and how fast it says none is there."""

from __future__ import annotations

import json
import socket
import time

import pytest

from kvdrive.protocol import address as defaults
from kvdrive.tools.inspect import main as inspect_main
from kvdrive_client import StoreUnavailableError, connect
from kvstored.config import DaemonConfig

FAST_S = 0.5


@pytest.fixture
def runtime_dir(tmp_path, monkeypatch):
    """An empty private runtime directory as the only say in the default address."""
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    for name in ("KVDRIVE_ADDRESS", "RUNTIME_DIRECTORY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(run))
    # The host's own systemd daemon, if it has one, must not answer for the test.
    monkeypatch.setattr(defaults, "SYSTEM_SOCKET", tmp_path / "system" / "kvstored.sock")
    return run


def refused(address=None, **kwargs) -> tuple[str, float]:
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailableError) as err:
        connect(**kwargs) if address is None else connect(address, **kwargs)
    return str(err.value), time.monotonic() - t0


def test_the_daemon_binds_where_clients_look_first(runtime_dir, tmp_path):
    cfg = DaemonConfig(ssd_dir=tmp_path / "ssd", dram_bytes=1 << 20)
    assert cfg.bind_address == f"ipc://{runtime_dir / 'kvstored.sock'}" == defaults.default_addresses()[0]
    assert defaults.default_addresses()[1] == f"ipc://{defaults.SYSTEM_SOCKET}"


@pytest.mark.alone
def test_no_daemon_at_the_default_address_fails_at_once_and_says_how_to_start_one(runtime_dir):
    message, took = refused()
    assert took < FAST_S
    assert f"there is no socket at {runtime_dir / 'kvstored.sock'}" in message
    assert "`kvstored --ssd DIR --dram SIZE`" in message and "connect(None)" in message
    assert "$KVDRIVE_ADDRESS (unset)" in message and str(defaults.SYSTEM_SOCKET) in message


@pytest.mark.alone
def test_an_explicit_path_with_no_socket_fails_at_once(tmp_path):
    address = f"ipc://{tmp_path / 'none.sock'}"
    message, took = refused(address, timeout=60)
    assert took < FAST_S
    assert message.startswith(f"no kvstored answers at {address}: there is no socket")
    assert f"--listen {address}" in message


@pytest.mark.alone
def test_a_stale_socket_fails_at_once(tmp_path):
    path = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(path))  # bound, never listening: what a killed daemon leaves behind
    message, took = refused(f"ipc://{path}", timeout=60)
    assert took < FAST_S
    assert f"nobody listens on the socket {path}" in message


@pytest.mark.alone
def test_a_file_that_is_not_a_socket_is_named(tmp_path):
    path = tmp_path / "plain.sock"
    path.write_text("")
    message, took = refused(f"ipc://{path}", timeout=60)
    assert took < FAST_S and f"{path} is not a socket" in message


def test_kvdrive_address_comes_first(runtime_dir, daemon, monkeypatch):
    monkeypatch.setenv("KVDRIVE_ADDRESS", daemon.address)
    with connect() as store:
        assert store.address == daemon.address and store.ping()


def test_the_system_socket_serves_when_the_users_own_does_not_exist(runtime_dir, daemon, monkeypatch):
    monkeypatch.setattr(defaults, "SYSTEM_SOCKET", daemon.root / "kvstored.sock")
    with connect() as store:
        assert store.address == daemon.address
    own = runtime_dir / "kvstored.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(own))
        # Once the user's own socket exists it is the one taken (and here it is stale).
        assert defaults.default_address() == f"ipc://{own}"
        assert "nobody listens" in refused()[0]


def test_inspect_address_with_no_value_asks_the_default_daemon(runtime_dir, daemon, monkeypatch, capsys):
    monkeypatch.setenv("KVDRIVE_ADDRESS", daemon.address)
    assert inspect_main(["--address", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["store"]["address"] == daemon.address and doc["store"]["pid"] == daemon.proc.pid


def test_inspect_address_with_no_value_and_no_daemon_fails_in_one_line(runtime_dir, capsys):
    assert inspect_main(["--address"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "there is no socket at" in err


def test_a_bad_address_is_a_type_error():
    with pytest.raises(TypeError, match="None for a private daemon"):
        connect(42)


@pytest.mark.parametrize("address", ["http://localhost:8000", "localhost:5555", "/run/kvdrive/kvstored.sock"])
def test_an_address_of_another_scheme_says_which_are_accepted(address):
    with pytest.raises(ValueError, match="kvstored listens on ipc://PATH or tcp://HOST:PORT, not"):
        connect(address)
