"""A machine's first use says what it is doing: the model conversion's progress, the demo's heartbeat."""

from __future__ import annotations

import logging
import subprocess
import sys
import threading
import time
from pathlib import Path

import gguf
import numpy as np
import pytest

from kvdrive.tools import demo
from kvdrive_client import first_use, models


def tiny_gguf(path, tensors: int):
    w = gguf.GGUFWriter(str(path), "llama")
    for i in range(tensors):
        w.add_tensor(f"t{i}", np.arange(32, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_the_tensor_count_comes_from_the_header_and_a_non_gguf_file_is_named(tmp_path):
    path = tiny_gguf(tmp_path / "three.gguf", 3)
    assert models._tensor_count(path) == len(gguf.GGUFReader(path).tensors) == 3
    other = tmp_path / "model.bin"
    other.write_bytes(b"PK\x03\x04" + bytes(20))
    with pytest.raises(ValueError, match="model.bin is not a GGUF file"):
        models._tensor_count(other)


def test_de_quantised_tensors_are_counted_at_most_every_few_seconds_and_the_library_is_restored(tmp_path,
                                                                                                 monkeypatch):
    reader = gguf.GGUFReader(tiny_gguf(tmp_path / "three.gguf", 3))
    original = gguf.dequantize
    lines = []
    monkeypatch.setattr(models, "PROGRESS_EVERY", 3600.0)  # only the last tensor is due a line
    with models._CountDequantized(len(reader.tensors), lines.append):
        from gguf import dequantize  # as transformers looks it up, at each load

        out = [dequantize(t.data, t.tensor_type) for t in reader.tensors]
    assert gguf.dequantize is original
    assert all(np.array_equal(x, np.arange(32, dtype=np.float32)) for x in out)
    assert len(lines) == 1 and lines[0].startswith("de-quantised 3/3 tensors, ")


class FakeTokenizer:
    def save_pretrained(self, path):
        (Path(path) / "tokenizer.json").write_text("{}")


def fake_transformers_load(monkeypatch, make_tiny):
    """transformers' GGUF load as far as the conversion sees it: a tokenizer, then every tensor
    de-quantised through ``gguf.dequantize`` (looked up at each load), then a model."""
    import transformers

    def model_from_gguf(folder, gguf_file, dtype):
        reader = gguf.GGUFReader(Path(folder) / gguf_file)
        for t in reader.tensors:
            gguf.dequantize(t.data, t.tensor_type)
        return make_tiny("llama", layers=1)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: FakeTokenizer())
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model_from_gguf)


def test_a_conversion_tells_its_progress_on_stderr_where_logging_is_not_configured(tmp_path, monkeypatch, capsys,
                                                                                    make_tiny):
    fake_transformers_load(monkeypatch, make_tiny)
    monkeypatch.setattr(first_use, "logging_configured", lambda: False)
    monkeypatch.setattr(models, "logging_configured", lambda: False)
    path = tiny_gguf(tmp_path / "three.gguf", 3)
    models._convert("smollm2", path, tmp_path / "converted", models._conversion_lines(None))
    assert (tmp_path / "converted" / "config.json").exists()
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("kvdrive: de-quantising smollm2 (three.gguf, 0 MiB) once for this machine into ")
    assert "kvdrive: reading the GGUF metadata, then de-quantising 3 tensors" in err
    assert any(line.startswith("kvdrive: de-quantised 3/3 tensors, ") for line in err)
    assert err[-1].startswith("kvdrive: de-quantised smollm2 in ")
    assert len(err) == len(set(err)), f"a line told twice: {err}"


def test_a_conversion_logs_instead_where_logging_is_configured(tmp_path, monkeypatch, capsys, caplog, make_tiny):
    fake_transformers_load(monkeypatch, make_tiny)
    path = tiny_gguf(tmp_path / "three.gguf", 3)
    with caplog.at_level(logging.INFO, logger="kvdrive_client.models"):
        models._convert("smollm2", path, tmp_path / "converted", models._conversion_lines(None))
    assert "kvdrive:" not in capsys.readouterr().err  # (transformers' own save bar may be there)
    levels = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "kvdrive_client.models"]
    assert levels[0][0] == logging.WARNING and levels[0][1].startswith("de-quantising smollm2")
    assert levels[-1][0] == logging.WARNING and levels[-1][1].startswith("de-quantised smollm2 in ")
    assert any(level == logging.INFO and msg.startswith("de-quantised 3/3 tensors") for level, msg in levels)


def test_a_load_waiting_for_another_process_conversion_says_so(tmp_path):
    told = []
    lock = tmp_path / ".smollm2.lock"
    with models._locked(lock):
        waiter = threading.Thread(target=lambda: models._locked(lock, lambda: told.append("waiting")).__enter__())
        waiter.daemon = True
        waiter.start()
        deadline = time.monotonic() + 10
        while not told:
            assert time.monotonic() < deadline, "the second locker never said it waits"
            time.sleep(0.01)
    waiter.join(10)
    assert told == ["waiting"] and not waiter.is_alive()


@pytest.mark.alone
def test_the_demo_help_returns_at_once():
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "kvdrive.tools.demo", "--help"], capture_output=True, text=True,
                          timeout=60)
    took = time.monotonic() - t0
    assert proc.returncode == 0 and "--max-new-tokens" in proc.stdout, proc.stderr
    assert took < 3.0, f"--help took {took:.1f} s (about 0.1 s on an idle host): import what only a run needs in the run"
    probe = "import sys, kvdrive.tools.demo; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60).stdout.strip() == "False"


def test_the_demo_says_something_while_a_stage_is_silent(monkeypatch, capsys):
    monkeypatch.setattr(demo, "HEARTBEAT_S", 0.2)
    rep = demo.Reporter()
    try:
        with rep.stage("compiling") as took:
            rep.detail("compiling lowrank_select")
            deadline, out = time.monotonic() + 10, ""
            while "  ... compiling lowrank_select (" not in out:
                assert time.monotonic() < deadline, f"no heartbeat line within 10 s: {out!r}"
                time.sleep(0.05)
                out += capsys.readouterr().out
        assert took[0] > 0
    finally:
        rep.close()
