"""The paced writeback of write-behind's page-cache writes: writes wait past the backlog
and never past it by more than one write, a drain leaves nothing behind, an error of the
kernel's is logged once and waits on nothing, and a thread that is gone holds no write."""

from __future__ import annotations

import os
import threading
import time

import pytest

import kvstored.writeback as wb
from kvstored.writeback import Writeback

RUN = 256 << 10


def write_runs(path, back: Writeback, count: int, seen: list[int] | None = None) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        for i in range(count):
            os.pwrite(fd, os.urandom(RUN), i * RUN)
            back.written(i * RUN, RUN)
            if seen is not None:
                seen.append(back.backlog)
    finally:
        os.close(fd)


def test_writes_wait_past_the_backlog_and_a_drain_leaves_none(tmp_path, monkeypatch):
    assert Writeback(tmp_path / "data").backlog_bytes == wb.BACKLOG_BYTES  # the default; --write-behind-backlog sets it
    monkeypatch.setattr(wb, "FLIGHT_BYTES", 2 * RUN)
    real = wb.start_writeback

    def slow(fd, offset, nbytes, wait=0):  # a slow disk: the backlog fills
        if wait:
            time.sleep(0.01)
        real(fd, offset, nbytes, wait)

    monkeypatch.setattr(wb, "start_writeback", slow)
    back = Writeback(tmp_path / "data", backlog_bytes=4 * RUN)
    (tmp_path / "data").touch()
    seen: list[int] = []
    write_runs(tmp_path / "data", back, 24, seen)
    assert max(seen) <= 4 * RUN  # each write returned with the backlog within its bound
    assert max(seen) == 4 * RUN  # and writes did reach it (they waited there)
    back.drain()
    assert back.backlog == 0
    back.close()


def test_a_kernel_error_is_logged_once_and_holds_nothing(tmp_path, monkeypatch, caplog):
    def failing(fd, offset, nbytes, wait=0):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(wb, "start_writeback", failing)
    monkeypatch.setattr(wb, "BACKLOG_BYTES", 2 * RUN)
    (tmp_path / "data").touch()
    back = Writeback(tmp_path / "data")
    with caplog.at_level("WARNING", logger="kvstored.writeback"):
        write_runs(tmp_path / "data", back, 12)
        back.drain()
    assert back.backlog == 0
    assert caplog.text.count("left to each flush") == 1
    back.close()


def test_a_thread_that_is_gone_holds_no_write_nor_drain(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(wb, "BACKLOG_BYTES", 2 * RUN)
    monkeypatch.setattr(Writeback, "_serve", lambda self: (_ for _ in ()).throw(RuntimeError("boom")))
    (tmp_path / "data").touch()
    back = Writeback(tmp_path / "data")
    done = threading.Event()

    def go():
        write_runs(tmp_path / "data", back, 12)
        back.drain()
        done.set()

    with caplog.at_level("ERROR", logger="kvstored.writeback"):
        threading.Thread(target=go, daemon=True).start()
        assert done.wait(10), "a write or the drain waited on a writeback thread that had ended"
    assert "writeback thread failed" in caplog.text
    back.close()


@pytest.mark.parametrize("nbytes", [RUN, 3 * RUN + 5])
def test_writeback_of_a_real_file_returns_its_bytes(tmp_path, nbytes):
    path = tmp_path / "data"
    data = os.urandom(nbytes)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.pwrite(fd, data, 0)
    back = Writeback(path)
    back.written(0, nbytes)
    back.drain()
    back.close()
    assert os.pread(fd, nbytes, 0) == data and back.backlog == 0
    os.close(fd)
