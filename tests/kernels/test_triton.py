"""The Triton kernels (``kvdrive.kernels.triton_kernels``) without a GPU.

Under Triton's interpreter on CPU tensors, each kernel against its torch reference, over
inputs ragged the ways a decode step's are (pages of -1, left padding, no pages, no
local window, a head with nothing valid, split and unsplit chunks). Every buffer a kernel
writes is poisoned with NaN and fenced by NaN guards first: the interpreter does not
catch a missed or an out-of-bounds write. Then each kernel compiled ahead of time for
sm_90, its registers and spills read from the cubin. float32 and float16 only: the
interpreter's bfloat16 ``tl.dot`` is wrong (the kernels widen bfloat16 there).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading

import pytest
import torch

if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the interpreter is chosen at triton's first import
pytest.importorskip("triton")

from kvdrive.kernels import for_device  # noqa: E402
from kvdrive.kernels import reference as ref  # noqa: E402

from kernel_cases import EMPTY_ROW, PADDED_ROW, lowrank_case, random_slots, widened  # noqa: E402
from tolerances import tolerance  # noqa: E402

try:
    from kvdrive.kernels import triton_kernels as tk
    NOT_INTERPRETED = None if tk.INTERPRETED else (
        "the Triton kernels need Triton's interpreter here: run with TRITON_INTERPRET=1 in the environment "
        "(torch._dynamo imports triton, before this module)")
except ImportError as e:
    tk, NOT_INTERPRETED = None, f"the Triton kernels do not load: {e}"
interpreted = pytest.mark.skipif(NOT_INTERPRETED is not None, reason=NOT_INTERPRETED or "")

NAN = float("nan")
DTYPES = (torch.float32, torch.float16)


class Guarded:
    """Stands in for the kernels' buffer allocation: NaN-filled buffers between NaN guards."""

    GUARD = 97

    def __init__(self) -> None:
        self.buffers: list[tuple[torch.Tensor, int]] = []

    def __call__(self, shape, device):
        n = math.prod(shape)
        base = torch.full((n + 2 * self.GUARD,), NAN, dtype=torch.float32, device=device)
        self.buffers.append((base, n))
        return base[self.GUARD : self.GUARD + n].view(shape)

    def check(self) -> None:
        assert self.buffers
        for base, n in self.buffers:
            assert base[: self.GUARD].isnan().all() and base[self.GUARD + n :].isnan().all(), "write out of bounds"


@pytest.fixture
def guarded(monkeypatch):
    g = Guarded()
    monkeypatch.setattr(tk, "_scratch", g)
    monkeypatch.setattr(tk, "_workspaces", threading.local())  # no buffer kept from an earlier test
    yield g
    g.check()


def _close(got, expect, kernel, dtype, **kwargs):
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expect.float(), **tolerance(kernel, dtype), **kwargs)


# ---------------------------------------------------------------- attention


def _attention_case(seed, dtype, k, local, page=8, d=32, g=3, spare=3):
    """Cache slots (views of a larger cache, as a micro-batch's are) and a local window;
    ``valid`` masks -1 slots and has ``spare`` columns past the attended tokens. Row 1 is
    left-padded (its first pages invalid); head 1 of row 0 has nothing valid."""
    gen = torch.Generator().manual_seed(seed)
    B, H, C = 3, 2, 10
    kc, vc = (torch.randn(B + 1, H, C, page, d, generator=gen).to(dtype)[1:] for _ in range(2))
    lk, lv = (torch.randn(B, H, local + 2, d, generator=gen).to(dtype)[:, :, 1 : local + 1] for _ in range(2))
    slots = random_slots(gen, B, H, k, C)
    query = (torch.randn(B, H, g, d, generator=gen) * 2).to(dtype)
    valid = torch.rand(B, H, k * page + local + spare, generator=gen) > 0.2
    if k > 2:
        slots[2, 0, 1] = -1
        slots[2, 1, k - 1] = -1
        valid[2, 0, page : 2 * page] = False
        valid[2, 1, (k - 1) * page : k * page] = False
        valid[1, :, : 2 * page] = False
    valid[0, 1] = False
    return query, kc, vc, slots, lk, lv, valid


# (k pages, local window, page size, head dim, query heads, splits): one chunk and three,
# no local window, no pages, both, and page sizes / head dims / query heads that are not
# powers of two (padded in the kernel).
ATTENTION_CASES = [
    (4, 7, 8, 32, 3, None),
    (4, 7, 8, 32, 3, 3),
    (5, 0, 8, 32, 4, 2),
    (0, 9, 8, 32, 3, 2),
    (3, 5, 5, 24, 5, 3),
]


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k, local, page, d, g, splits", ATTENTION_CASES)
def test_attention_matches_reference(guarded, dtype, k, local, page, d, g, splits):
    query, kc, vc, slots, lk, lv, valid = _attention_case(k * 7 + local, dtype, k, local, page, d, g)
    out = tk.sparse_attention(query, kc, vc, slots, lk, lv, valid, 0.17, block_n=16, num_splits=splits)
    expect = ref.sparse_attention(*widened(query, kc, vc), slots, *widened(lk, lv), valid, 0.17)
    assert out.shape == query.shape
    _close(out, expect, "triton_attention", dtype)  # zeros where nothing is valid, in both
    assert torch.equal(out[0, 1], torch.zeros_like(out[0, 1]))


@interpreted
@pytest.mark.parametrize("k, local, splits", [(4, 7, None), (4, 7, 3), (0, 9, 2), (5, 0, 2)])
def test_attention_by_token_validity_matches_reference(guarded, k, local, splits):
    """Validity worked out in the kernel from the sequence's real tokens, the pages (-1: none)
    and the window's start, as reference.attended_valid builds it; the real attended tokens
    added to a count, across splits."""
    page, num_pages = 8, 12
    query, kc, vc, slots, lk, lv, _ = _attention_case(k + local, torch.float32, k, local, page)
    slots = slots.clamp_min(0)  # as placed: a slot for every entry, the ones with no page masked
    gen = torch.Generator().manual_seed(k)
    pages = torch.stack([torch.randperm(num_pages, generator=gen)[:k] for _ in range(6)]).reshape(3, 2, k)
    if k > 2:
        pages[2, 0, 1] = pages[0, 1, 0] = -1
    local_start = num_pages * page
    tokens = torch.rand(3, local_start + local + 5, generator=gen) > 0.2  # spare tokens past t
    tokens[1, : 3 * page] = False
    attended = ref.attended_valid(tokens, pages, page, local_start, local_start + local)
    counts = torch.tensor([5, 7, 11])
    validity = tk.TokenValidity(tokens, pages, local_start, count=(counts, 1))
    out = for_device("cpu", "triton").attention(query, kc, vc, slots, lk, lv, validity, 0.17) if splits is None \
        else tk.sparse_attention(query, kc, vc, slots, lk, lv, validity, 0.17, block_n=16, num_splits=splits)
    expect = ref.sparse_attention(query, kc, vc, slots, lk, lv, attended, 0.17)
    _close(out, expect, "triton_attention", torch.float32)
    assert counts.tolist() == [5, 7 + int(attended.sum()), 11]


@interpreted
def test_attention_of_nothing_is_zeros(guarded):
    """No pages and no local window: no kernel runs; nothing valid anywhere: zeros from the kernel."""
    query, kc, vc, slots, lk, lv, valid = _attention_case(1, torch.float32, 0, 0)
    assert torch.equal(tk.sparse_attention(query, kc, vc, slots, lk, lv, valid, 0.17), torch.zeros(query.shape))
    query, kc, vc, slots, lk, lv, valid = _attention_case(1, torch.float32, 3, 4)
    out = tk.sparse_attention(query, kc, vc, slots, lk, lv, valid & False, 0.17, block_n=16, num_splits=2)
    assert torch.equal(out, torch.zeros(query.shape))


@interpreted
def test_dense_attention_matches_reference(guarded):
    gen = torch.Generator().manual_seed(3)
    B, H, G, N, D = 2, 2, 3, 37, 32
    query = torch.randn(B, H, G, D, generator=gen)
    keys, values = (torch.randn(B, H, N, D, generator=gen) for _ in range(2))
    valid = torch.rand(B, H, N, generator=gen) > 0.2
    valid[1, 0, :30] = False
    out = for_device("cpu", "triton").dense_attention(query, keys, values, valid, 0.17)
    _close(out, ref.decode_attention(query, keys, values, valid, 0.17), "triton_attention", torch.float32)


# ---------------------------------------------------------------- low-rank scores

# Seeds of kernel_cases.lowrank_case: (rank, int8, int2 channels, query heads) (27, 1, 12, 3)
# the default layout, (14, 2, 7, 3) int2 in a partial row and int4 with a spare nibble,
# (8, 8, 0, 3) all int8, (10, 0, 10, 3) all int2.
LOWRANK_SEEDS = [4, 9, 2, 10]


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("seed, splits", list(zip(LOWRANK_SEEDS, [None, 3, 1, 2])))  # tiles of 8 pages of 16
def test_lowrank_scores_match_reference(guarded, seed, splits, dtype):
    case = lowrank_case(seed, dtype)  # spare capacity past num_pages, which must not be read
    _check_lowrank_scores(case, splits, dtype)


# (rank, int8, int2 channels, query heads) whose code rows of each kind take more than one of
# the kernel's row chunks: Llama-3-8B's default sketch (2 int8, 28 int4, 24 int2 channels:
# 22 rows) and 20 int8 rows, 18 int4 rows and 17 int2 rows.
@interpreted
@pytest.mark.parametrize("shape", [(54, 2, 24, 4), (124, 20, 68, 3)], ids=str)
def test_lowrank_scores_over_several_row_chunks_match_reference(guarded, shape):
    assert tk.LOWRANK_ROW_CHUNK < ref.SketchLayout(*shape[:3]).rows
    _check_lowrank_scores(lowrank_case(11, shape=shape), None, torch.float32)


def _check_lowrank_scores(case, splits, dtype):
    got = tk.lowrank_scores(case.query, case.qproj, case.scale, case.scaling, case.codes, case.valid,
                            case.num_pages, case.page_size, case.layout, block_p=8, num_splits=splits)
    expect = case.reference_scores()
    assert got.shape == expect.shape
    _close(got, expect, "triton_lowrank_scores", dtype)  # -inf where the reference has it
    assert torch.isneginf(got[PADDED_ROW, :, :3]).all() and torch.isneginf(got[EMPTY_ROW]).all()


@interpreted
def test_lowrank_scores_of_no_pages_are_empty(guarded):
    case = lowrank_case(0)
    got = tk.lowrank_scores(case.query, case.qproj, case.scale, case.scaling, case.codes, case.valid, 0,
                            case.page_size, case.layout)
    assert got.shape == (*case.query.shape[:2], 0)


@interpreted
@pytest.mark.parametrize("k", [7, 0])
def test_lowrank_select_matches_reference(k):
    case = lowrank_case(4)
    gen = torch.Generator().manual_seed(k)
    selectable = torch.rand(case.codes.shape[0], case.num_pages, generator=gen) > 0.3
    cached = torch.randint(-1, case.num_pages, (*case.codes.shape[:2], 5), generator=gen)
    args = (case.qproj, case.scale, case.scaling, case.codes, case.valid, selectable, k, case.page_size, cached,
            case.layout)
    _, expect_top, expect_cached = ref.lowrank_select(case.query, *args)
    pages, top, cached_scores = for_device("cpu", "triton").lowrank_select(case.query, *args)
    tol = tolerance("triton_lowrank_scores", torch.float32)
    torch.testing.assert_close(top, expect_top, **tol)
    torch.testing.assert_close(cached_scores, expect_cached, **tol)
    scores = case.reference_scores()
    finite = torch.isfinite(top)
    assert selectable[:, None, :].expand_as(scores).gather(2, pages)[finite].all()
    torch.testing.assert_close(top[finite], scores.gather(2, pages)[finite], **tol)


@interpreted
@pytest.mark.parametrize("k, num_sink", [(7, 2), (0, 1), (40, 0)])
def test_choose_pages_matches_the_torch_choice(k, num_sink):
    """The sink pages, then the k best selectable pages, -1 where a row has fewer with a score
    (a row with three selectable pages, one with none, a page of -inf), as backends.with_sink
    of reference.topk_pages."""
    from kvdrive.kernels.backends import with_sink
    from kvdrive.kernels.triton_topk import choose_pages

    gen = torch.Generator().manual_seed(k)
    b, h, p = 4, 3, 37
    scores = torch.randn(b, h, p, generator=gen)
    scores[0, 1, 5] = float("-inf")
    selectable = torch.rand(b, p, generator=gen) > 0.3
    selectable[1] = False
    selectable[2] = False
    selectable[2, [3, 9, 30]] = True
    sink = torch.randint(0, 4, (b, num_sink), generator=gen)
    if num_sink:
        sink[3, 0] = -1
    pages, top = ref.topk_pages(scores.masked_fill(~selectable[:, None, :], ref.NEG_INF), k)
    expect = with_sink(sink, pages.masked_fill(top == ref.NEG_INF, -1))
    assert torch.equal(choose_pages(scores, selectable, k, sink), expect)


@interpreted
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_land_matches_reference(dtype):
    """Fetched pages into their cache rows, in a view of some batch rows (a micro-batch's)."""
    gen = torch.Generator().manual_seed(5)
    ref_k, ref_v = (torch.randn(3, 2, 6, 4, 8, generator=gen).to(dtype) for _ in range(2))
    k, v = ref_k.clone(), ref_v.clone()
    kv = torch.randn(5, 2, 4, 8, generator=gen)  # fetched in the model's dtype: converted on landing
    rows = torch.tensor([3, 0, 11, 7, 5])
    for_device("cpu", "reference").land(ref_k[1:], ref_v[1:], rows, kv)
    for_device("cpu", "triton").land(k[1:], v[1:], rows, kv)
    assert torch.equal(k, ref_k) and torch.equal(v, ref_v)


# ---------------------------------------------------------------- the kernel set


@interpreted
def test_triton_kernels_are_chosen_on_the_cpu_under_the_interpreter():
    kernels = for_device("cpu", "triton")
    assert isinstance(kernels, tk.TritonKernels) and not kernels.attends_in_parts
    assert kernels.attention_dtype(torch.float16) == torch.float32
    query, kc, vc, slots, lk, lv, valid = _attention_case(0, torch.float32, 3, 4)
    with pytest.raises(NotImplementedError):
        kernels.attention(query, kc, vc, slots, lk, lv, valid, 0.17, object())
    assert isinstance(for_device("cuda", "triton"), tk.TritonKernels)


def _python(code: str, interpret: bool = False) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_kernels_import_without_triton_and_refuse_the_cpu_without_the_interpreter():
    done = _python("import sys, kvdrive.kernels as k\n"
                   "assert 'triton' not in sys.modules\n"
                   "try:\n    k.for_device('cpu', 'triton')\nexcept ValueError as e:\n    print(e)\n")
    assert done.returncode == 0, done.stderr
    assert "TRITON_INTERPRET=1" in done.stdout


# ---------------------------------------------------------------- sm_90, ahead of time


def test_kernels_compile_for_sm90_without_spills():
    """Every kernel compiled for sm_90 (H100/H200) in the shapes KVDrive runs, in a process
    without the interpreter; registers and spills read from the cubin and ptxas."""
    done = _python("import json\nfrom kvdrive.kernels import triton_kernels as tk\n"
                   "missing = [t for t in ('ptxas', 'cuobjdump') if tk.nvidia_tool(t) is None]\n"
                   "print(json.dumps({'missing': missing} if missing else tk.sm90_reports()))\n")
    assert done.returncode == 0, done.stderr
    reports = json.loads(done.stdout)
    if "missing" in reports:
        pytest.skip(f"{' and '.join(reports['missing'])} not found: neither bundled with triton "
                    f"(backends/nvidia/bin) nor on the PATH")
    for name, r in reports.items():
        print(f"{name}: {r['registers']} registers, {r['shared']} B shared, spills {r['spill_stores']}/"
              f"{r['spill_loads']} B")
        warps = 8 if name.startswith(("place", "choose")) else 1 if name.startswith("append") else 4
        assert r["arch"] == "sm_90a" and r["num_warps"] == warps
        assert r["registers"] == r["ptxas_registers"] <= 255
        assert r["spill_stores"] == r["spill_loads"] == r["local"] == r["stack"] == 0, (name, r)
    assert {name.split()[0] for name in reports} == {"attention", "merge", "lowrank", "place", "choose", "step",
                                                     "encode", "append"}
