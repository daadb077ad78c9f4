"""``kvdrive-bench store`` end to end, on a sequence small enough for a test run."""

import json
import subprocess
import sys

import pytest

from kvdrive.tools import bench

KEYS = {"case", "bytes", "gb_per_s", "baseline", "ratio"}


def test_quick_run_prints_the_table_and_writes_json_rows(tmp_path):
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "kvdrive.tools.bench", "store", "--quick", "--layers", "2", "--tokens", "4096",
           "--repeats", "2", "--dir", str(tmp_path), "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())
    assert [r["case"] for r in rows] == [
        "dram sparse get (6.25%)", "ssd packed get vs token-order", "ssd packed get vs sequential",
        "1-block get vs hello round trip",
    ]
    for row in rows:
        assert KEYS <= row.keys()
        assert row["bytes"] > 0 and row["gb_per_s"] > 0 and row["baseline"] > 0 and row["ratio"] > 0
        assert row["ratio"] == pytest.approx(row["gb_per_s"] / row["baseline"])
    ssd = rows[1]
    assert 0 < ssd["reads"] < ssd["baseline_reads"], "packing by cluster should need fewer reads than token order"
    assert "GB/s" in proc.stdout and "ratio" in proc.stdout
    assert "only 2 of the model's 32 layers" in proc.stdout
    for row in rows:
        assert row["case"] in proc.stdout
    assert proc.stdout.count("target: ") == 3 and ("PASS" in proc.stdout or "MISS" in proc.stdout)
    # Every daemon's temporary directory is gone.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.json"]


def test_subcommands_load_lazily_and_bad_options_are_refused(capsys):
    assert set(bench.BENCHMARKS) >= {"store"}
    with pytest.raises(SystemExit):
        bench.main(["--help"])
    assert "store" in capsys.readouterr().out
    assert bench.main(["store", "--tokens", "100"]) == 2
    assert "--tokens must be a multiple" in capsys.readouterr().err
