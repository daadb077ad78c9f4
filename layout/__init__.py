"""KVDrive's on-SSD layout: pure bookkeeping, no I/O.

Primitives and their life cycle:

- :class:`Geometry` describes a sequence: layers, KV heads, head dim, dtype and
  tokens per page. A *block* is the K and V of one page of one (layer, KV head).
- :class:`ExtentAllocator` hands out 4 KiB-aligned byte ranges of the data file
  and takes them back (free space is reused, neighbours coalesce).
- :func:`packing_order` decides the slot order of the pages written together in
  one extent: pages of one cluster side by side, in the client's packing order
  (semantic-contiguous extent packing).
- :func:`plan_reads` turns the file locations of a sparse set of blocks into the
  fewest large reads: adjacent blocks merge, small gaps are read through.

The daemon (``kvstored``) owns the bytes; this package only decides where they go.
"""

if __name__ == "layout":  # imported from the repository root by its bare folder name: see tools/checkout.py
    from tools.checkout import step_aside

    step_aside(__name__)
else:
    from kvdrive.layout.allocator import ExtentAllocator, SpaceError
    from kvdrive.layout.coalesce import ReadPlan, plan_reads
    from kvdrive.layout.format import ALIGN, FORMAT_VERSION, align_up
    from kvdrive.layout.geometry import DType, Geometry
    from kvdrive.layout.packing import packing_order

    __all__ = [
        "ALIGN",
        "FORMAT_VERSION",
        "DType",
        "ExtentAllocator",
        "Geometry",
        "ReadPlan",
        "SpaceError",
        "align_up",
        "packing_order",
        "plan_reads",
    ]
