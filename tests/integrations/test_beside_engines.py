"""KVDrive installs beside each engine's own pins: every requirement the two share has a
version both accept (the engine's torch, numba and transformers above all), read from the
pinned engine's published metadata. A resolver dry run of the extras needs the package
index and minutes; docs/engines.md says how to run it."""

from __future__ import annotations

import tomllib
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
