"""KVDrive's Triton launches as torch custom ops, so that a decode step's device work traces.

Every function here that launches Triton kernels does so through a torch custom op in the
``kvdrive`` namespace (``kvdrive::attention``, ``kvdrive::lowrank_scores``,
``kvdrive::choose_pages``, ``kvdrive::step_pages``, ``kvdrive::place``, ``kvdrive::land``,
``kvdrive::append``, ``kvdrive::encode_page``), registered where the kernels are defined. An op takes tensors and
sizes only, allocates nothing and declares the tensors it writes, so that ``torch.compile``
(and CUDA graph capture, which needs the same: no host synchronisation, no allocation that
depends on data) takes a layer's device work between two host interactions as one graph.
They are opaque custom ops, not ``torch.library.triton_op``: ``wrap_triton`` cannot trace a
kernel that Triton's interpreter runs, and the interpreter is how the CI checks them.

:func:`registered` names them (importing every Triton module registers them).
"""

from __future__ import annotations

import torch

from kvdrive.kernels import triton_index, triton_kernels, triton_placement, triton_topk, triton_window  # noqa: F401

OPS = ("attention", "lowrank_scores", "choose_pages", "place", "land", "append", "encode_page", "step_pages")


def registered() -> list[str]:
    """The ``kvdrive::`` ops that exist now (all of :data:`OPS` once this module is imported)."""
    return [name for name in OPS if hasattr(torch.ops.kvdrive, name)]
