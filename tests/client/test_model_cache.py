"""The de-quantised model copies: keyed by the GGUF file's content, so copies of one file
made from two environments (two paths, two modification times) are one; listed with their
sizes, and the stale ones removed by the cleanup command."""

from __future__ import annotations

import os
import shutil

import pytest

from kvdrive_client import models


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KVDRIVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_two_environments_with_the_same_file_share_one_copy(cache, tmp_path):
    real = models.smollm2_path()
    other = tmp_path / "env2" / real.name
    other.parent.mkdir()
    shutil.copyfile(real, other)
    os.utime(other, (1, 1))  # installed at another time, elsewhere
    assert models._converted_dir("smollm2", real) == models._converted_dir("smollm2", other)
    assert (cache / "models" / "digests.json").exists()  # the second look at each file reads no bytes


def test_the_cleanup_command_removes_only_stale_copies(cache, capsys):
    current = models._converted_dir("smollm2", models.smollm2_path())
    stale = cache / "models" / "smollm2-98362432-1796361635"  # keyed by size and time, as copies once were
    for d in (current, stale):
        d.mkdir(parents=True, exist_ok=True)
        (d / "model.safetensors").write_bytes(b"\0" * (3 << 20))
    assert models.main(["list"]) == 0
    out = capsys.readouterr().out
    assert f"{current}  3 MiB  in use" in out and f"{stale}  3 MiB  stale" in out and "2 copies, 6 MiB; 3 MiB stale" in out
    assert models.main(["clean"]) == 0
    assert current.exists() and not stale.exists()
    assert "3 MiB removed" in capsys.readouterr().out
