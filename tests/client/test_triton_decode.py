"""attach(kernels="triton") under Triton's interpreter decodes as kernels="cpu" does.

The Triton kernels (attention, low-rank scoring) run on CPU tensors here, under the
interpreter; they have not run on a GPU yet. The interpreter is chosen when triton is
first imported, and torch imports it early (``torch._dynamo``, which these tests' model
fixtures load): run with ``TRITON_INTERPRET=1`` in the environment; without it these
tests are skipped.
"""

import pytest
import torch

from kvdrive_client import attach

from test_attach_tiny import generate, left_padded
from test_smollm2 import batch_from, max_logit_diff

pytest.importorskip("triton")
try:
    from kvdrive.kernels import triton_kernels as tk
    from kvdrive.kernels import triton_placement, triton_topk
    NOT_INTERPRETED = None if tk.INTERPRETED else (
        "the Triton kernels need Triton's interpreter here: run with TRITON_INTERPRET=1 in the environment "
        "(torch._dynamo imports triton, before this module)")
except ImportError as e:
    NOT_INTERPRETED = f"the Triton kernels do not load: {e}"
# The CPU set's low-rank scores by its int16 passes on every host (a VNNI host's int8 weights
# round more coarsely and may swap a page at a near tie: tests/client/conftest.py).
pytestmark = [pytest.mark.skipif(NOT_INTERPRETED is not None, reason=NOT_INTERPRETED or ""),
              pytest.mark.usefixtures("int16_lowrank")]

NEW = 8
# Logits: both sets compute in float32; the CPU's low-rank exponential is a polynomial
# (1e-4 relative) and the sums run in other orders (the CPU attends in two parts).
TINY_LOGIT_TOL = 1e-4
SMOLLM2_LOGIT_TOL = 1e-3
# SmolLM2 prompt length. The interpreter runs every program of every launch in Python, at a
# cost per operation that hardly depends on the tiles' sizes: a decode step costs about the
# same at any length, and the pair of tests below took 2.5 minutes at 512 tokens, 3.5 at 1024.
SMOLLM2_TOKENS = 512
# ... and in proportion to the layers: SmolLM2's first 4 of 30 layers, its trained weights,
# keep the pair of tests under a minute (all 30 took over 6 on a 2-core host).
SMOLLM2_LAYERS = 4
GEMMA3_TOKENS = 1024


@pytest.fixture(scope="module")
def smollm2_first_layers():
    """SmolLM2 cut to its first SMOLLM2_LAYERS layers (its own instance: the session's is whole)."""
    from kvdrive_client.models import load_smollm2

    model, tok = load_smollm2()
    model.model.layers = model.model.layers[:SMOLLM2_LAYERS]
    model.config.num_hidden_layers = SMOLLM2_LAYERS
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:SMOLLM2_LAYERS]
    return model, tok


@pytest.fixture
def triton_calls(monkeypatch):
    """Calls of each Triton kernel wrapper, counted."""
    calls = {}

    def counted(module, name):
        fn = getattr(module, name)

        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return fn(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    for name in ("sparse_attention", "dense_attention", "lowrank_scores", "lowrank_select"):
        counted(tk, name)
    counted(triton_topk, "choose_pages")
    counted(triton_placement, "place")
    return calls


def decode_with(kernels, model, store, ids, mask, **options):
    handle = attach(model, store, kernels=kernels, **options)
    try:
        return generate(model, ids, mask, new=NEW), handle.stats()
    finally:
        handle.detach()


def assert_alike(out, stats, tol, calls):
    assert all(calls.get(name, 0) > 0 for name in ("sparse_attention", "lowrank_scores", "choose_pages", "place")), \
        calls
    assert torch.equal(out["cpu"].sequences, out["triton"].sequences)
    assert max_logit_diff(out["cpu"], out["triton"]) < tol
    assert stats["triton"]["steps"] == NEW - 1
    for key in ("hits", "misses", "attended_tokens"):
        assert stats["cpu"][key] == stats["triton"][key], key


# A random model's attention is near uniform, so low-rank page scores tie within the CPU
# scorer's 1e-4 and a tie may break either way: the low-rank index at full budget here
# (every page selected and fetched, no cache), sparse selection on SmolLM2.
@pytest.mark.parametrize("lengths", [[900], [900, 610]], ids=["batch1", "batch2-padded"])
def test_triton_and_cpu_kernels_decode_a_tiny_model_alike(daemon, make_tiny, triton_calls, lengths):
    model = make_tiny("qwen2", layers=2)
    ids, mask = left_padded(lengths)
    out, stats = {}, {}
    with daemon.client() as store:
        for kernels in ("cpu", "triton"):
            out[kernels], stats[kernels] = decode_with(kernels, model, store, ids, mask, index="lowrank", budget=1.0,
                                                       cache_multiplier=0)
    assert_alike(out, stats, TINY_LOGIT_TOL, triton_calls)


# SmolLM2 (4 of its layers) and Gemma 3 270M, whose sliding-window layers stay the model's
# own while KVDrive serves its global layers: sparse selection on trained attention.
@pytest.mark.parametrize("lengths", ["batch1", "batch2-padded"])
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_triton_and_cpu_kernels_decode_trained_models_alike(request, daemon, triton_calls, which, lengths):
    (model, _), ids_of, n = ((request.getfixturevalue("smollm2_first_layers"), "license_ids", SMOLLM2_TOKENS)
                             if which == "smollm2" else
                             (request.getfixturevalue("gemma3"), "license_ids_gemma3", GEMMA3_TOKENS))
    rows = [n] if lengths == "batch1" else [n, n * 3 // 4]
    ids, mask = batch_from(request.getfixturevalue(ids_of), rows, [3000, 9000][: len(rows)])
    out, stats = {}, {}
    with daemon.client() as store:
        for kernels in ("cpu", "triton"):
            out[kernels], stats[kernels] = decode_with(kernels, model, store, ids, mask, budget=0.0625)
    assert_alike(out, stats, SMOLLM2_LOGIT_TOL, triton_calls)
    assert stats["triton"]["misses"] > 0


@pytest.fixture(scope="module")
def license_ids_gemma3(gemma3):
    from kvdrive_client.models import license_text

    _, tok = gemma3
    return tok(license_text(), return_tensors="pt").input_ids[0]
