"""KVDrive installs beside each engine's own pins: every requirement the two share has a
version both accept (the engine's torch, numba and transformers above all), read from the
pinned engine's published metadata; and pip's resolver, in a dry run against the package
index set-up installs from, resolves each extra with the engine's own torch."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from kvdrive.tools.engines import ENGINES, install_engine

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
OURS = {canonicalize_name(r.name): r for r in map(Requirement, PROJECT["dependencies"])}
LOCK = {canonicalize_name(n): v for n, _, v in (line.split(" ")[0].partition("==")
                                                for line in (ROOT / "requirements/cpu.txt").read_text().splitlines()
                                                if "==" in line and not line.startswith("#"))}


def engine_requirements(name: str) -> list[Requirement]:
    """What the pinned engine requires outside its extras, for this platform."""
    pin = next(p for p in ENGINES[name] if p.startswith(f"{name}=="))
    meta = install_engine(name) / f"{name}-{pin.split('==')[1]}.dist-info" / "METADATA"
    reqs = [Requirement(line.split(":", 1)[1].strip()) for line in meta.read_text().splitlines()
            if line.startswith("Requires-Dist:")]
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def both_accept(ours: Requirement, theirs: Requirement) -> str | None:
    """A version both specifiers accept, among the versions either names and our lock's."""
    candidates = {s.version.split("+")[0] for s in (*ours.specifier, *theirs.specifier) if s.operator in ("==", ">=", "~=", "<=")}
    lock = LOCK.get(canonicalize_name(ours.name))
    if lock:
        candidates.add(lock.split("+")[0])
    if not theirs.specifier:
        return lock or "any"
    return next((v for v in sorted(candidates) if ours.specifier.contains(v, prereleases=True)
                 and theirs.specifier.contains(v, prereleases=True)), None)


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_kvdrive_installs_beside_the_engines_own_pins(engine):
    shared = [r for r in engine_requirements(engine) if canonicalize_name(r.name) in OURS]
    assert {canonicalize_name(r.name) for r in shared} >= {"torch", "numba", "pyzmq"}
    clash = {str(r): str(OURS[canonicalize_name(r.name)]) for r in shared if both_accept(OURS[canonicalize_name(r.name)], r) is None}
    assert not clash, f"{engine} requires what kvdrive's metadata refuses: {clash}"


def test_the_extras_name_the_engines_the_adapters_are_built_against():
    extras = PROJECT["optional-dependencies"]
    for engine, pins in ENGINES.items():
        version = next(p for p in pins if p.startswith(f"{engine}==")).split("==")[1]
        assert any(Requirement(r).specifier.contains(version) for r in extras[engine]), (engine, extras[engine])


UNREACHABLE = ("NewConnectionError", "Max retries exceeded", "Temporary failure in name resolution")
MISSING = re.compile(r"No matching distribution found for ([A-Za-z0-9_.\-]+)")


def dry_run(requirements: list[str], report: Path) -> tuple[dict[str, str] | None, str]:
    """pip's resolution of ``requirements`` from nothing installed: {name: version}, or None
    and pip's last words. Skips the test where the index cannot be reached."""
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                          "--no-build-isolation", "--disable-pip-version-check", "--report", str(report), *requirements],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    words = "\n".join(line for line in out.stderr.splitlines() if "is ignored" not in line)[-2000:]
    if out.returncode != 0:
        if any(u in out.stderr for u in UNREACHABLE):
            pytest.skip(f"the package index cannot be reached: {words[-300:]}")
        return None, words
    installs = json.loads(report.read_text())["install"]
    return {canonicalize_name(i["metadata"]["name"]): i["metadata"]["version"] for i in installs}, words


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_the_extra_resolves_with_the_engines_own_torch(engine, tmp_path):
    """``pip install --dry-run '.[engine]'``. Where the index lacks a version the engine
    itself pins of a package KVDrive does not require (vLLM 0.34.0's flashinfer-python
    0.7.3 here), the extra cannot resolve whatever KVDrive's metadata says: then KVDrive
    resolves with every other requirement of the engine, and the test warns which it left out."""
    torch_pin = next(str(r.specifier) for r in engine_requirements(engine) if canonicalize_name(r.name) == "torch")
    resolved, words = dry_run([f".[{engine}]"], tmp_path / "extra.json")
    left_out: list[str] = []
    while resolved is None:
        missing = MISSING.search(words)
        assert missing and f"(from {engine})" in words and canonicalize_name(missing[1]) not in OURS, (
            f"kvdrive[{engine}] does not resolve: {words}")
        left_out.append(missing[1])
        assert len(left_out) <= 3, f"the index lacks too much of {engine}'s pins to check: {left_out}"
        rest = [str(r) for r in engine_requirements(engine)
                if canonicalize_name(r.name) not in {canonicalize_name(n) for n in left_out}]
        resolved, words = dry_run([".", *rest], tmp_path / f"rest{len(left_out)}.json")
    if left_out:
        warnings.warn(f"{engine}: the index lacks {left_out}; kvdrive resolved with the rest of {engine}'s requirements",
                      stacklevel=1)
    else:
        assert resolved[canonicalize_name(engine)] == next(
            p for p in ENGINES[engine] if p.startswith(f"{engine}==")).split("==")[1]
    assert "kvdrive" in resolved
    assert f"=={resolved['torch']}" == torch_pin, (resolved["torch"], torch_pin)
