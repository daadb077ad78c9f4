"""The benchmarks' pass/fail targets, one group per benchmark.

A ratio target reads ``measured / baseline >= target`` (``<=`` where the comment says
at most). The runners print each target next to what they measured; this module holds
the numbers only, so it imports nothing heavy (``kvdrive-bench store`` needs no torch).
"""

from __future__ import annotations

from dataclasses import dataclass


def verdict(ok: bool) -> str:
    """The word a target line ends with."""
    return "PASS" if ok else "MISS"


# ---------------------------------------------------------------- kvdrive-bench store

TARGET_DRAM_VS_MEMCPY = 0.5  # DRAM-tier sparse get GB/s over a memcpy of as many bytes
TARGET_PACKED_VS_TOKEN = 3.0  # SSD get of cluster-packed pages over the same get from a token-order put
TARGET_PACKED_VS_SEQ = 0.6  # SSD get of cluster-packed pages over sequential O_DIRECT reads

# ---------------------------------------------------------------- kvdrive-bench fidelity

TARGET_RECALL_VS_MEANKEY = 0.97  # hierarchical recall over meankey's
TARGET_INDEX_VS_QUEST = 0.5  # at most: hierarchical index_bytes over quest's
TARGET_SELECT_SPEEDUP = 2.0  # quest's select_ms over hierarchical's
TARGET_LOOKAHEAD_VS_BELADY = 0.97  # lookahead eviction's hit rate over belady's, at cache window TARGET_WINDOW
TARGET_WINDOW = 4  # the cache window (x k pages) of the eviction target
# The best selector (an IndexKind value) against dense attention and the oracle, at the target context.
TARGET_BEST = "lowrank"
TARGET_DLOSS_BUDGET = 0.0625  # the budget of the best selector's dloss / kl, index size and select_ms targets
TARGET_INDEX_VS_FP16_KV = 0.05  # at most: the best selector's index_bytes over the full K+V in fp16
TARGET_RECALL_VS_ORACLE = 0.93  # the best selector's recall over the oracle's
TARGET_SELECT_VS_HIERARCHICAL = 1.25  # at most: the best selector's select_ms over hierarchical's
# Over several windows (kvdrive-bench fidelity --corpus / --copy), per budget: at most, the best
# selector's largest dloss over the windows, and that window's dloss over the oracle's there.
TARGET_WORST = {0.0625: (0.10, 0.05), 0.03125: (0.15, 0.10)}
TARGET_WORST_OTHER = (0.15, 0.10)  # the same at any other budget
TARGET_MEAN_DLOSS = 0.05  # at most: the best selector's mean dloss over the windows
# Copy texts (--copy), per budget: at least, the best selector's greedy token equal to dense's
# (top1) on this share of the decoded tokens, on every window.
TARGET_COPY_MATCH = {0.0625: 0.95, 0.03125: 0.90}


@dataclass(frozen=True)
class DenseTarget:
    """Per model: the context of the targets against dense attention, and the best selector's bounds there."""

    context: int
    dloss: float  # at most: mean NLL over dense's (nats)
    kl: float  # at most: mean KL(dense || KVDrive)


DENSE_TARGETS = {
    "smollm2": DenseTarget(7168, 0.15, 0.08),
    # 32K: the model's 32768 positions less room for the decoded tokens, in whole pages.
    "gemma3-270m": DenseTarget(32640, 0.10, 0.05),
}

# ---------------------------------------------------------------- kvdrive-bench decode

TARGET_SPEEDUP_VS_SHADOWKV = 2.0  # target 1: (b) dram, kvdrive tok/s over shadowkv's
TARGET_BYTES_VS_X0 = 0.25  # target 1: at most: (b) dram, kvdrive bytes fetched per step over quest's (no cache)
TARGET_SSD_VS_DRAM = 0.85  # target 2: (b) kvdrive tok/s on the DRAM+SSD tier over the DRAM tier's
TARGET_PIPELINE_VS_LONGEST = 1.15  # target 3: at most: attention layers' time over the longest pipeline stage's
TARGET_C_VS_B = 0.5  # target 4: (c) kvdrive tok/s (KV 3x the DRAM tier) over (b) dram's
TARGET_PROFILE_VS_UNIFORM = 1.0  # target 5: at most: bytes fetched per step with a window profile over uniform's
TARGET_A_VS_SHADOWKV = 1.0  # target 6: (a) kvdrive tok/s over shadowkv's, at batch TARGET_A_BATCH
TARGET_A_BATCH = 4  # target 6's batch (other batches print as information)
TARGET_INDEX_SPEED = 0.9  # (a): kvdrive tok/s with the default index over the hierarchical index's
TARGET_SKETCH_SPEED = 0.95  # (a): kvdrive tok/s with the default sketch over the earlier rank-16 int8/int4 one's
TARGET_OVERLAP_GAP = 0.05  # at most: |previous-step selection overlap of (b) - that of (a)|
