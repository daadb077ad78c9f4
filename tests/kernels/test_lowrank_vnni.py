"""The VNNI dot products of the low-rank logits (:mod:`kvdrive.kernels.cpu.lowrank_vnni`): exact
sums where the weights round to themselves, over every odd shape a layout and a tile can take,
and nothing written past the tokens asked for."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

from kvdrive.kernels import reference as ref
from kvdrive.kernels.cpu import lowrank_vnni as vnni

needs_vnni = pytest.mark.skipif(not vnni.available(), reason="no AVX-512 VNNI and VBMI on this host")


# (int8, int4, int2 channels): Gemma 3's default, head dim 128's, an odd int4 count and odd row
# pairs, a short int2 row, no int4 channels, no int2 channels.
LAYOUTS = [(4, 52, 52), (2, 28, 24), (2, 5, 7), (1, 5, 3), (0, 0, 6), (1, 7, 0)]


@needs_vnni
@pytest.mark.parametrize("wide, n4, narrow", LAYOUTS)
@pytest.mark.parametrize("heads", [4, 7, 2, 1])
@pytest.mark.parametrize("t0, t1", [(0, 1024), (3, 40), (0, 16), (17, 18), (5, 1030)])
def test_vnni_logits_are_exact_where_the_weights_round_to_themselves(wide, n4, narrow, heads, t0, t1):
    """Weights of -127, 0 and 127 are their own int8 codes at every step the kernel can choose,
    so each logit must be the exact integer dot product of the weights and the channels' values:
    a code or a weight in the wrong lane, a row pair or int2 row left out, a masked tail read or
    written wrong, shows. The logits are added to what ``out`` held; past ``t1 - t0`` nothing changes."""
    rng = np.random.default_rng(wide + 7 * n4 + 31 * narrow + heads + t0 + t1)
    rows4, rows2 = (n4 + 1) // 2, (narrow + 3) // 4
    codes = rng.integers(-128, 128, (wide + rows4 + rows2, t1), dtype=np.int8)  # rows end at t1: no slack
    w = rng.choice(np.array([-127.0, 0.0, 127.0], np.float32), (heads, wide + n4 + narrow))
    w4 = np.empty((heads, 4 * ((rows4 + 1) // 2)), np.int8)
    w2 = np.empty((heads, 4 * rows2), np.int8)
    sc = np.empty((heads, 5), np.float32)
    vnni._vnni_weights(w, wide, narrow, w4, w2, sc)
    n = t1 - t0
    out = np.full((heads, n + 20), 7.0, np.float32)
    for g0 in range(0, heads, 4):
        vnni._vnni_dot(min(4, heads - g0), codes, wide, rows4, rows2, w4, w2, sc, g0, t0, t1, out)
    layout = ref.SketchLayout(wide + n4 + narrow, wide, narrow)
    values = ref.unpack_lowrank_codes(torch.from_numpy(codes), layout).numpy()[wide:, t0:t1]
    expect = 7.0 + w[:, wide:].astype(np.int64) @ values.astype(np.int64)
    assert np.array_equal(out[:, :n], expect.astype(np.float32))
    assert np.all(out[:, n:] == 7.0)


@needs_vnni
def test_vnni_weights_round_each_half_to_its_own_step():
    """A head whose leading int4 channels are 100 times its trailing ones keeps the trailing
    ones to within half of their own step (their largest over 127), not the leading ones'."""
    wide, n4, narrow = 0, 16, 8
    w = np.ones((1, n4 + narrow), np.float32)
    w[0, :8] = 100.0  # int4 rows 0-3: lane pairs 0 and 1, the first half
    w[0, 8:n4] = np.linspace(-1.0, 1.0, 8)
    w4, w2, sc = np.empty((1, 16), np.int8), np.empty((1, 8), np.int8), np.empty((1, 5), np.float32)
    vnni._vnni_weights(w, wide, narrow, w4, w2, sc)
    assert sc[0, 0] == pytest.approx(100 / 127) and sc[0, 1] == pytest.approx(1 / 127)
    trailing = w4[0, 8:].astype(np.float32) * sc[0, 1]  # lanes of pairs 2 and 3
    assert np.allclose(np.sort(trailing), np.sort(w[0, 8:n4]), atol=sc[0, 1] / 2 + 1e-7)


def test_vnni_is_available_only_where_numba_targets_every_feature_it_needs(monkeypatch):
    """Features set for numba decide, not the host's: a target without VBMI (Cascade Lake has
    VNNI without it) or a named CPU without features gets the passes."""
    check = vnni.available.__wrapped__
    monkeypatch.setattr(numba.config, "CPU_FEATURES", "+avx512f,+avx512bw,+avx512vl,+avx512vnni,-avx512vbmi")
    assert not check()
    monkeypatch.setattr(numba.config, "CPU_FEATURES", "+avx512f,+avx512bw,+avx512vl,+avx512vnni,+avx512vbmi")
    assert check()
    monkeypatch.setattr(numba.config, "CPU_FEATURES", "")
    monkeypatch.setattr(numba.config, "CPU_NAME", "skylake")
    assert not check()


def test_vnni_needs_an_llvm_that_takes_its_intrinsics(monkeypatch):
    """numba's LLVM must verify a module calling the kernel's intrinsics as they are declared
    (masked loads named for opaque pointers from LLVM 15 on, typed ones before; ``vpdpbusd``
    with 32-bit lanes, as LLVM 20 has it and LLVM 22 still reads); with none it verifies,
    the passes run instead."""
    assert vnni._pointer_kind() is not None, "the LLVM of the locked numba verifies one of the two forms"
    features = "+avx512f,+avx512bw,+avx512vl,+avx512vnni,+avx512vbmi"
    monkeypatch.setattr(numba.config, "CPU_FEATURES", features)
    assert vnni.available.__wrapped__()
    monkeypatch.setattr(vnni, "_pointer_kind", lambda: None)
    assert not vnni.available.__wrapped__()
