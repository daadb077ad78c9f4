"""kvstore-clean: what an interrupted generate() leaves, listed and deleted, through a running
daemon and in a stopped store, never another user's."""

from __future__ import annotations

import numpy as np
import pytest

from kvdrive.tools import clean
from kvdrive_client import Geometry

GEOM = Geometry(num_layers=1, num_kv_heads=1, head_dim=64, dtype="float16", page_size=16)


def fill(client) -> None:
    for ns, name in (("kvdrive", "0f3a-0"), ("kvdrive", "0f3a-1"), ("kvdrive", "prompt-x"), ("other", "keep")):
        s = client.create(ns, name, GEOM)
        client.put(s, [0], [0], np.zeros(GEOM.block_bytes, np.uint8))


def names(client) -> set[str]:
    return {f"{s['ns']}/{s['seq']}" for s in client.list()}


def test_through_a_running_daemon_it_lists_then_deletes(daemon, capsys):
    c = daemon.client()
    fill(c)
    assert clean.main(["--address", daemon.address]) == 0
    out = capsys.readouterr().out
    assert "would delete (run again with --delete) 3 sequences" in out and "kvdrive/0f3a-0" in out
    assert len(names(c)) == 4
    assert clean.main(["--address", daemon.address, "--older-than", "1h", "--delete"]) == 0
    assert len(names(c)) == 4  # all were made just now
    assert clean.main(["--address", daemon.address, "--name", "0f3a-*", "--delete"]) == 0
    assert "deleted 2 sequences" in capsys.readouterr().out
    assert names(c) == {"kvdrive/prompt-x", "other/keep"}


def test_in_a_stopped_store_it_deletes_in_one_commit_and_the_daemon_agrees(daemon, capsys):
    fill(daemon.client())
    ssd = daemon.root / "ssd"
    assert clean.main([str(ssd), "--delete"]) == 2  # a daemon serves it
    assert "use --address" in capsys.readouterr().err
    assert daemon.stop() == 0
    assert clean.main([str(ssd), "--ns", "*", "--name", "*p*", "--delete"]) == 0  # prompt-x, keep
    assert "deleted 2 sequences" in capsys.readouterr().out
    assert names(daemon.start().client()) == {"kvdrive/0f3a-0", "kvdrive/0f3a-1"}


def test_another_users_sequences_are_for_root_only(tmp_path, monkeypatch, capsys):
    (tmp_path / "meta").mkdir()
    monkeypatch.setattr(clean.os, "geteuid", lambda: 1000)
    assert clean.main([str(tmp_path), "--uid", "0"]) == 2
    assert "--uid is for root" in capsys.readouterr().err
    assert clean.main([str(tmp_path), "--address", "ipc:///nowhere"]) == 2
    assert clean.main(["--address", "http://localhost:8000"]) == 2
    assert "kvstored listens on ipc://PATH or tcp://HOST:PORT" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        clean.main(["--older-than", "soon"])
