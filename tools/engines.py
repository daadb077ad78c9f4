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

from kvdrive.kernels.jit import cache_root

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


class PageFirstHostPool:
    """A host KV pool laid out as SGLang's ``MHATokenToKVPoolHost`` with its ``page_first``
    layout: one CPU tensor ``[2 (K, V), tokens, layers, heads, head_dim]``.

    SGLang's own pool needs a GPU device pool to be built; this one has the attributes and
    the one method a HiCache storage backend reads (``page_size``, ``kv_buffer``,
    ``get_size_per_token``, ``get_page_buffer_meta``), computed as SGLang's pool computes
    them for that layout, so a backend sees the same pointers and sizes. ``allocator``:
    SGLang's host tensor allocator that makes ``kv_buffer`` (``allocate(dims, dtype,
    device)``; its ``shm`` one keeps it in a memfd); default, a plain CPU tensor.
    """

    layout = "page_first"

    def __init__(self, pages: int, page_size: int, layers: int, heads: int, head_dim: int, dtype=None,
                 allocator=None) -> None:
        import torch  # noqa: PLC0415 - only the SGLang cases need it

        self.dtype = dtype or torch.bfloat16
        self.page_size, self.layer_num, self.head_num, self.head_dim = page_size, layers, heads, head_dim
        self.size = pages * page_size
        dims = (2, self.size, layers, heads, head_dim)
        self.allocator = allocator  # holds the memfd, where it made one, as SGLang's pool holds it
        self.kv_buffer = torch.zeros(dims, dtype=self.dtype) if allocator is None else \
            allocator.allocate(dims, self.dtype, "cpu").zero_()

    def get_size_per_token(self) -> int:
        return self.head_dim * self.head_num * self.layer_num * self.dtype.itemsize * 2

    def get_page_buffer_meta(self, indices) -> tuple[list[int], list[int]]:
        """Per page of ``indices`` (token indices, ``page_size`` per page): its K and its V
        region, as (pointers, sizes)."""
        indices = indices.tolist()
        if len(indices) % self.page_size:
            raise ValueError(f"{len(indices)} token indices are not whole pages of {self.page_size}")
        token_bytes = self.layer_num * self.head_num * self.head_dim * self.dtype.itemsize
        base, v_offset = self.kv_buffer.data_ptr(), self.size * token_bytes
        ptrs: list[int] = []
        for i in range(0, len(indices), self.page_size):
            k = base + indices[i] * token_bytes
            ptrs += [k, k + v_offset]
        return ptrs, [token_bytes * self.page_size] * len(ptrs)

    def page(self, page_index: int):
        """Page ``page_index``'s K and V, ``[2, page_size, layers, heads, head_dim]`` (a view)."""
        t0 = page_index * self.page_size
        return self.kv_buffer[:, t0: t0 + self.page_size]
