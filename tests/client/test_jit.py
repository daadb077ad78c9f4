"""The kernels' code generation setting: 512-bit vectors where the host has AVX-512, unless told otherwise."""

import os
import subprocess
import sys

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
