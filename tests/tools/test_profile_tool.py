"""``kvdrive-profile``: a short SmolLM2 run end to end, and its refusals of bad input."""

import subprocess
import sys
from pathlib import Path

import pytest

from kvdrive.tools import profile as tool
from kvdrive_client.profile import WindowProfile


def test_quick_run_writes_a_profile_that_loads(tmp_path):
    out = tmp_path / "smollm2.json"
    exe = Path(sys.executable).parent / "kvdrive-profile"
    assert exe.exists(), "the kvdrive-profile console script is not installed (pip install -e .)"
    proc = subprocess.run([str(exe), "--quick", "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    p = WindowProfile.load(out)
    assert (p.model, p.dtype, p.page_size, p.budget) == ("SmolLM2-135M-Instruct", "float32", 16, 0.0625)
    assert (p.num_layers, p.num_kv_heads) == (30, 3)
    assert (p.context, p.steps) == (tool.QUICK_CONTEXT, tool.QUICK_STEPS - tool.WARMUP_STEPS)
    assert all(isinstance(w, float) and w in p.choices for row in p.windows for w in row)
    window, uniform_bytes, uniform_fetched = p.uniform()
    assert window == 4.0 and p.used_bytes <= p.cache_bytes == uniform_bytes
    assert p.fetched_bytes_per_step() <= uniform_fetched
    assert "decode step 1/" in proc.stderr and f"decode step {tool.QUICK_STEPS}/" in proc.stderr
    assert "predicted fetched/step" in proc.stdout and "uniform x4" in proc.stdout
    assert f"{tool.DEFAULT_SEQUENCES} sequence(s)" in proc.stdout and "shrink" in proc.stdout


@pytest.mark.parametrize("argv, match", [
    (["--text", "/nonexistent/calibration.txt"], "--text /nonexistent/calibration.txt is not a file"),
    (["--context", "100"], "--context must be at least 336 tokens"),
    (["--steps", "1"], "--steps must be at least 2"),
    (["--sequences", "0"], "--sequences must be at least 1"),
    (["--windows", "0.5", "2"], "--windows must be >= 1"),
    (["--cache-bytes", "lots"], "--cache-bytes: size 'lots' is not a number"),
    (["--budget", "0"], "budget must be a fraction"),
])
def test_bad_options_are_refused_before_the_model_loads(tmp_path, capsys, argv, match):
    assert tool.main([*argv, "--out", str(tmp_path / "p.json")]) == 2
    assert match in capsys.readouterr().err


def test_a_text_too_short_for_the_sequences_is_refused(tmp_path, capsys):
    text = tmp_path / "short.txt"
    text.write_text("a few words of calibration text " * 40, encoding="utf-8")
    assert tool.main(["--text", str(text), "--quick", "--sequences", "3", "--out", str(tmp_path / "p.json")]) == 2
    assert "--sequences 3 x (--context" in capsys.readouterr().err


def test_an_out_file_in_a_missing_directory_is_refused(tmp_path, capsys):
    assert tool.main(["--out", str(tmp_path / "nowhere" / "p.json")]) == 2
    assert "no directory" in capsys.readouterr().err
