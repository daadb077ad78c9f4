"""numba kernels for the CPU, each tested against its torch reference (``reference.py``, or
for the cache placement :meth:`kvdrive_client.device_cache.DeviceCache._place_torch`).

One module per stage, as the Triton set: :mod:`.hierarchical` and :mod:`.lowrank` select
pages (the low-rank logits in :mod:`.lowrank_fused`, :mod:`.lowrank_passes`,
:mod:`.lowrank_vnni` and :mod:`.lowrank_mass`), :mod:`.placement` places them in the device
cache, :mod:`.attention` attends over them; :mod:`.common` holds the compiled helpers they
share and numba's code generation, :mod:`.threads` how a call is split across threads.

The names below are the package's interface. A test that replaces one of the private ones
(a compiled kernel, a threshold) must replace it in the module that looks it up, e.g.
``kvdrive.kernels.cpu.attention._sparse_attention``: replacing it here changes nothing.
"""

from kvdrive.kernels.cpu.common import BFLOAT16, FLOAT16, FLOAT32, VECTOR_WIDTH  # first: sets numba's code generation
from kvdrive.kernels.cpu.attention import PartialAttention, _sparse_attention, sparse_attention
from kvdrive.kernels.cpu.hierarchical import _hierarchical_select, hierarchical_select
from kvdrive.kernels.cpu.lowrank import (_lowrank_scores_fused, _lowrank_scores_passes, _lowrank_select_fused,
                                         _lowrank_select_passes, _work, lowrank_choose, lowrank_scores, lowrank_select)
from kvdrive.kernels.cpu.lowrank_passes import _PASS_TILE
from kvdrive.kernels.cpu.placement import _attended_valid, _place, attended_valid, place
from kvdrive.kernels.cpu.threads import kernel_threads, one_torch_thread

__all__ = ["BFLOAT16", "FLOAT16", "FLOAT32", "VECTOR_WIDTH", "PartialAttention", "attended_valid",
           "hierarchical_select", "kernel_threads", "lowrank_choose", "lowrank_scores", "lowrank_select",
           "one_torch_thread", "place", "sparse_attention"]
