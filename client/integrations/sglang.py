"""kvstored as a HiCache storage backend of SGLang (its L3 tier, ``HiCacheStorage``).

Built and checked against SGLang 0.5.23 (``pip install kvdrive[sglang]``); the storage
backend API changed between releases. SGLang loads it as its ``dynamic`` backend::

    python -m sglang.launch_server --model-path Qwen/Qwen3-8B --enable-hierarchical-cache \\
      --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name": "kvdrive",
        "module_path": "kvdrive_client.integrations.sglang", "class_name": "KVDriveHiCacheStorage",
        "interface_v1": 1, "address": "ipc:///run/kvdrive/kvstored.sock", "tenant": "team-a"}'

Options in the extra config, besides SGLang's own: ``address`` (default: the daemon
``connect()`` finds), ``model`` (default: SGLang's model name), ``tenant``, ``timeout`` /
``lookup_timeout`` (seconds per data request / lookup), ``retry_s`` (how long a daemon
found down is answered with misses), ``staging_bytes`` (each staging region pages move
through), ``load_channels`` / ``store_channels`` (loads / stores at once).

Each SGLang page (every layer's K and V of ``page_size`` tokens) is one block of a
:class:`~kvdrive_client.integrations.blocks.BlockStore`, by SGLang's page hash, in a
namespace per model, tenant, page size in bytes, shard (``tpRofN`` as each TP rank holds
other heads, or ``mla`` where every rank holds the same; plus the pipeline stage and
context-parallel rank where there are several) and page format (the host pool's layout
and dtype, ``-flat`` for flat page tensors: pages of another byte order or dtype miss
instead of loading as garbage).
``batch_exists`` is one lookup request; ``batch_set_v1`` / ``batch_get_v1`` (with
``interface_v1``) take the regions of each page in SGLang's host pool from
``get_page_buffer_meta`` and copy them into / out of the shared buffer registered with
kvstored: one memcpy each way. It is not zero-copy: SGLang's host pool is not memory
kvstored can map. Without ``interface_v1`` SGLang passes flat page tensors (``batch_set``
/ ``batch_get``), which are copied the same way. Pages are write-once: a page stored
already (by this process, another or an earlier run) is not written again. ``clear()``
deletes the namespace's pages (on the storage-writer ranks). Prefetches never wait for
backups: loads and stores have connections and staging regions of their own
(``load_channels`` / ``store_channels``, default 2 and 1).

Nothing raises into SGLang on store trouble: a daemon that is down or dies, a full store
or a damaged page is a miss (or a page not stored) and a log line, within about a second.
``stats()`` has the counters; ``get_stats()`` is SGLang's storage metrics (pages and GB/s
of each prefetch and backup) when SGLang's metrics are on (``--enable-metrics``).

Verified here: the backend against SGLang's real ``HiCacheStorage``, storage config and
backend factory, driven with the cache controller's calls, against a real kvstored, on
a host pool whose ``get_page_buffer_meta`` computes what SGLang's MHA host pool does for
its ``page_first`` layout (tests/integrations). Not verified: an SGLang server on a GPU;
the other layouts and MLA pools (handled alike, through the regions their host pools
report). Not supported: the v2 interface of hybrid models' extra pools (Mamba, SWA).
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from typing import Any

import numpy as np

from kvdrive_client.integrations.blocks import BlockStore
from kvdrive_client.locate import DEFAULT

log = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"

try:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo
except ImportError as _exc:  # SGLang is not installed: the module imports, the backend does not exist
    _IMPORT_ERROR: ImportError | None = _exc
else:
    _IMPORT_ERROR = None


def _shard(cfg: Any) -> str:
    """The share of each page this rank holds: its TP rank (MLA ranks all hold the same),
    pipeline stage and context-parallel rank."""
    parts = ["mla" if cfg.is_mla_model else f"tp{cfg.tp_rank}of{cfg.tp_size}"]
    if cfg.pp_size > 1:
        parts.append(f"pp{cfg.pp_rank}of{cfg.pp_size}")
    if cfg.attn_cp_size > 1:
        parts.append(f"cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}")
    return "-".join(parts)


if _IMPORT_ERROR is None:

    def _bytes_of(t: torch.Tensor) -> np.ndarray | None:
        """A contiguous CPU tensor's bytes (a view, whatever its dtype); None for any other."""
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        return t.detach().reshape(-1).view(torch.uint8).numpy()

    class KVDriveHiCacheStorage(HiCacheStorage):
        """SGLang's HiCache storage in kvstored (see the module for the configuration).

        Built by SGLang's backend factory as ``KVDriveHiCacheStorage(storage_config, kwargs)``;
        its options come from ``storage_config.extra_config`` (``kwargs`` is not used).
        """

        def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
            opts = storage_config.extra_config or {}
            self.model = opts.get("model") or storage_config.model_name
            if not self.model:
                raise ValueError("KVDriveHiCacheStorage needs the model's name: SGLang's storage config has none; "
                                 "set \"model\" in --hicache-storage-backend-extra-config")
            self.tenant = str(opts.get("tenant", "default"))
            self.shard = _shard(storage_config)
            self.interface_v1 = bool(opts.get("interface_v1", 0))
            self.writer = storage_config.is_storage_writer
            self.metrics = storage_config.enable_storage_metrics
            self._store_args = dict(address=opts.get("address", DEFAULT), timeout=float(opts.get("timeout", 10.0)),
                                    lookup_timeout=float(opts.get("lookup_timeout", 1.0)),
                                    retry_s=float(opts.get("retry_s", 1.0)),
                                    staging_bytes=int(opts.get("staging_bytes", 64 << 20)),
                                    load_channels=int(opts.get("load_channels", 2)),
                                    store_channels=int(opts.get("store_channels", 1)))
            self.mem_pool_host = None
            self.store: BlockStore | None = None  # made once the page size is known
            self._make = threading.Lock()
            self._ops: dict[str, list] = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                                          "backup_bandwidth": []}

        # ------------------------------------------------------------ the block store

        def register_mem_pool_host(self, mem_pool_host: Any) -> None:
            """Take SGLang's host pool: its pages (``get_size_per_token() * page_size`` bytes,
            in its layout and dtype) are this backend's blocks."""
            if getattr(mem_pool_host, "kv_buffer", None) is None:
                raise ValueError(f"KVDriveHiCacheStorage stores one KV pool's pages; {type(mem_pool_host).__name__} "
                                 f"holds none of its own (hybrid models are not supported)")
            super().register_mem_pool_host(mem_pool_host)
            page_bytes = mem_pool_host.get_size_per_token() * mem_pool_host.page_size
            if self.interface_v1:  # a layout the pool has no page regions for fails here, not at each call
                _, sizes = mem_pool_host.get_page_buffer_meta(torch.arange(mem_pool_host.page_size))
                if sum(sizes) != page_bytes:
                    raise ValueError(f"KVDriveHiCacheStorage: the host pool's page regions are {sum(sizes)} bytes, "
                                     f"its pages {page_bytes} (layout {mem_pool_host.layout} is not supported)")
            layout = mem_pool_host.layout if self.interface_v1 else f"{mem_pool_host.layout}-flat"
            dtype = str(mem_pool_host.dtype).removeprefix("torch.")
            with self._make:
                if self.store is not None:
                    self.store.close()
                self.store = self._new_store(page_bytes, f"{self.shard}.{layout}.{dtype}")

        def _new_store(self, page_bytes: int, rank: str) -> BlockStore:
            store = BlockStore(page_bytes, engine="sglang", model=self.model, tenant=self.tenant, rank=rank,
                               **self._store_args)
            log.info("KVDrive storage for SGLang: namespace %s, pages of %d bytes", store.ns, page_bytes)
            return store

        def _blocks(self, page_bytes: int) -> BlockStore | None:
            """The block store, made here for pages of ``page_bytes`` where no host pool gave the
            size (None, and a log line, for pages of another size or one kvstored cannot hold)."""
            with self._make:
                if self.store is None:
                    try:
                        self.store = self._new_store(page_bytes, self.shard)
                    except ValueError as exc:
                        log.error("KVDrive storage: %s", exc)
                        return None
            if self.store.block_bytes != page_bytes:
                log.error("KVDrive storage: a page of %d bytes; this backend's pages are %d", page_bytes,
                          self.store.block_bytes)
                return None
            return self.store

        def _record(self, op: str, pages: int, seconds: float) -> None:
            if self.metrics and pages:
                self._ops[f"{op}_pgs"].append(pages)
                self._ops[f"{op}_bandwidth"].append(pages * self.store.block_bytes / max(seconds, 1e-9) / 1e9)

        # ------------------------------------------------------------ the controller's calls (interface_v1)

        def _page_regions(self, keys: list, host_indices: torch.Tensor) -> list[list] | None:
            """Per key, its page's regions in the host pool (writable buffers over them, in
            the pool's order), or None (and a log line) where they are not one page each."""
            pool = self.mem_pool_host
            if pool is None or self.store is None:
                log.error("KVDrive storage: no host pool registered; SGLang calls register_mem_pool_host first")
                return None
            if host_indices.numel() != len(keys) * pool.page_size:
                log.error("KVDrive storage: %d host indices for %d pages of %d tokens", host_indices.numel(),
                          len(keys), pool.page_size)
                return None
            ptrs, sizes = pool.get_page_buffer_meta(host_indices)
            per = len(ptrs) // len(keys)
            pages = [range(i * per, (i + 1) * per) for i in range(len(keys))]
            if not per or per * len(keys) != len(ptrs) or any(sum(sizes[j] for j in p) != self.store.block_bytes
                                                               for p in pages):
                log.error("KVDrive storage: the host pool's %d regions are not %d pages of %d bytes", len(ptrs),
                          len(keys), self.store.block_bytes)
                return None
            return [[(ctypes.c_uint8 * sizes[j]).from_address(ptrs[j]) for j in p] for p in pages]

        def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
            """How many leading keys have their page stored (one lookup request)."""
            return self.store.prefix(keys) if self.store is not None and keys else 0

        def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                         extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
            """Load each key's page into the host pool at its host indices (page ``i`` of the
            call starts at ``host_indices[i * page_size]``); True for each page loaded."""
            regions = self._page_regions(keys, host_indices) if keys else []
            if not regions:
                return [False] * len(keys)
            t0 = time.perf_counter()
            got = self.store.load(keys, regions)
            self._record("prefetch", sum(got), time.perf_counter() - t0)
            return got

        def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                         extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
            """Store the host pool's page at each key's host indices; True for each page
            stored (now or before). A rank that is not a storage writer stores nothing."""
            if not self.writer:
                return [True] * len(keys)
            regions = self._page_regions(keys, host_indices) if keys else []
            if not regions:
                return [False] * len(keys)
            t0 = time.perf_counter()
            done = self.store.store(keys, regions)
            self._record("backup", sum(done), time.perf_counter() - t0)
            return done

        # ------------------------------------------------------------ flat page tensors

        def exists(self, key: str) -> bool:
            """Whether ``key``'s page is stored (False where kvstored cannot say)."""
            return self.store is not None and self.store.lookup([key])[0]

        def get(self, key: str, target_location: torch.Tensor | None = None,
                target_sizes: Any = None) -> torch.Tensor | None:
            """Fill ``target_location`` (a flat CPU page tensor; default: a new one from the
            host pool) with ``key``'s page and return it; None on a miss."""
            return self.batch_get([key], None if target_location is None else [target_location])[0]

        def batch_get(self, keys: list[str], target_locations: list | None = None,
                      target_sizes: Any = None) -> list[torch.Tensor | None]:
            """:meth:`get` of each key: its filled target, or None."""
            if target_locations is None:
                if self.mem_pool_host is None:
                    raise ValueError("KVDriveHiCacheStorage.get needs target_location where no host pool is registered")
                target_locations = [self.mem_pool_host.get_dummy_flat_data_page() for _ in keys]
            if len(keys) != len(target_locations):
                raise ValueError(f"{len(keys)} keys for {len(target_locations)} targets")
            if not keys:
                return []
            views = [_bytes_of(t) for t in target_locations]
            if any(v is None for v in views):
                log.error("KVDrive storage: get targets must be contiguous CPU tensors")
                return [None] * len(keys)
            store = self._blocks(views[0].nbytes)
            if store is None or any(v.nbytes != store.block_bytes for v in views):
                return [None] * len(keys)
            t0 = time.perf_counter()
            got = store.load(keys, views)
            self._record("prefetch", sum(got), time.perf_counter() - t0)
            return [t if ok else None for t, ok in zip(target_locations, got)]

        def set(self, key: str, value: torch.Tensor | None = None, target_location: Any = None,
                target_sizes: Any = None) -> bool:
            """Store ``value`` (a CPU page tensor) as ``key``'s page; True once it is stored."""
            return self.batch_set([key], [value])

        def batch_set(self, keys: list[str], values: list | None = None, target_locations: Any = None,
                      target_sizes: Any = None) -> bool:
            """:meth:`set` of each key; True if every page is stored."""
            if not self.writer:
                return True
            if values is None or len(keys) != len(values):
                raise ValueError(f"{len(keys)} keys for {0 if values is None else len(values)} page tensors")
            if not keys:
                return True
            views = [_bytes_of(v.contiguous()) for v in values]
            if any(v is None for v in views):
                log.error("KVDrive storage: set values must be CPU tensors")
                return False
            store = self._blocks(views[0].nbytes)
            if store is None or any(v.nbytes != store.block_bytes for v in views):
                return False
            t0 = time.perf_counter()
            done = store.store(keys, views)
            self._record("backup", sum(done), time.perf_counter() - t0)
            return all(done)

        # ------------------------------------------------------------ the rest

        def clear(self) -> None:
            """Delete the pages of this backend's namespace: what this user stored there (this
            process, the other engines of its model, tenant and shard, or earlier runs), as
            SGLang's file backend empties its directory. A rank that is not a storage writer
            stored nothing and deletes nothing."""
            if self.store is None or not self.writer:
                return
            deleted = self.store.delete_all()
            log.info("KVDrive storage: clear() deleted %d page(s) of namespace %s", deleted, self.store.ns)

        def get_stats(self) -> Any:
            """SGLang's ``StorageMetrics`` of the prefetches and backups since the last call
            (pages, GB/s each) where storage metrics are on, else None. The block store's
            counters are :meth:`stats`."""
            if not self.metrics:
                return None
            # Imported here: the module imports much of SGLang's server.
            from sglang.srt.observability.metrics_collector import StorageMetrics  # noqa: PLC0415

            metrics = StorageMetrics()
            for name, values in self._ops.items():
                getattr(metrics, name).extend(values)
                values.clear()
            return metrics

        def stats(self) -> dict:
            """The block store's counters (see :meth:`BlockStore.stats`)."""
            return {} if self.store is None else self.store.stats()

        def close(self) -> None:
            """Free kvstored's buffer and the connection; later calls are misses."""
            if self.store is not None:
                self.store.close()

else:

    def __getattr__(name: str) -> Any:
        if name == "KVDriveHiCacheStorage":
            raise ImportError(
                f"KVDriveHiCacheStorage needs SGLang's HiCache storage API (sglang=={SGLANG_VERSION}: "
                f"pip install 'kvdrive[sglang]'); importing it failed: {_IMPORT_ERROR}"
            )
        raise AttributeError(name)
