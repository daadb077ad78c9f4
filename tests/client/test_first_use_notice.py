"""The first attach() on a machine says on stderr that it compiles kernels, where the
program configured no logging; a warm machine (nothing compiled) prints nothing."""

from __future__ import annotations

import time

from kvdrive.kernels import KernelProgress
from kvdrive_client import first_use


def feed(notice, compiled: bool, seconds: float = 3.0) -> None:
    for i in (1, 2):
        notice(KernelProgress("place", i, 2))
        notice(KernelProgress("place", i, 2, seconds, compiled))


def test_compiles_are_told_on_stderr_when_logging_is_not_configured(monkeypatch, capsys):
    monkeypatch.setattr(first_use, "logging_configured", lambda: False)
    feed(first_use.KernelNotice(), compiled=True)
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("kvdrive: compiling the CPU kernels for this machine, once")
    assert err[1:] == ["kvdrive: compiled the place kernel in 3.0 s (1/2)", "kvdrive: compiled the place kernel in 3.0 s (2/2)"]


def test_a_long_first_compile_is_announced_before_it_ends(monkeypatch, capsys):
    monkeypatch.setattr(first_use, "logging_configured", lambda: False)
    monkeypatch.setattr(first_use, "FIRST_LINE_AFTER_S", 0.05)
    notice = first_use.KernelNotice()
    notice(KernelProgress("place", 1, 1))
    time.sleep(0.5)  # the compile of the first kernel, still running
    assert "compiling the CPU kernels for this machine" in capsys.readouterr().err
    notice(KernelProgress("place", 1, 1, 0.6, True))
    assert capsys.readouterr().err == "kvdrive: compiled the place kernel in 0.6 s (1/1)\n"


def test_a_warm_machine_prints_nothing(monkeypatch, capsys):
    monkeypatch.setattr(first_use, "logging_configured", lambda: False)
    feed(first_use.KernelNotice(), compiled=False, seconds=0.001)
    assert capsys.readouterr().err == ""
