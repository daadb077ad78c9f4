"""kvstored under systemd's Type=notify: ready only once it serves, progress while it
pre-faults the DRAM tier (with more start-up time asked for), stopping when it stops."""

import logging
import socket

import pytest

from kvstored import dram as dram_mod
from kvstored import notify as notify_mod
from kvstored.dram import DramTier


@pytest.fixture
def notify_socket(tmp_path, monkeypatch):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(tmp_path / "notify"))
    s.settimeout(60)
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
    yield s
    s.close()


def messages(s: socket.socket, until: str) -> list[dict]:
    got = []
    while not got or until not in got[-1]:
        got.append(dict(line.split("=", 1) for line in s.recv(4096).decode().splitlines()))
    return got


def test_ready_is_sent_once_it_serves_and_stopping_when_it_stops(daemon_factory, notify_socket):
    d = daemon_factory(dram="64M").start()
    ready = messages(notify_socket, "READY")[-1]
    assert ready["READY"] == "1" and ready["STATUS"].startswith("serving ") and int(ready["MAINPID"]) == d.proc.pid
    assert d.client().ping()
    assert d.stop() == 0
    assert messages(notify_socket, "STOPPING")[-1] == {"STOPPING": "1"}


def test_the_pre_fault_tells_its_progress_and_asks_for_time(notify_socket, monkeypatch, caplog):
    monkeypatch.setattr(notify_mod, "PROGRESS_S", 0.0)
    monkeypatch.setattr(dram_mod, "PREFAULT_STEP_BYTES", 4 << 20)
    with caplog.at_level(logging.INFO, logger="kvstored.dram"):
        tier = DramTier(32 << 20)
    tier.close()
    notify_socket.settimeout(5)
    sent = messages(notify_socket, "EXTEND_TIMEOUT_USEC")
    assert "of 32.0 MiB in" in sent[0]["STATUS"] and "s left" in sent[0]["STATUS"]
    assert int(sent[0]["EXTEND_TIMEOUT_USEC"]) >= 30_000_000
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "DRAM tier: pre-faulting 32.0 MiB" and lines[-1].startswith("DRAM tier: pre-faulted 32.0 MiB in")
    assert sum("s left" in line for line in lines) == 7  # after each 4 MiB step but the last


def test_the_catalog_check_tells_its_progress_and_asks_for_time(daemon_factory, notify_socket, monkeypatch, caplog):
    """A store of millions of small blocks takes minutes to check at start-up: past a unit's
    start timeout, systemd would kill kvstored before it served, at every start."""
    import numpy as np

    from kvdrive_client.integrations.blocks import BlockStore
    from kvstored import catalog as catalog_mod
    from kvstored.cli import build_parser, config_from_args
    from kvstored.store import Store

    monkeypatch.delenv("NOTIFY_SOCKET")  # the daemon that stores them says nothing
    d = daemon_factory(dram="16M").start()
    store = BlockStore(4096, engine="t", model="m", address=d.address)
    assert all(store.store([b"k%d" % i for i in range(300)], list(np.ones((300, 4096), np.uint8))))
    store.close()
    assert d.stop() == 0
    monkeypatch.setenv("NOTIFY_SOCKET", notify_socket.getsockname())
    monkeypatch.setattr(notify_mod, "PROGRESS_S", 0.0)
    monkeypatch.setattr(catalog_mod, "PROGRESS_ROWS", 64)
    with caplog.at_level(logging.INFO, logger="kvstored.notify"):
        opened = Store(config_from_args(build_parser().parse_args(["--ssd", str(d.ssd), "--dram", "16M"])))
    assert opened.blocks.num_blocks() == 300
    opened.close()
    notify_socket.settimeout(5)
    sent = messages(notify_socket, "EXTEND_TIMEOUT_USEC")  # 600 records (300 blocks, 300 extents)
    assert sent[0]["STATUS"].startswith("catalog: checked 64 of 600 records in ") and "s left" in sent[0]["STATUS"]
    assert int(sent[0]["EXTEND_TIMEOUT_USEC"]) >= 30_000_000
    told = [r.getMessage().split(" of ")[0] for r in caplog.records if r.getMessage().startswith("catalog: checked ")]
    assert told == [f"catalog: checked {n}" for n in (64, 128, 192, 256, 300, 364, 428, 492, 556)]  # extents, blocks
