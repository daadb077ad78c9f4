"""attach(kernels=...): the compiled CPU kernels and the torch references decode alike."""

import pytest
import torch

from kvdrive.kernels import CpuKernels, ReferenceKernels, for_device
from kvdrive_client import AttachConfig, attach

from test_attach_tiny import generate, left_padded
from test_smollm2 import batch_from, max_logit_diff, run

# Logits: the fused low-rank scorer's exponential is a polynomial and the attention sums
# in another order, so selection scores and outputs differ by float rounding only.
TINY_LOGIT_TOL = 1e-4
SMOLLM2_LOGIT_TOL = 1e-3


def decode_with(kernels, model, store, ids, mask, new, **options):
    handle = attach(model, store, kernels=kernels, **options)
    try:
        out = generate(model, ids, mask, new=new)
        return out, handle.stats()
    finally:
        handle.detach()


# A random model's attention is near uniform, so low-rank page scores tie within the fused
# scorer's 1e-4 and a tie may break the other way; the low-rank index is checked at full
# budget here (every page selected, every one fetched: no cache) and sparse on SmolLM2.
@pytest.mark.parametrize("options", [dict(index="hierarchical", budget=0.0625, cache_multiplier=2),
                                     dict(index="meankey", budget=0.0625, cache_multiplier=2),
                                     dict(index="lowrank", budget=1.0, cache_multiplier=0)], ids=["hierarchical", "meankey", "lowrank"])
@pytest.mark.parametrize("lengths", [[900], [900, 610]], ids=["batch1", "batch2-padded"])
def test_cpu_and_reference_kernels_decode_a_tiny_model_alike(daemon, make_tiny, lengths, options):
    model = make_tiny("qwen2", layers=2)
    ids, mask = left_padded(lengths)
    with daemon.client() as store:
        cpu, cpu_stats = decode_with("cpu", model, store, ids, mask, 12, **options)
        ref, ref_stats = decode_with("reference", model, store, ids, mask, 12, **options)
    assert torch.equal(cpu.sequences, ref.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(cpu.logits, ref.logits)) < TINY_LOGIT_TOL
    assert cpu_stats["misses"] > 0
    for key in ("hits", "misses", "bytes_fetched", "attended_tokens"):
        assert cpu_stats[key] == ref_stats[key], key


def test_cpu_and_reference_kernels_decode_smollm2_alike(smollm2, license_ids, daemon):
    model, _ = smollm2
    ids, mask = batch_from(license_ids, [2048], [3000])
    outs, stats = {}, {}
    with daemon.client() as store:
        for kernels in ("cpu", "reference"):
            handle = attach(model, store, kernels=kernels, budget=0.0625)
            try:
                outs[kernels], stats[kernels] = run(model, ids, mask), handle.stats()
            finally:
                handle.detach()
    assert torch.equal(outs["cpu"].sequences, outs["reference"].sequences)
    assert max_logit_diff(outs["cpu"], outs["reference"]) < SMOLLM2_LOGIT_TOL
    assert stats["cpu"]["misses"] > 0
    assert stats["cpu"]["hits"] == stats["reference"]["hits"]


def test_kernels_are_chosen_once_per_device():
    assert isinstance(for_device("cpu"), CpuKernels)
    assert isinstance(for_device("cpu", "reference"), ReferenceKernels)
    assert isinstance(for_device("cuda"), ReferenceKernels)  # no GPU kernels yet
    with pytest.raises(ValueError, match="kernels='cpu' runs on CPU tensors"):
        for_device("cuda", "cpu")
    with pytest.raises(ValueError, match="choose one of auto, cpu, reference"):
        AttachConfig(kernels="gpu")
