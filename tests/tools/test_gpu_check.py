"""kvdrive.tools.gpu_check: the dry run on the CPU, stage failures, and the import shim of a plain checkout."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvdrive.tools import gpu_check as gc

ROOT = Path(__file__).resolve().parents[2]
STAGE_NAMES = ["env", "gpu_tests", "micro", "launches", "decode", "summary"]
FINAL = {"ok", "skipped", "failed", "error", "timeout"}


def test_dry_run_completes_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    t0 = time.monotonic()
    # The gpu_tests stage's plumbing on one gpu-marked file: collecting the whole tree under
    # '-m gpu' (its default) took about a third of the dry run; the suite itself collects the tree.
    proc = subprocess.run([sys.executable, "-m", "kvdrive.tools.gpu_check", "--dry-run", "--out", str(out),
                           "--budget-s", "110", "--tests", "tests/kernels/test_triton_gpu.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=180)
    took = time.monotonic() - t0
    assert took < 120, f"the dry run took {took:.0f} s"
    results = json.loads((out / gc.RESULTS).read_text())
    stages = results["stages"]
    assert list(stages) == STAGE_NAMES
    for name, record in stages.items():
        assert record["status"] in FINAL, (name, record)
    # The nested pytest may meet another test module's collection error: its verdict is recorded either way.
    assert stages["gpu_tests"]["status"] in ("ok", "failed")
    assert "counts" in stages["gpu_tests"]["data"] and (out / gc.PYTEST_LOG).is_file()
    assert stages["gpu_tests"]["data"]["command"].endswith(" -m gpu -p no:cacheprovider -rfEs "
                                                           "--continue-on-collection-errors tests/kernels/test_triton_gpu.py")
    for name in ("env", "micro", "launches", "decode", "summary"):
        assert stages[name]["status"] == "ok", (name, stages[name], proc.stdout[-3000:], proc.stderr[-3000:])
    env = stages["env"]["data"]
    assert env["cuda_available"] is False and env["kvstored"]["status"] == "ok"
    assert env["kernels_for_cuda"] == "reference"
    micro = stages["micro"]["data"]
    assert micro["attention"]["variants"][0]["status"] == "ok"
    assert micro["attention"]["variants"][0]["max_abs_err"] < 1e-2
    assert micro["h2d_copy"]["status"] == "skipped"
    launches = stages["launches"]["data"]["rows"]
    assert [r["kernels"] for r in launches] == ["reference"] and launches[0]["status"] == "ok", launches
    assert launches[0]["ops_per_layer_step"] > 0 and launches[0]["syncs_per_layer_step"] <= 1
    rows = stages["decode"]["data"]["rows"]
    ran = {(r["config"], r["tier"]) for r in rows if r["status"] == "ok"}
    assert {("dense", "-"), ("shadowkv", "dram"), ("shadowkv", "dram+ssd"), ("kvdrive+pipe", "dram"),
            ("kvdrive+pipe", "dram+ssd")} <= ran
    assert all(r["tokens_per_s"] > 0 and "bytes_per_step" in r for r in rows if r["status"] == "ok" and r["config"] != "dense")
    summary = (out / gc.SUMMARY).read_text()
    assert "decode:" in summary and "kvdrive+pipe" in summary and "micro (cpu)" in summary
    assert "launches per layer per decode step (cpu" in summary
    assert summary in proc.stdout  # printed last
    assert not list(out.glob("part-*.json")), "a stage's part file was left behind"


def _stage(name, fn, share=0.5, isolated=False):
    return gc.Stage(name, share, fn, isolated=isolated)


def _ctx(tmp_path):
    return gc.Context(tmp_path, dry_run=True, deadline=time.time() + 30)


def test_a_stage_that_raises_is_recorded_and_the_next_runs(tmp_path):
    def boom(ctx, data):
        data["before"] = 1
        raise RuntimeError("boom")

    def after(ctx, data):
        data["ran"] = True

    def skip(ctx, data):
        raise gc.StageSkipped("nothing here")

    results: dict = {}
    gc.run_stages([_stage("boom", boom), _stage("skip", skip), _stage("after", after)], _ctx(tmp_path), results, 30,
                  log=lambda s: None)
    on_disk = json.loads((tmp_path / gc.RESULTS).read_text())
    for got in (results, on_disk):
        st = got["stages"]
        assert st["boom"]["status"] == "error" and st["boom"]["error"] == "RuntimeError: boom"
        assert "Traceback" in st["boom"]["traceback"] and st["boom"]["data"] == {"before": 1}
        assert st["skip"]["status"] == "skipped" and st["skip"]["reason"] == "nothing here"
        assert st["after"]["status"] == "ok" and st["after"]["data"] == {"ran": True}


def test_an_isolated_stage_that_dies_or_hangs_is_recorded_and_the_next_runs(tmp_path, monkeypatch):
    commands = {"dies": [sys.executable, "-c", "import os; os._exit(3)"],
                "hangs": [sys.executable, "-c", "import time; time.sleep(60)"]}
    monkeypatch.setattr(gc, "_child_command", lambda stage, ctx, part: commands[stage.name])
    monkeypatch.setattr(gc, "GRACE_S", 0.5)
    results: dict = {}
    t0 = time.monotonic()
    stages = [_stage("dies", None, 0.5, True), _stage("hangs", None, 0.01, True),
              _stage("after", lambda ctx, data: data.update(ran=True), 0.49)]
    gc.run_stages(stages, _ctx(tmp_path), results, 4, log=lambda s: None)
    assert time.monotonic() - t0 < 20
    st = results["stages"]
    assert st["dies"]["status"] == "error" and st["dies"]["child_rc"] == 3
    assert st["hangs"]["status"] == "timeout" and "killed" in st["hangs"]["timeout"]
    assert st["after"]["status"] == "ok"


def test_pytest_counts():
    out = "....\nFAILED tests/x.py::t - boom\n3 passed, 1 failed, 2 skipped, 900 deselected, 1 error in 12.34s\n"
    assert gc.pytest_counts(out) == {"passed": 3, "failed": 1, "skipped": 2, "deselected": 900, "errors": 1}
    assert gc.pytest_counts("no summary") == {}


def test_this_checkout_needs_no_shim():
    assert gc.source_root() == ROOT
    assert gc.package_dirs(ROOT)["kvdrive_client"] == "client"
    assert gc.ensure_importable() is None  # the test run imports kvdrive_client from this checkout


def test_the_import_shim_serves_a_plain_copy_of_the_source_tree(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for folder in sorted(set(gc.package_dirs(ROOT).values())):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", src)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(src))
    proc = subprocess.run([sys.executable, "-m", "tools.gpu_check", "--dry-run", "--stages", "env", "--out", str(out),
                           "--budget-s", "60"], cwd=src, env=env, capture_output=True, text=True, timeout=120)
    results = json.loads((out / gc.RESULTS).read_text())
    shim = results["import_shim"]
    assert shim and not Path(shim).exists(), "the shim folder is made, then removed at exit"
    env_stage = results["stages"]["env"]
    assert env_stage["status"] == "ok", (env_stage, proc.stdout[-2000:], proc.stderr[-2000:])
    imported = env_stage["data"]["imported_from"]
    assert imported["kvdrive_client"].startswith(shim) and imported["kvdrive.kernels"].startswith(shim)
    for name, path in env_stage["data"]["imported_from_resolved"].items():
        assert Path(path).is_relative_to(src.resolve()), (name, path)
    assert env_stage["data"]["kvstored"]["status"] == "ok"  # the daemon, a grandchild, found the packages too
    assert results["stages"]["gpu_tests"]["status"] == "skipped"


@pytest.mark.parametrize("argv", [["--stages", "nope"], ["--budget-s", "0"], ["--decode-contexts", "1000"]])
def test_bad_options(tmp_path, argv):
    assert gc.main(["--out", str(tmp_path), *argv]) == 2
