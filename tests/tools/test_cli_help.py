"""Every console script answers --help at once, exit status 0, each option's default told once."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from kvdrive.tools import profile
from kvdrive.tools.bench import BENCHMARKS, build_parser

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"])
# Generous for a loaded 2-core host: the scripts take about half a second when it is idle.
HELP_BOUND_S = 3.0


def run_help(*argv: str) -> tuple[str, float]:
    exe = Path(sys.executable).parent / argv[0]
    assert exe.exists(), f"the {argv[0]} console script is not installed (pip install -e .)"
    t0 = time.monotonic()
    out = subprocess.run([str(exe), *argv[1:], "--help"], capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t0
    assert out.returncode == 0, out.stderr
    return out.stdout, took


def defaults_told_twice(text: str) -> list[str]:
    """The options whose help tells their default more than once."""
    options = re.split(r"\n(?=  -)", text)[1:]
    return [o.split()[0] for o in options if len(re.findall(r"\(default", o)) > 1 or o.count("(default:") > 1]


@pytest.mark.alone
@pytest.mark.parametrize("script", SCRIPTS)
def test_console_script_help_is_fast(script):
    text, took = run_help(script)
    assert took < HELP_BOUND_S, f"{script} --help took {took:.1f} s: import what only a run needs inside the run"
    assert "usage:" in text and not defaults_told_twice(text), defaults_told_twice(text)


@pytest.mark.alone
@pytest.mark.parametrize("bench", sorted(BENCHMARKS))
def test_bench_subcommand_help(bench):
    text, took = run_help("kvdrive-bench", bench)
    assert took < HELP_BOUND_S, f"kvdrive-bench {bench} --help took {took:.1f} s"
    assert f"kvdrive-bench {bench}" in text and not defaults_told_twice(text), defaults_told_twice(text)


def test_bench_options_load_without_torch():
    """What --help imports for each benchmark leaves torch (seconds to import) to the run."""
    modules = [f"kvdrive.tools.{b.options or b.module}" for b in BENCHMARKS.values()]
    code = f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", f"importing {modules} loads torch"


def test_profile_help_tells_attach_configs_defaults():
    from kvdrive_client.config import AttachConfig  # noqa: PLC0415 - loads torch; the tool's --help does not

    defaults = AttachConfig()
    assert (profile.DEFAULT_BUDGET, profile.DEFAULT_PAGE_SIZE) == (defaults.budget, defaults.page_size)


def test_the_help_tools_do_not_import_torch():
    probe = "import sys, kvdrive.tools.profile, kvdrive.tools.inspect, kvdrive.tools.bench; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_console_script_tells_its_version(script):
    exe = Path(sys.executable).parent / script
    out = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=120)
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert out.returncode == 0 and out.stdout.strip() == f"{script} {version}", out.stdout + out.stderr


DIR_BENCHES = ["flood", "scale", "soak", "store", "tier"]  # those whose daemons' directories go in --dir


@pytest.mark.parametrize("bench", DIR_BENCHES)
def test_a_bench_dir_is_made_where_missing_and_refused_in_one_line_where_it_cannot_be(bench, tmp_path, capsys):
    missing = tmp_path / "a" / "b"
    args = build_parser(bench).parse_args([bench, "--dir", str(missing)])
    assert args.dir == missing and missing.is_dir()
    blocker = tmp_path / "file"
    blocker.write_text("")
    for bad, why in ((blocker, "is not a directory"), (blocker / "sub", "cannot make")):
        with pytest.raises(SystemExit) as exc:
            build_parser(bench).parse_args([bench, "--dir", str(bad)])
        err = capsys.readouterr().err
        line = err.strip().splitlines()[-1]
        assert exc.value.code == 2 and line.startswith(f"kvdrive-bench {bench}: error: argument --dir: ")
        assert why in line and str(bad) in line and not (blocker / "sub").exists()


JSON_BENCHES = sorted(BENCHMARKS)  # every bench writes its rows with --json FILE


@pytest.mark.parametrize("bench", JSON_BENCHES)
def test_a_bench_checks_its_json_file_before_it_runs(bench, tmp_path, capsys):
    """The rows are written after the run (minutes, for some): a path they cannot go to is
    refused at once, in one line, and a missing directory is made."""
    good = tmp_path / "out" / "rows.json"
    assert build_parser(bench).parse_args([bench, "--json", str(good)]).json == good and good.parent.is_dir()
    assert not good.exists()  # written by the run, not by the check
    blocker = tmp_path / "file"
    blocker.write_text("")
    for bad, why in ((tmp_path, "is a directory"), (blocker / "rows.json", "is not a directory")):
        with pytest.raises(SystemExit) as exc:
            build_parser(bench).parse_args([bench, "--json", str(bad)])
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert exc.value.code == 2 and line.startswith(f"kvdrive-bench {bench}: error: argument --json: ")
        assert why in line
