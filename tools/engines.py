"""The serving engines' packages, installed without their dependencies, for the adapters'
contract tests and ``kvdrive-bench tier``.

vLLM and SGLang do not run on a CPU-only host, and their full dependency trees are
gigabytes; the modules the adapters build on (vLLM's tiering base, SGLang's HiCache
storage base) need only a few light packages. :func:`install_engine` installs an engine
at the version the adapters are built against, plus exactly those packages, once per
machine with ``pip install --no-deps --target`` under KVDrive's cache directory.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from kvdrive.protocol.jit_cache import cache_root

log = logging.getLogger(__name__)

# The engine at the version the adapters are built against, then what its base modules import.
ENGINES = {
    "vllm": ["vllm==0.34.0", "msgspec==0.23.0"],
    "sglang": ["sglang==0.5.23", "orjson==3.13.0", "starlette==1.10.0", "ipython==9.18.1", "traitlets==5.16.1",
               "pybase64==1.5.1", "msgspec==0.23.0", "aiohttp==3.14.5", "multidict==7.2.1", "attrs==26.1.0",
               "yarl==1.25.1", "propcache==0.5.4", "aiohappyeyeballs==2.7.1", "aiosignal==1.4.0", "frozenlist==1.8.0"],
}


def install_engine(name: str) -> Path:
    """The directory holding ``name``'s pinned packages, installed there on first use
    (RuntimeError with pip's words if that fails)."""
    pins = ENGINES[name]
    digest = hashlib.sha256(" ".join(pins).encode()).hexdigest()[:12]
    target = cache_root() / "engines" / f"{name}-{digest}"
    if (target / ".installed").exists():
        return target
    log.warning("installing %s without dependencies into %s (once per machine)", " ".join(pins), target)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile", "--no-cache-dir",
           "--disable-pip-version-check", "--target", str(tmp), *pins]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"installing {' '.join(pins)} failed:\n{out.stderr[-3000:]}")
    (tmp / ".installed").write_text(" ".join(pins) + "\n")
    try:
        tmp.rename(target)
    except OSError:  # another process installed it first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def put_on_path(name: str) -> Path:
    """Install ``name`` (if needed) and make it importable here, after the environment's own
    packages so that none of the engine's shadows them."""
    path = install_engine(name)
    if str(path) not in sys.path:
        sys.path.append(str(path))
    return path


class ShmHostAllocator:
    """What SGLang's ``shm`` host allocator (``ShmHostTensorAllocator``, chosen by
    ``"allocator": "shm"`` in a dynamic backend's extra config) does, over SGLang's own
    ``alloc_shm``: each tensor in a memfd mapped shared, its descriptor kept open. (Its
    own module imports much of SGLang's server.) Needs SGLang on the path."""

    def __init__(self) -> None:
        from sglang.srt.mem_cache.storage.mmap.mmap_allocator import alloc_shm  # noqa: PLC0415

        self.alloc_shm, self.fds, self.mms = alloc_shm, [], []

    def allocate(self, dims: tuple, dtype, device: str):
        tensor, fd, mm = self.alloc_shm(dims, dtype)
        self.fds.append(fd)
        self.mms.append(mm)
        return tensor


class _HostPool:
    """What SGLang's host KV pools have in common, for the stand-ins below: ``pages`` pages of
    ``page_size`` rows (tokens) in one CPU tensor ``kv_buffer`` of SGLang's shape for ``layout``
    (:meth:`_dims`), made by ``allocator`` (SGLang's host tensor allocator,
    ``allocate(dims, dtype, device)``; its ``shm`` one keeps it in a memfd), default a plain
    CPU tensor; zeros.

    SGLang's own pools need a GPU device pool to be built; these have the attributes and the
    methods a HiCache storage backend reads (``page_size``, ``layout``, ``dtype``,
    ``kv_buffer``, ``get_size_per_token``, ``get_page_buffer_meta``, ``get_data_page``,
    ``get_dummy_flat_data_page``, ``set_from_flat_data_page``), computed as SGLang's pool
    computes them for that layout, so a backend sees the same pointers, sizes and pages.
    Host indices are SGLang's logical ones, ``logical_page_size`` of them a page: ``page_size``,
    times ``dcp_size`` under decode context parallelism (:class:`MLAHostPool`).
    """

    LAYOUTS: tuple[str, ...] = ()
    dcp_size, dcp_rank = 1, 0  # as SGLang's HostKVCache: no decode context parallelism

    def __init__(self, pages: int, page_size: int, layers: int, dtype, allocator, layout: str) -> None:
        import torch  # noqa: PLC0415 - only the SGLang cases need it

        if layout not in self.LAYOUTS:
            raise ValueError(f"{type(self).__name__}: layout {layout!r} is not one of {self.LAYOUTS}")
        self.dtype, self.layout = dtype or torch.bfloat16, layout
        self.page_size, self.layer_num = page_size, layers
        self.page_num, self.size = pages, pages * page_size
        dims = self._dims()
        self.allocator = allocator  # holds the memfd, where it made one, as SGLang's pool holds it
        self.kv_buffer = torch.zeros(dims, dtype=self.dtype) if allocator is None else \
            allocator.allocate(dims, self.dtype, "cpu").zero_()

    @property
    def logical_size(self) -> int:
        """The host indices SGLang's controller sees: ``dcp_size`` of them share a row."""
        return self.size * self.dcp_size

    @property
    def logical_page_size(self) -> int:
        """A page in host indices (SGLang's widened DCP page)."""
        return self.page_size * self.dcp_size

    def _row(self, index: int) -> int:
        """The row of ``kv_buffer`` where the page whose first host index is ``index`` starts."""
        return index

    def _dims(self) -> tuple:
        raise NotImplementedError

    def _page_slice(self, index: int) -> tuple:
        """The index into ``kv_buffer`` of the page whose first row is ``index``."""
        raise NotImplementedError

    def _page_shape(self) -> tuple:
        """A page's shape as ``kv_buffer[self._page_slice(i)]`` has it."""
        raise NotImplementedError

    def get_data_page(self, index: int, flat: bool = True):
        """The page whose first host index is ``index`` (a view; ``flat``: flattened)."""
        page = self.kv_buffer[self._page_slice(self._row(index))]
        return page.flatten() if flat else page

    def set_from_flat_data_page(self, index: int, data_page) -> None:
        self.kv_buffer[self._page_slice(self._row(index))] = data_page.reshape(self._page_shape())

    def page(self, page_index: int):
        """Page ``page_index`` as ``get_data_page`` has it (a view)."""
        return self.get_data_page(page_index * self.logical_page_size, flat=False)


class MHAHostPool(_HostPool):
    """A host KV pool laid out as SGLang's ``MHATokenToKVPoolHost`` (K and V of one head
    size), in any layout it takes besides ``page_unified`` (which it reports no page
    regions for): ``kv_buffer``

    - ``layer_first``: ``[2 (K, V), layers, tokens, heads, head_dim]``, a page in 2 x
      layers regions (K then V of each layer);
    - ``page_first``: ``[2, tokens, layers, heads, head_dim]``;
    - ``page_first_direct``: ``[2, pages, layers, page_size, heads, head_dim]``;
    - ``page_head``: ``[2, pages, heads, page_size, layers, head_dim]``;

    a page of the last three in 2 regions, its K and its V. See :class:`_HostPool`.
    """

    LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")

    def __init__(self, pages: int, page_size: int, layers: int, heads: int, head_dim: int, dtype=None,
                 allocator=None, layout: str = "page_first") -> None:
        self.head_num, self.head_dim, self.v_head_dim = heads, head_dim, head_dim
        super().__init__(pages, page_size, layers, dtype, allocator, layout)

    def _dims(self) -> tuple:
        L, H, D, ps = self.layer_num, self.head_num, self.head_dim, self.page_size
        return {"layer_first": (2, L, self.size, H, D), "page_first": (2, self.size, L, H, D),
                "page_first_direct": (2, self.page_num, L, ps, H, D),
                "page_head": (2, self.page_num, H, ps, L, D)}[self.layout]

    def _page_slice(self, index: int) -> tuple:
        if self.layout == "layer_first":
            return slice(None), slice(None), slice(index, index + self.page_size)
        if self.layout == "page_first":
            return slice(None), slice(index, index + self.page_size)
        p = index // self.page_size
        return slice(None), slice(p, p + 1)

    def _page_shape(self) -> tuple:
        L, H, D, ps = self.layer_num, self.head_num, self.head_dim, self.page_size
        return {"layer_first": (2, L, ps, H, D), "page_first": (2, ps, L, H, D),
                "page_first_direct": (2, 1, L, ps, H, D), "page_head": (2, 1, H, ps, L, D)}[self.layout]

    def get_size_per_token(self) -> int:
        return (self.head_dim + self.v_head_dim) * self.head_num * self.layer_num * self.dtype.itemsize

    def get_dummy_flat_data_page(self):
        import torch  # noqa: PLC0415

        return torch.zeros((2, self.layer_num, self.page_size, self.head_num, self.head_dim),
                           dtype=self.dtype).flatten()

    def get_page_buffer_meta(self, indices) -> tuple[list[int], list[int]]:
        """Per page of ``indices`` (token indices, ``page_size`` per page): its regions, as
        (pointers, sizes): K and V of each layer (``layer_first``), else its K and its V."""
        indices = indices.tolist()
        if len(indices) % self.page_size:
            raise ValueError(f"{len(indices)} token indices are not whole pages of {self.page_size}")
        row = self.head_num * self.head_dim * self.dtype.itemsize  # a token of one layer, K or V
        base, v_offset = self.kv_buffer.data_ptr(), self.layer_num * self.size * row
        ptrs: list[int] = []
        if self.layout == "layer_first":
            for i in range(0, len(indices), self.page_size):
                for layer in range(self.layer_num):
                    k = base + indices[i] * row + layer * self.size * row
                    ptrs += [k, k + v_offset]
            return ptrs, [row * self.page_size] * len(ptrs)
        for i in range(0, len(indices), self.page_size):
            k = base + indices[i] * self.layer_num * row
            ptrs += [k, k + v_offset]
        return ptrs, [self.layer_num * row * self.page_size] * len(ptrs)


class MLAHostPool(_HostPool):
    """A host KV pool laid out as SGLang's ``MLATokenToKVPoolHost`` (one latent row of
    ``kv_lora_rank + qk_rope_head_dim`` a token and layer), in any layout it reports page
    regions for besides the Ascend one: ``kv_buffer``

    - ``layer_first``: ``[layers, rows, 1, kv_cache_dim]``, a page in one region a layer;
    - ``page_first``: ``[rows, layers, 1, kv_cache_dim]``;
    - ``page_first_direct``: ``[pages, layers, rows a page, 1, kv_cache_dim]``;

    a page of the last two in one region. Under decode context parallelism (``dcp_size``
    > 1) it is DCP rank ``dcp_rank``'s, as SGLang's: ``page_size`` (SGLang passes the
    widened page) is a page in host indices, ``logical_page_size``, and each rank holds
    ``page_size // dcp_size`` rows of it (``self.page_size``), its share of the page's
    tokens; the page whose first host index is ``i`` (a multiple of ``logical_page_size``)
    starts at row ``i // dcp_size`` (SGLang's ``_storage_page_index``). See
    :class:`_HostPool`.
    """

    LAYOUTS = ("layer_first", "page_first", "page_first_direct")

    def __init__(self, pages: int, page_size: int, layers: int, kv_lora_rank: int, qk_rope_head_dim: int,
                 dtype=None, allocator=None, layout: str = "page_first", dcp_size: int = 1,
                 dcp_rank: int = 0) -> None:
        if page_size % dcp_size or not 0 <= dcp_rank < dcp_size:
            raise ValueError(f"MLAHostPool: page of {page_size} host indices, DCP rank {dcp_rank} of {dcp_size}")
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim
        self.kv_cache_dim = kv_lora_rank + qk_rope_head_dim
        self.dcp_size, self.dcp_rank = dcp_size, dcp_rank
        super().__init__(pages, page_size // dcp_size, layers, dtype, allocator, layout)

    def _row(self, index: int) -> int:
        if self.dcp_size == 1:
            return index
        index = int(index)
        if index < 0 or index % self.logical_page_size:
            raise ValueError("DCP L3 page start must be a nonnegative logical page boundary.")
        if index + self.logical_page_size > self.logical_size:
            raise IndexError("DCP L3 page is outside the host pool.")
        return index // self.dcp_size

    def _dims(self) -> tuple:
        L, C = self.layer_num, self.kv_cache_dim
        return {"layer_first": (L, self.size, 1, C), "page_first": (self.size, L, 1, C),
                "page_first_direct": (self.page_num, L, self.page_size, 1, C)}[self.layout]

    def _page_slice(self, index: int) -> tuple:
        if self.layout == "layer_first":
            return slice(None), slice(index, index + self.page_size)
        if self.layout == "page_first":
            return (slice(index, index + self.page_size),)
        p = index // self.page_size
        return (slice(p, p + 1),)

    def _page_shape(self) -> tuple:
        L, C, ps = self.layer_num, self.kv_cache_dim, self.page_size
        return {"layer_first": (L, ps, 1, C), "page_first": (ps, L, 1, C),
                "page_first_direct": (1, L, ps, 1, C)}[self.layout]

    def get_size_per_token(self) -> int:
        return self.kv_cache_dim * self.dtype.itemsize * self.layer_num

    def get_dummy_flat_data_page(self):
        import torch  # noqa: PLC0415

        return torch.zeros((self.layer_num, self.page_size, 1, self.kv_cache_dim), dtype=self.dtype).flatten()

    def get_page_buffer_meta(self, indices) -> tuple[list[int], list[int]]:
        """Per page of ``indices`` (host indices, ``logical_page_size`` per page): its
        regions, as (pointers, sizes): one a layer (``layer_first``), else the page's one."""
        indices = indices.tolist()
        if len(indices) % self.logical_page_size:
            raise ValueError(f"{len(indices)} host indices are not whole pages of {self.logical_page_size}")
        row = self.kv_cache_dim * self.dtype.itemsize  # a token of one layer
        base = self.kv_buffer.data_ptr()
        starts = [self._row(i) for i in indices[:: self.logical_page_size]]
        if self.layout == "layer_first":
            ptrs = [base + i * row + layer * self.size * row for i in starts for layer in range(self.layer_num)]
            return ptrs, [row * self.page_size] * len(ptrs)
        return [base + i * self.layer_num * row for i in starts], [self.layer_num * row * self.page_size] * len(starts)


class PageFirstHostPool(MHAHostPool):
    """A host KV pool laid out as SGLang's ``MHATokenToKVPoolHost`` with its ``page_first``
    layout (:class:`MHAHostPool`): one CPU tensor ``[2 (K, V), tokens, layers, heads,
    head_dim]``; :meth:`page` is a page's K and V, ``[2, page_size, layers, heads, head_dim]``.
    """

    def __init__(self, pages: int, page_size: int, layers: int, heads: int, head_dim: int, dtype=None,
                 allocator=None) -> None:
        super().__init__(pages, page_size, layers, heads, head_dim, dtype, allocator, "page_first")
