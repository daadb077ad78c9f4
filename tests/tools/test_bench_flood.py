"""``kvdrive-bench flood`` end to end, with phases and floods small enough for a test run."""

import json
import subprocess
import sys

import pytest

from kvdrive.tools import bench

PHASES = [("connections", 32), ("list", 1), ("list", 8), ("puts4m", 1), ("puts4m", 8), ("ssd-gets", 1), ("ssd-gets", 8)]


def run_flood(tmp_path, *options: str) -> tuple[dict, str]:
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "kvdrive.tools.bench", "flood", "--quick", "--seconds", "0.5",
           "--dir", str(tmp_path), "--json", str(out), *options]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # Every daemon's and flood's temporary directory is gone.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.json"]
    return json.loads(out.read_text()), proc.stdout


def test_quick_run_measures_the_victim_under_every_flood(tmp_path):
    doc, stdout = run_flood(tmp_path, "--connections", "32", "--session-connections", "8", "--dram-mib", "4")
    rows = doc["rows"]
    assert [(r["flood"], r["connections"]) for r in rows] == PHASES
    for row in rows:
        assert row["daemon"] in ("alive", "died", "no answer")
        rest = row["at_rest"]
        assert rest["puts"] > 0 and 0 < rest["p50_ms"] <= rest["p99_ms"] < 10_000, row
        if row["daemon"] != "alive":
            continue
        flooded = row["flooded"]
        assert flooded["puts"] > 0 and 0 < flooded["p50_ms"] <= flooded["p99_ms"] < 10_000, row
        assert row["p50_vs_rest"] == pytest.approx(flooded["p50_ms"] / rest["p50_ms"])
        assert row["p99_vs_rest"] == pytest.approx(flooded["p99_ms"] / rest["p99_ms"])
        assert row["flood_result"]["ok"] > 0, row
    connections = rows[0]["flood_result"]["counts"]
    if rows[0]["daemon"] == "alive":
        assert connections["zmq_connections"] == 32 and connections["hellos_last"] == 32
        assert connections["session_connections"] == 8
    assert rows[1]["flood_result"]["counts"]["sequences_listed"] >= 256 * rows[1]["flood_result"]["ok"]
    for label, _ in PHASES:
        assert label in stdout
    assert "p50 vs rest" in stdout and "one machine, one user" in stdout


def test_a_daemon_that_dies_under_a_flood_is_restarted_for_the_next_phase(tmp_path):
    # 128 connections with 64 descriptors: kvstored either refuses the surplus or dies;
    # either way the run goes on to the last phase.
    doc, stdout = run_flood(tmp_path, "--floods", "connections,list", "--connections", "128",
                            "--session-connections", "0", "--daemon-nofile", "64")
    row, after = doc["rows"][0], doc["rows"][-1]
    assert [r["flood"] for r in doc["rows"]] == ["connections", "list", "list"]
    assert row["at_rest"]["puts"] > 0 and after["at_rest"]["puts"] > 0 and after["daemon"] == "alive"
    assert row["daemon"] in ("alive", "died", "no answer")
    assert doc["info"]["restarts"] == (row["daemon"] != "alive")
    assert ("daemon died" in stdout or "daemon no answer" in stdout) == (row["daemon"] != "alive")
    if row["daemon"] != "alive":
        assert "restarted" in stdout


@pytest.mark.parametrize("options, message", [
    (["--seconds", "0"], "--seconds must be"),
    (["--floods", "connections,nope"], "--floods takes"),
    (["--daemon-nofile", "8"], "--daemon-nofile must be"),
])
def test_bad_options_are_refused(capsys, options, message):
    assert bench.main(["flood", *options]) == 2
    assert message in capsys.readouterr().err
