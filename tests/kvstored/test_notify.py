"""kvstored under systemd's Type=notify: ready only once it serves, progress while it
pre-faults the DRAM tier (with more start-up time asked for), stopping when it stops."""

import logging
import socket

import pytest

from kvstored import dram as dram_mod
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
    monkeypatch.setattr(dram_mod, "PROGRESS_S", 0.0)
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
