"""``kvdrive-bench soak`` end to end, on a quota small enough for a test run."""

import json
import subprocess
import sys

import pytest

from kvdrive.tools import bench


def soak(tmp_path, *options: str) -> tuple[list[dict], dict, str]:
    out = tmp_path / "rows.json"
    cmd = [sys.executable, "-m", "kvdrive.tools.bench", "soak", "--quick", "--dir", str(tmp_path), "--json", str(out),
           *options]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.json"]  # the daemon's directory is gone
    doc = json.loads(out.read_text())
    assert doc["info"]["in_place"] is True and doc["info"]["daemon_exit"] is None and doc["info"]["error"] is None
    return doc["rows"], doc["info"], proc.stdout


def test_a_quick_soak_fills_the_quota_evicts_and_loads_the_bytes_it_stored(tmp_path):
    rows, info, stdout = soak(tmp_path, "--minutes", "0.15", "--interval", "3")
    assert len(rows) == 3 and [r["seconds"] for r in rows] == sorted(r["seconds"] for r in rows)
    assert rows[-1]["stored_bytes"] > 64 << 20 and rows[-1]["evicted"] > 0  # past the quota: evicting
    for r in rows:
        assert r["wrong_blocks"] == 0 and r["failed_stores"] == 0 and r["kills"] == 0, r
        assert r["loads"] > 0 and 0 < r["load_p50_ms"] <= r["load_p99_ms"] <= r["load_max_ms"], r
        assert 0 < r["store_p50_ms"] <= r["store_p99_ms"] <= r["store_max_ms"] and r["store_gbps"] > 0, r
        assert r["rss_mib"] > 0 and r["maps"] > 0 and r["fds"] > 0 and r["threads"] > 0 and r["data_mib"] > 0, r
    # Recent jobs are held (half the loads pick one): some loads hit; old ones were evicted: some miss.
    assert 0 < sum(r["hit_rate"] for r in rows) / len(rows) < 1
    assert info["kills"] == 0 and "wrong blocks loaded: 0" in stdout and "steady state" in stdout
    worst = max(r["load_max_ms"] for r in rows)
    assert f"the slowest load of the run: {worst:.1f} ms" in stdout


def test_traffic_goes_on_across_kills_of_the_daemon_and_no_acknowledged_block_is_lost(tmp_path):
    rows, info, stdout = soak(tmp_path, "--minutes", "0.4", "--interval", "4", "--kill-every", "8")
    assert info["kills"] == 2 and len(info["restart_s"]) == 2 and info["checked_after_kills"] == 2 * 32
    assert info["lost_after_kills"] == 0 and sum(r["wrong_blocks"] for r in rows) == 0
    assert rows[-1]["kills"] == 2 and sum(r["store_gbps"] for r in rows if r["kills"] == 2) > 0  # go on after it
    assert sum(r["failed_stores"] for r in rows) > 0  # while the daemon was down
    assert "killed (SIGKILL) and started again 2 times" in stdout and "0 lost or wrong" in stdout


@pytest.mark.parametrize("options, message", [
    (["--minutes", "0"], "--minutes must be above 0"),
    (["--block-kib", "6"], "multiple of 4 KiB"),
    (["--quota", "lots"], "lots"),
    (["--kill-every", "0"], "--kill-every must be above 0"),
])
def test_bad_options_are_refused(capsys, options, message):
    assert bench.main(["soak", *options]) == 2
    assert message in capsys.readouterr().err
