"""The kernels' code generation: 512-bit vectors where the host has AVX-512 unless told otherwise, and the
per-machine cache of compiled kernels under KVDrive's cache directory unless NUMBA_CACHE_DIR says otherwise."""

import os
import re
import subprocess
import sys
from importlib.util import find_spec
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvdrive.kernels import jit
from kvdrive.protocol import jit_cache

PROBE = ("import logging, sys; logging.basicConfig(stream=sys.stderr);"
         "import numba; from kvdrive.kernels import cpu;"
         "print(cpu.VECTOR_WIDTH); print(numba.config.CPU_FEATURES)")


def probe(**env) -> tuple[str, str, str]:
    e = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CPU_NAME", "NUMBA_CPU_FEATURES", jit.VECTOR_ENV)}
    e.update(env)
    proc = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=e, timeout=300)
    assert proc.returncode == 0, proc.stderr
    width, features = proc.stdout.strip().splitlines()
    return width, features, proc.stderr


def test_default_allows_512_bit_vectors_on_avx512_hosts_only():
    width, features, _ = probe()
    wide = jit.wide_vector_features()
    if wide is None:
        assert width.startswith("LLVM's default") and features == "None"
    else:
        assert width == "512-bit vectors" and features == wide and features.endswith(",-prefer-256-bit")


def test_256_keeps_llvms_choice_and_a_bad_value_is_named():
    width, features, _ = probe(**{jit.VECTOR_ENV: "256"})
    assert width == f"LLVM's default vector width ({jit.VECTOR_ENV}=256)" and features == "None"
    _, _, err = probe(**{jit.VECTOR_ENV: "1024"})
    assert f"{jit.VECTOR_ENV}='1024' is neither 256 nor 512" in err


def test_the_users_numba_cpu_settings_are_left_alone():
    wide = jit.wide_vector_features()
    if wide is None:
        pytest.skip("needs an AVX-512 host")
    own = wide.replace(",-prefer-256-bit", "")
    width, features, _ = probe(NUMBA_CPU_FEATURES=own)
    assert width.startswith("NUMBA_CPU_NAME / NUMBA_CPU_FEATURES") and features == own


# ---------------------------------------------------------------- where compiled kernels are kept

CACHE_PROBE = ("import logging, os, subprocess, sys; logging.basicConfig(stream=sys.stderr);{first}"
               "from kvdrive.kernels import cpu; import kvstored.block_keys as bk; import kvdrive.protocol.copy as pc;"
               "print(os.environ.get('NUMBA_CACHE_DIR', '')); print(cpu._place.stats.cache_path);"
               "print(bk._find.stats.cache_path); print(pc._stream_range.stats.cache_path);"
               "print(subprocess.run([sys.executable, '-c', 'import kvstored.block_keys as bk;"
               "print(bk._find.stats.cache_path)'], capture_output=True, text=True, check=True).stdout.strip())")


def cache_probe(tmp_path, first: str = "", **env) -> tuple[dict, str]:
    """Where a fresh process whose KVDrive cache is ``tmp_path / "kvdrive"`` keeps compiled
    functions, by package, and where a process it starts keeps kvstored's; and its stderr."""
    e = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "KVDRIVE_CACHE")}
    e.update(KVDRIVE_CACHE=str(tmp_path / "kvdrive"), **env)
    proc = subprocess.run([sys.executable, "-c", CACHE_PROBE.format(first=first)], capture_output=True, text=True,
                          env=e, timeout=300)
    assert proc.returncode == 0, proc.stderr
    names = ("variable", "kernels", "kvstored", "protocol", "started")
    return dict(zip(names, proc.stdout.rstrip("\n").split("\n"), strict=True)), proc.stderr


def digest_dir(tmp_path, package: str) -> Path:
    return tmp_path / "kvdrive" / "numba" / f"{package.rsplit('.', 1)[-1]}-{jit_cache.source_digest(package)}"


def test_each_package_caches_under_the_kvdrive_cache_apart_and_a_started_kvstored_in_its_own(tmp_path):
    """The client's kernels, kvstored's and the protocol's byte movers each cache under a
    digest of their own sources (and their callees'): a change to kvstored's recompiles
    kvstored's alone. Nothing is exported to the processes started (the embedded kvstored
    finds its own)."""
    where, _ = cache_probe(tmp_path)
    assert where["variable"] == "", "NUMBA_CACHE_DIR would send a started kvstored to the client's directory"
    for package, key in (("kvdrive.kernels", "kernels"), ("kvstored", "kvstored"), ("kvdrive.protocol", "protocol")):
        assert Path(where[key]).parent == digest_dir(tmp_path, package), where
    assert where["started"] == where["kvstored"]
    assert len({digest_dir(tmp_path, p) for p in jit_cache.CALLS}) == 3


def test_a_change_to_a_numba_source_gives_its_package_and_its_callers_a_fresh_cache(tmp_path, monkeypatch):
    """numba checks only the file defining a cached function, not those of the functions it
    compiled in: each version of a package's sources and its callees' caches apart, the
    other packages keep theirs, and only the most recently used few versions are kept."""
    src = {name: tmp_path / "src" / name for name in ("own", "callee")}
    for d in src.values():
        d.mkdir(parents=True)
        (d / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(jit_cache, "find_spec", lambda name: SimpleNamespace(submodule_search_locations=[str(src[name])]))
    monkeypatch.setattr(jit_cache, "CALLS", {"pkg.own": ("own", "callee"), "pkg.callee": ("callee",)})
    monkeypatch.setenv("KVDRIVE_CACHE", str(tmp_path / "cache"))
    base = tmp_path / "cache" / "numba"
    first, callee = jit_cache.cache_dir("pkg.own"), jit_cache.cache_dir("pkg.callee")
    assert first.is_dir() and first.parent == base and first.name.startswith("own-")
    assert jit_cache.cache_dir("pkg.own") == first
    (src["own"] / "sub").mkdir()
    (src["own"] / "sub" / "b.py").write_text("y = 2\n")  # a module anywhere under the package
    made = [first, jit_cache.cache_dir("pkg.own")]
    assert made[1] != first and first.is_dir() and jit_cache.cache_dir("pkg.callee") == callee
    (src["callee"] / "a.py").write_text("x = 2\n")  # a callee's change: its callers' code changes too
    made.append(jit_cache.cache_dir("pkg.own"))
    assert made[2] != made[1] and jit_cache.cache_dir("pkg.callee") != callee
    for i in range(jit_cache.KEPT_VERSIONS + 1):
        for age, p in enumerate(made):  # used in the order made, so that the order is certain
            if p.exists():
                os.utime(p, (1000 + age, 1000 + age))
        (src["own"] / "a.py").write_text(f"x = {i + 2}\n")
        made.append(jit_cache.cache_dir("pkg.own"))
    (keep := base / "not-a-digest").mkdir()
    (base / f"cpu_{'0' * 40}").mkdir()  # numba's own, from before the digests
    (base / ("0" * 16)).mkdir()  # an older KVDrive's, one for every package
    jit_cache.cache_dir("pkg.own")
    left = set(base.iterdir()) - {p for p in base.iterdir() if p.name.startswith("callee-")}
    assert left == {keep, made[-1], *made[-1 - jit_cache.KEPT_VERSIONS:-1]}
    assert (base / f"callee-{jit_cache.source_digest('pkg.callee')}").is_dir(), "another package's cache was pruned"


def test_a_numba_cache_dir_the_user_set_is_kept(tmp_path):
    own = tmp_path / "own"
    where, _ = cache_probe(tmp_path, NUMBA_CACHE_DIR=str(own))
    assert where["variable"] == str(own)
    assert all(Path(where[k]).parent == own for k in ("kernels", "kvstored", "protocol", "started")), where
    assert not (tmp_path / "kvdrive").exists()


def test_numba_imported_first_changes_nothing_and_a_cache_dir_set_in_its_config_is_kept(tmp_path):
    where, err = cache_probe(tmp_path, first="import numba;")
    assert Path(where["kernels"]).parent == digest_dir(tmp_path, "kvdrive.kernels") and where["variable"] == ""
    assert "numba" not in err, err
    own = tmp_path / "config"
    where, _ = cache_probe(tmp_path, first=f"import numba; numba.config.CACHE_DIR = {str(own)!r};")
    assert all(Path(where[k]).parent == own for k in ("kernels", "kvstored", "protocol")), where


def test_every_module_that_caches_says_where_before_its_definitions_and_calls_only_what_its_digest_covers():
    """A module that defines cached numba functions points numba at its package's directory
    (jit_cache.use) after its imports and before its first definition, and the compiled
    functions it imports come from packages its package's digest covers."""
    caching = {}
    for package in jit_cache.CALLS:
        root = Path(find_spec(package).submodule_search_locations[0])
        for path in sorted(root.rglob("*.py")):
            text = path.read_text()
            if re.search(r"@numba\.njit\([^)]*cache=True", text):
                mod = ".".join([package, *path.relative_to(root).with_suffix("").parts])
                caching[mod] = (package, text)
    assert len(caching) >= 14, sorted(caching)
    for mod, (package, text) in caching.items():
        use = text.find(f'\njit_cache.use("{package}")')
        first = re.search(r"^@(numba\.njit|intrinsic|overload)", text, re.M)
        assert 0 < use < first.start(), f"{mod}: no jit_cache.use({package!r}) before its first definition"
        assert not re.search(r"^(from|import) ", text[use:], re.M), f"{mod}: an import after jit_cache.use"
        for target in re.findall(r"^from ((?:kvdrive|kvstored)[\w.]*) import", text, re.M):
            if target in caching:
                assert caching[target][0] in jit_cache.CALLS[package], f"{mod} calls {target}: not in its digest"
