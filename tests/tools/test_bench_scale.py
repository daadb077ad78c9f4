"""kvdrive-bench scale: a small store's memory and start-up rows, the sample checked after a SIGKILL."""

from __future__ import annotations

import json

from kvdrive.tools.bench import main


def test_a_small_run_prints_every_row_and_finds_every_sampled_block(tmp_path, capsys):
    out = tmp_path / "scale.json"
    assert main(["scale", "--blocks", "3000", "--steps", "2", "--job-blocks", "512", "--key-bytes", "32",
                 "--dir", str(tmp_path), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert [r["state"] for r in doc["rows"]] == ["stored", "stored", "restarted after SIGKILL", "kvstore-inspect"]
    assert [r["blocks"] for r in doc["rows"]] == [1500, 3000, 3000, 3000] and doc["info"]["sample_wrong"] == 0
    # A few thousand blocks are within the daemon's own noise: the figures are there, not their size.
    assert all(isinstance(r["anon_b_per_block"], int) for r in doc["rows"][:3]) and doc["rows"][3]["peak_mib"] > 0
    assert doc["rows"][2]["peak_mib"] > 0  # the restarted daemon's peak
    assert "came back wrong or missing: 0" in text and "restarted after SIGKILL" in text
    assert not list(tmp_path.glob("kvdrive-scale-*"))  # the daemon's directory is gone


def test_bad_options_are_refused_in_a_sentence(capsys):
    assert main(["scale", "--blocks", "0"]) == 2
    assert "--blocks" in capsys.readouterr().err
