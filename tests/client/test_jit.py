"""The kernels' code generation: 512-bit vectors where the host has AVX-512 unless told otherwise, and the
per-machine cache of compiled kernels under KVDrive's cache directory unless NUMBA_CACHE_DIR says otherwise."""

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvdrive.kernels import jit

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

CACHE_PROBE = ("import logging, os, sys; logging.basicConfig(stream=sys.stderr);{first}"
               "from kvdrive.kernels import cpu;"
               "print(os.environ.get('NUMBA_CACHE_DIR', '')); print(cpu._place.stats.cache_path)")


def cache_probe(tmp_path, first: str = "", **env) -> tuple[str, str, str]:
    """(NUMBA_CACHE_DIR after the kernels loaded, the cache directory of a kernel, stderr) in a
    fresh process whose KVDrive cache is ``tmp_path / "kvdrive"``."""
    e = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "KVDRIVE_CACHE")}
    e.update(KVDRIVE_CACHE=str(tmp_path / "kvdrive"), **env)
    proc = subprocess.run([sys.executable, "-c", CACHE_PROBE.format(first=first)], capture_output=True, text=True,
                          env=e, timeout=300)
    assert proc.returncode == 0, proc.stderr
    variable, kernel_dir = proc.stdout.rstrip("\n").split("\n")
    return variable, kernel_dir, proc.stderr


def test_kernels_cache_under_the_kvdrive_cache_and_processes_started_inherit_it(tmp_path):
    variable, kernel_dir, err = cache_probe(tmp_path)
    target = tmp_path / "kvdrive" / "numba" / jit.source_digest()
    assert variable == str(target), "the embedded kvstored inherits the variable: its kernels cache there too"
    assert Path(kernel_dir).parent == target and "numba was imported before" not in err


def test_a_change_to_any_numba_source_gives_a_fresh_cache_and_old_ones_are_pruned(tmp_path, monkeypatch):
    """numba checks only the file defining a cached function, not those of the functions it
    compiled in: each version of the sources caches apart, and only the most recently used
    few versions are kept."""
    kernels = tmp_path / "src"
    kernels.mkdir()
    (kernels / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(jit, "find_spec", lambda name: SimpleNamespace(submodule_search_locations=[str(kernels)]))
    monkeypatch.setenv("KVDRIVE_CACHE", str(tmp_path / "cache"))
    first = jit._cache_dir()
    assert first.is_dir() and first.parent == tmp_path / "cache" / "numba" and jit._cache_dir() == first
    (kernels / "sub").mkdir()
    (kernels / "sub" / "b.py").write_text("y = 2\n")  # a callee's module, anywhere under a package
    made = [first, jit._cache_dir()]
    assert made[1] != first and first.is_dir()
    for i in range(jit.KEPT_VERSIONS + 1):
        for age, p in enumerate(made):  # used in the order made, so that the order is certain
            if p.exists():
                os.utime(p, (1000 + age, 1000 + age))
        (kernels / "a.py").write_text(f"x = {i + 2}\n")
        made.append(jit._cache_dir())
    (keep := tmp_path / "cache" / "numba" / "not-a-digest").mkdir()
    (tmp_path / "cache" / "numba" / f"cpu_{'0' * 40}").mkdir()  # numba's own, from before the digests
    jit._cache_dir()
    left = set((tmp_path / "cache" / "numba").iterdir())
    assert left == {keep, made[-1], *made[-1 - jit.KEPT_VERSIONS:-1]}


def test_a_numba_cache_dir_the_user_set_is_kept(tmp_path):
    own = tmp_path / "own"
    variable, kernel_dir, _ = cache_probe(tmp_path, NUMBA_CACHE_DIR=str(own))
    assert variable == str(own) and Path(kernel_dir).parent == own
    assert not (tmp_path / "kvdrive").exists()


def test_numba_imported_first_still_caches_the_kernels_there_and_says_what_it_cannot_do(tmp_path):
    variable, kernel_dir, err = cache_probe(tmp_path, first="import numba;")
    assert Path(kernel_dir).parent == tmp_path / "kvdrive" / "numba" / jit.source_digest()
    assert variable == "", "set after numba's import, the variable would reset numba's settings at the next compile"
    assert "numba was imported before KVDrive's kernels" in err and "embedded kvstored" in err
