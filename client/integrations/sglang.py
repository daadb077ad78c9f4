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
other heads, or ``mla`` where every rank holds the same; plus the decode-context-parallel
rank, pipeline stage and context-parallel rank where there are several) and page format
(the host pool's layout and dtype, ``-flat`` for flat page tensors: pages of another byte
order or dtype miss instead of loading as garbage).
``batch_exists`` is one lookup request; ``batch_set_v1`` / ``batch_get_v1`` (with
``interface_v1``) take the regions of each page in SGLang's host pool from
``get_page_buffer_meta`` (or from the pool's strides, once they have agreed with it:
:mod:`~kvdrive_client.integrations.page_strides`) and copy them into / out of the shared
buffer registered with kvstored: one memcpy each way. With ``"allocator": "shm"`` in the
extra config, SGLang keeps its host pools in memfds, which this backend shares with kvstored
(:mod:`~kvdrive_client.integrations.pool`): kvstored then reads and writes each page's
regions in place (an MHA pool's K and V in its ``page_first``, ``page_first_direct`` and
``page_head`` layouts, an MLA pool's whole page in its ``page_first`` and
``page_first_direct``), with no copy in SGLang's process; so for the KV pool and for each
v2 pool whose pages lie in equal regions of one tensor (an SWA pool's; a Mamba pool's
state pages do not). Pages of ``layer_first`` pools lie in a region per layer (MHA: two,
K and V) and move through staging past :data:`MAX_REGIONS_IN_PLACE` regions (an MHA
model of more than 4 layers, an MLA model of more than 8), as do pages of SGLang's
default pinned host pool. Without ``interface_v1`` SGLang passes flat page tensors
(``batch_set`` / ``batch_get``), which are copied the same way. Pages are write-once: a page stored
already (by this process, another or an earlier run) is not written again. ``clear()``
deletes the namespace's pages (on the storage-writer ranks). Prefetches never wait for
backups: loads and stores have connections and staging regions of their own
(``load_channels`` / ``store_channels``, default 2 and 1).

Nothing raises into SGLang on store trouble: a daemon that is down or dies, a full store
or a damaged page is a miss (or a page not stored) and a log line, within about a second.
A page moved in place is the exception to the second: its request is waited for until
kvstored answers, past ``timeout`` (logged), since kvstored may still be reading or
writing the page, so a daemon that hangs without dying holds that call.
``stats()`` has the counters; ``get_stats()`` is SGLang's storage metrics (pages and GB/s
of each prefetch and backup) when SGLang's metrics are on (``--enable-metrics``).

Decode context parallelism (``dcp_size`` > 1 in SGLang's storage config; MLA only) splits
every page's tokens among the DCP ranks of a TP group: SGLang's MLA host pool
(``pool_host/mla.py``) holds ``page_size`` rows of each page, its ``logical_page_size``
(``page_size * dcp_size``, the controller's page) host indices a page, the page whose first
host index is ``i`` at row ``i // dcp_size`` (``_storage_page_index``), so
``get_page_buffer_meta`` takes ``logical_page_size`` indices a page and reports this
rank's rows. Each DCP rank's share of a page is a block of its own: the shard is
``mla-tpT-dcpRofN`` (SGLang's file and Mooncake backends likewise key the shares by DCP
rank and TP size), and each is stored by its storage writer (SGLang's
``is_storage_writer``: TP ranks 0 to ``dcp_size - 1``, one per share); the other TP
ranks hold the same shares as those (DCP rank ``tp_rank % dcp_size``) and load them.
Host indices are counted in ``logical_page_size``; a host pool of other DCP ranks or
pages than the storage config is refused at registration (ValueError). Of the v2 pools only Mamba state is kept under DCP (per TP rank, as
SGLang's file backend keys it; ``tpRofN-dcpRofN``), as SGLang keeps no other there: any
other is refused when registered (a log line; its pages are not stored and miss). SGLang
0.5.23's cache controller attaches only its own file and Mooncake backends under DCP
(``attach_storage_backend`` raises for the others, ``dynamic`` included), so an SGLang
of that release does not call this backend under DCP.

Hybrid models (KV plus extra host pools: Mamba state, SWA KV, ...) use SGLang's v2
interface beside it. Each host pool SGLang registers (``register_mem_host_pool_v2``; the
KV pool is the anchor's, above) gets a block namespace of its own, made there: pages of
that pool's size (``get_size_per_token() * page_size``), the pool's name in the namespace
(``tp0of1.mamba.page_first.bfloat16+float32``), so pools never share a page. Mamba state
is each TP rank's own even in an MLA model (``tpRofN``, stored and cleared by every rank,
as SGLang's file backend keys it); the other pools follow the KV pool's shard (one copy in
an MLA model, stored by the storage writer). ``batch_set_v2`` / ``batch_get_v2`` move each
``PoolTransfer``'s pages (its ``keys``, page ``i`` at ``host_indices[i * page_size]`` of
its pool) between the pool and its namespace, through the regions the pool reports
(``get_page_buffer_meta``) or, where it reports none (a Mamba pool with slot side states),
as flat page tensors (``get_data_page`` / ``set_from_flat_data_page``, ``-flat`` in the
namespace); they return ``{pool name: [True per page done]}``, as SGLang's controller
counts them (``count_pool_hits``). ``batch_exists_v2`` folds the pools' hit policies as
SGLang's file and Mooncake backends do and returns a ``PoolTransferResult``:
``ALL_PAGES``, each page up to the prefix; ``TRAILING_PAGES``, the last
``len(transfer.keys)`` pages before it; the stop points every pool serves in
``restorable_prefix_pages``, the longest in ``kv_hit_pages``. ``BLOCK_GROUPS`` (which
SGLang 0.5.23 describes but none of its backends implements) neither gates the hit nor
gets a verdict. A pool never registered, host indices that are not one page per key, a
host pool that raises or a daemon that is down: misses (False, no hit), never an
exception. ``clear()`` deletes every pool's namespace; ``pool_stats()`` has each pool's
counters.

Verified here: the backend against SGLang's real ``HiCacheStorage``, storage config and
backend factory, driven with the cache controller's calls, against a real kvstored, on
CPU stand-ins of SGLang's MHA and MLA host pools in each layout they report page regions
for (MHA ``page_first``, ``page_first_direct``, ``page_head``, ``layer_first``; MLA
``page_first``, ``page_first_direct``, ``layer_first``), whose tensors, page regions and
pages are what SGLang's own pool methods (compiled from its source) compute: pages loaded
byte for byte into other host pages, in place and through staging, stored as SGLang's
regions in order (tests/integrations). The v2 interface likewise, with SGLang's
own ``PoolTransfer`` / ``PoolHitPolicy`` / ``PoolTransferResult``, on CPU stand-ins for a
hybrid model's host pools (a KV pool, a Mamba state pool laid out as SGLang's
``MambaPoolHost`` ``page_first``, with and without slot side states, an SWA pool):
byte-exact round trips per pool, ``batch_exists_v2`` equal to SGLang's own file
backend's on the same stored pages, misses, ``clear()`` (tests/integrations/test_sglang_v2.py).
Decode context parallelism likewise, on the MLA stand-in as DCP rank 0 and 1 of a page
(its regions, rows and pages what SGLang's own MLA pool methods compute under DCP): two
DCP ranks storing the same page hashes each load back their own share byte for byte, in
each MLA layout, with ``interface_v1`` (in place and through staging) and flat page
tensors; another TP group's ranks load them; the refused v2 pools miss
(tests/integrations/test_sglang_dcp.py).
Not verified: an SGLang server on a GPU, or a real hybrid model served with it (SGLang's
hybrid cache controller has not called it; its calls were scripted from its source);
SGLang's host pool classes themselves (built only beside a GPU device pool); MHA pools of
unequal K and V head sizes (two tensors, so through staging) and Ascend's
``page_first_kv_split``; SGLang's controller under DCP (see above). Not supported: a
logical KV anchor with no pages of its own (DeepSeek V4's), v2 pools other than Mamba
state under DCP, ``BLOCK_GROUPS`` verdicts, storage metrics (``get_stats()``) of the v2
pools.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
import weakref
from typing import Any

import numpy as np

from kvdrive.protocol.blocks import block_geometry
from kvdrive_client.integrations.blocks import BlockStore
from kvdrive_client.integrations.page_strides import PageStrides
from kvdrive_client.integrations.rows import Spans
from kvdrive_client.locate import DEFAULT

log = logging.getLogger(__name__)

SGLANG_VERSION = "0.5.23"
# A page of more regions than this (layer_first: 2 x layers) moves through staging: in
# place, kvstored would keep it in as many parts, each an extent and a catalog record.
MAX_REGIONS_IN_PLACE = 8

try:
    import torch
    from sglang.srt.mem_cache.hicache_storage import (HiCacheStorage, HiCacheStorageConfig,
                                                      HiCacheStorageExtraInfo, PoolHitPolicy, PoolName,
                                                      PoolTransfer, PoolTransferResult)
except ImportError as _exc:  # SGLang is not installed: the module imports, the backend does not exist
    _IMPORT_ERROR: ImportError | None = _exc
else:
    _IMPORT_ERROR = None


def _shard(cfg: Any, tp_sharded: bool = False) -> str:
    """The share of each page this rank holds: its TP rank (MLA ranks all hold the same,
    unless ``tp_sharded``: a pool each rank holds its own share of whatever the model),
    decode-context-parallel rank (each holds its own share of every page's tokens; the
    shares are kept per TP size, as SGLang's file and Mooncake backends keep them),
    pipeline stage and context-parallel rank."""
    dcp = cfg.dcp_size > 1
    if cfg.is_mla_model and not tp_sharded:
        parts = ["mla", f"tp{cfg.tp_size}"] if dcp else ["mla"]
    else:
        parts = [f"tp{cfg.tp_rank}of{cfg.tp_size}"]
    if dcp:
        parts.append(f"dcp{cfg.dcp_rank}of{cfg.dcp_size}")
    if cfg.pp_size > 1:
        parts.append(f"pp{cfg.pp_rank}of{cfg.pp_size}")
    if cfg.attn_cp_size > 1:
        parts.append(f"cp{cfg.attn_cp_rank}of{cfg.attn_cp_size}")
    return "-".join(parts)


def _page_tokens(pool: Any) -> int:
    """The host indices of one page of ``pool``: its ``page_size``, or under decode context
    parallelism (SGLang's MLA pool) its ``logical_page_size``, ``dcp_size`` times the rows
    of the page this rank holds."""
    return getattr(pool, "logical_page_size", pool.page_size)


def _whole_pages(pool: Any, n: int, host_indices: Any) -> bool:
    """Whether ``host_indices`` are ``n`` pages of ``pool`` (a log line where not)."""
    got, per = 0 if host_indices is None else host_indices.numel(), _page_tokens(pool)
    if got != n * per:
        log.error("KVDrive storage: %d host indices for %d pages of %d tokens", got, n, per)
        return False
    return True


def _regions(pool: Any, page_bytes: int, n: int, host_indices: Any) -> Spans | list[list] | None:
    """The regions of each page of ``host_indices`` (``n`` pages) in the host pool ``pool``
    reports, in the pool's order: :class:`Spans` of the pool's buffer where they are of one
    size within it (moved by one compiled copy a request, or in place), else writable
    buffers over them per page; None (and a log line) where they are not ``n`` pages of
    ``page_bytes``."""
    if not _whole_pages(pool, n, host_indices):
        return None
    strides = _strides_of(pool)
    if strides is not None and strides.ready and (spans := _strided(pool, strides, host_indices)) is not None:
        return spans
    ptrs, sizes = pool.get_page_buffer_meta(host_indices)
    per = len(ptrs) // n
    one = len(set(sizes)) == 1  # as a rule: then no array is needed to check them
    if not per or per * n != len(ptrs) or len(sizes) != len(ptrs) or \
            (per * sizes[0] != page_bytes if one else
             (np.asarray(sizes, np.int64).reshape(n, per).sum(1) != page_bytes).any()):
        log.error("KVDrive storage: the host pool's %d regions are not %d pages of %d bytes", len(ptrs), n,
                  page_bytes)
        return None
    spans = _spans(pool, ptrs, sizes[0], n, per) if one else None
    if spans is not None:
        if strides is not None and not strides.ready:
            strides.learn(strides.firsts(host_indices), spans.offsets, sizes[0])
        return spans
    return [[(ctypes.c_uint8 * sizes[j]).from_address(ptrs[j]) for j in range(i * per, (i + 1) * per)]
            for i in range(n)]


_STRIDES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # host pool -> its PageStrides


def _strides_of(pool: Any) -> PageStrides | None:
    """``pool`` 's :class:`PageStrides` (made on first use); None for a pool that cannot be
    weakly referenced (its pages are then always asked of it)."""
    try:
        strides = _STRIDES.get(pool)
        if strides is None:
            strides = _STRIDES[pool] = PageStrides(pool, _page_tokens(pool))
        return strides
    except TypeError:
        return None


def _strided(pool: Any, strides: PageStrides, host_indices: Any) -> Spans | None:
    """The pages of ``host_indices`` as :class:`Spans` computed from ``strides`` (the last
    checked against the pool); None where they cannot be (the pool is then asked)."""
    buf = getattr(pool, "kv_buffer", None)
    if strides.buffer is None or strides.buffer[0] is not buf:
        array = _bytes_of(buf) if _IMPORT_ERROR is None and isinstance(buf, torch.Tensor) else None
        if array is None:
            return None
        strides.buffer = (buf, array)
    firsts = strides.firsts(host_indices)
    if firsts is None:
        return None
    offsets = strides.predict(firsts)
    if not strides.spot_check(host_indices, offsets, buf.data_ptr()):
        return None
    try:
        return Spans(strides.buffer[1], offsets, strides.span)
    except ValueError:  # a region outside the buffer
        return None


def _spans(pool: Any, ptrs: list, size: int, n: int, per: int) -> Spans | None:
    """Regions at ``ptrs`` (``per`` a page, ``size`` bytes each) as :class:`Spans` of the
    pool's ``kv_buffer``, where that is one contiguous CPU tensor holding them all."""
    buf = getattr(pool, "kv_buffer", None)
    if _IMPORT_ERROR is not None or not isinstance(buf, torch.Tensor) or (array := _bytes_of(buf)) is None:
        return None
    try:
        return Spans(array, (np.asarray(ptrs, np.int64) - buf.data_ptr()).reshape(n, per), size)
    except ValueError:  # a region outside the buffer
        return None


if _IMPORT_ERROR is None:

    def _bytes_of(t: torch.Tensor) -> np.ndarray | None:
        """A contiguous CPU tensor's bytes (a view, whatever its dtype); None for any other."""
        if t.device.type != "cpu" or not t.is_contiguous():
            return None
        return t.detach().reshape(-1).view(torch.uint8).numpy()

    # Pools whose state each TP rank holds its own share of, even in an MLA model whose KV
    # pages are one copy for every rank: SGLang's file backend keys these per TP rank, and
    # its cache controller backs them up on every rank (``should_backup``).
    TP_SHARDED_POOLS = frozenset({PoolName.MAMBA.value})

    def _dtype_name(dtype: Any) -> str:
        return str(dtype).removeprefix("torch.")

    def _in_place_regions(host: Any, sizes: list) -> int:
        """How many regions each page of the host pool ``host`` lies in (``sizes``: one page's,
        from ``get_page_buffer_meta``), where kvstored can move its pages in place: one
        tensor, pages of at most :data:`MAX_REGIONS_IN_PLACE` equal regions. 0 (and a log
        line) elsewhere: its pages move through staging."""
        buf = getattr(host, "kv_buffer", None)
        if not isinstance(buf, torch.Tensor) or _bytes_of(buf) is None:
            why = "its pages are not in one contiguous CPU tensor"
        elif len(set(sizes)) != 1 or len(sizes) > MAX_REGIONS_IN_PLACE:
            why = (f"a page lies in {len(sizes)} regions (layout {getattr(host, 'layout', '?')}): in place, kvstored "
                   f"would keep it in as many parts; page_first layouts lie in 2 (K, V; MLA: 1)")
        else:
            try:
                block_geometry(sum(sizes), len(sizes))
                return len(sizes)
            except ValueError as exc:
                why = str(exc)
        log.info("KVDrive storage: pages move through staging, one copy each way on this side: %s", why)
        return 0

    class _Pool:
        """One host pool of the v2 interface and the block store of its pages.

        ``regions``: pages move through the regions ``get_page_buffer_meta`` reports (else
        as flat page tensors: ``get_data_page`` / ``set_from_flat_data_page``); ``shared``:
        one copy for every TP rank (stored and deleted by the storage writer only)."""

        def __init__(self, name: str, host: Any, store: BlockStore, regions: bool, shared: bool) -> None:
            self.name, self.host, self.store, self.regions, self.shared = name, host, store, regions, shared

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
            self.config = storage_config
            self.mem_pool_host = None
            self.store: BlockStore | None = None  # made once the page size is known
            self.pools: dict[str, _Pool] = {}  # the v2 interface's other host pools, by pool name
            self._warned: set[tuple[str, str]] = set()  # (what, pool name) logged once already
            self._make = threading.Lock()
            self._ops: dict[str, list] = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                                          "backup_bandwidth": []}

        # ------------------------------------------------------------ the block store

        def register_mem_pool_host(self, mem_pool_host: Any) -> None:
            """Take SGLang's host pool: its pages (``get_size_per_token() * page_size`` bytes,
            in its layout and dtype) are this backend's blocks."""
            if getattr(mem_pool_host, "kv_buffer", None) is None:
                raise ValueError(f"KVDriveHiCacheStorage stores the KV pool's pages; {type(mem_pool_host).__name__} "
                                 f"holds none of its own (a logical KV anchor, as DeepSeek V4's, is not supported)")
            cfg = self.config
            pool_dcp = (getattr(mem_pool_host, "dcp_rank", 0), getattr(mem_pool_host, "dcp_size", 1))
            if pool_dcp != (cfg.dcp_rank, cfg.dcp_size) or (
                    cfg.dcp_size > 1 and _page_tokens(mem_pool_host) != cfg.logical_page_size):
                raise ValueError(f"KVDriveHiCacheStorage: the host pool holds DCP rank {pool_dcp[0]} of {pool_dcp[1]} "
                                 f"(pages of {_page_tokens(mem_pool_host)} host indices), the storage config is DCP "
                                 f"rank {cfg.dcp_rank} of {cfg.dcp_size} (pages of {cfg.logical_page_size})")
            super().register_mem_pool_host(mem_pool_host)
            page_bytes = mem_pool_host.get_size_per_token() * mem_pool_host.page_size  # the rows this rank holds
            regions = 0  # in place where the pool allows it: only with interface_v1 (else SGLang passes flat pages)
            if self.interface_v1:  # a layout the pool has no page regions for fails here, not at each call
                _, sizes = mem_pool_host.get_page_buffer_meta(torch.arange(_page_tokens(mem_pool_host)))
                if sum(sizes) != page_bytes:
                    raise ValueError(f"KVDriveHiCacheStorage: the host pool's page regions are {sum(sizes)} bytes, "
                                     f"its pages {page_bytes} (layout {mem_pool_host.layout} is not supported)")
                regions = _in_place_regions(mem_pool_host, sizes)
            layout = mem_pool_host.layout if self.interface_v1 else f"{mem_pool_host.layout}-flat"
            dtype = _dtype_name(mem_pool_host.dtype)
            with self._make:
                if self.store is not None:
                    self.store.close()
                self.store = self._new_store(page_bytes, f"{self.shard}.{layout}.{dtype}", regions or 1)
                if regions:
                    self.store.share(_bytes_of(mem_pool_host.kv_buffer))
                self.store.open_early()  # the first prefetch or backup pays no set-up

        def _new_store(self, page_bytes: int, rank: str, regions: int = 1) -> BlockStore:
            store = BlockStore(page_bytes, engine="sglang", model=self.model, tenant=self.tenant, rank=rank,
                               regions=regions, **self._store_args)
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
            return _regions(pool, self.store.block_bytes, len(keys), host_indices)

        def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
            """How many leading keys have their page stored (one lookup request)."""
            return self.store.prefix(keys) if self.store is not None and keys else 0

        def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                         extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
            """Load each key's page into the host pool at its host indices (page ``i`` of the
            call starts at ``host_indices[i * page_size]``, the controller's page: the pool's
            ``logical_page_size`` under DCP); True for each page loaded."""
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

        # ------------------------------------------------------------ hybrid models' host pools (v2 interface)

        def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
            """Take one host pool of a hybrid model (SGLang registers each entry of its host
            pool group: the KV anchor, Mamba state, SWA KV, ...): its pages
            (``get_size_per_token() * page_size`` bytes) get a block namespace of their own,
            named by the pool, made here. The KV pool is the anchor's
            (:meth:`register_mem_pool_host`). A pool registered again replaces the first.
            Raises ValueError for a pool whose pages neither its regions nor flat page
            tensors can move, or that kvstored cannot hold (as the anchor's registration does).
            Under decode context parallelism a pool other than Mamba state is refused: a log
            line, and its pages are not stored and miss."""
            super().register_mem_host_pool_v2(host_pool, host_pool_name)
            name = str(host_pool_name)
            if name == PoolName.KV.value:
                if self.mem_pool_host is None:
                    self.register_mem_pool_host(host_pool)
                elif host_pool is not self.mem_pool_host:
                    log.warning("KVDrive storage: a KV pool registered through v2 that is not the anchor "
                                "register_mem_pool_host took; KV pages stay the anchor's")
                return
            if self.config.dcp_size > 1 and name not in TP_SHARDED_POOLS:
                log.error("KVDrive storage: host pool %s under decode context parallelism (DCP rank %d of %d): "
                          "SGLang %s keeps only the MLA KV pool and Mamba state in storage under DCP, and which "
                          "share of this pool's pages each DCP rank holds is not known here; its pages are not "
                          "stored and miss", name, self.config.dcp_rank, self.config.dcp_size, SGLANG_VERSION)
                with self._make:
                    old = self.pools.pop(name, None)
                    self._warned.add(("unknown", name))  # its misses log nothing more
                if old is not None:
                    old.store.close()
                return
            page_bytes = host_pool.get_size_per_token() * host_pool.page_size
            sizes = self._page_regions_of(host_pool, page_bytes)
            regions = sizes is not None
            if not regions and not all(hasattr(host_pool, m) for m in ("get_data_page", "get_dummy_flat_data_page",
                                                                         "set_from_flat_data_page")):
                raise ValueError(f"KVDriveHiCacheStorage: host pool {name} ({type(host_pool).__name__}) reports no "
                                 f"page regions of {page_bytes} bytes and has no flat pages")
            dtypes = [_dtype_name(host_pool.dtype)]
            other = getattr(host_pool, "temporal_dtype", None)  # a Mamba pool's SSM state
            if other is not None and _dtype_name(other) != dtypes[0]:
                dtypes.append(_dtype_name(other))
            layout = str(getattr(host_pool, "layout", "unknown")) + ("" if regions else "-flat")
            shared = name not in TP_SHARDED_POOLS
            rank = f"{_shard(self.config, tp_sharded=not shared)}.{name}.{layout}.{'+'.join(dtypes)}"
            in_place = _in_place_regions(host_pool, sizes) if regions else 0
            store = self._new_store(page_bytes, rank, in_place or 1)
            if in_place:
                store.share(_bytes_of(host_pool.kv_buffer))
            with self._make:
                old = self.pools.get(name)
                self.pools[name] = _Pool(name, host_pool, store, regions, shared)
                self._warned.discard(("unknown", name))
            if old is not None:
                old.store.close()

        @staticmethod
        def _page_regions_of(host_pool: Any, page_bytes: int) -> list | None:
            """The sizes of a page's regions the pool reports (``get_page_buffer_meta``), where
            they are all ``page_bytes`` of it: pages move through them, else (None) as flat
            page tensors."""
            try:
                _, sizes = host_pool.get_page_buffer_meta(torch.arange(_page_tokens(host_pool), dtype=torch.int64))
            except Exception:  # noqa: BLE001 - no regions (Mamba slot side states, layer_first, ...)
                return None
            return list(sizes) if sizes and sum(sizes) == page_bytes else None

        def _pool(self, name: Any) -> _Pool | None:
            """The registered pool of that name (the KV anchor for ``kv``); None, logged once
            per name, for one never registered."""
            key = str(name)
            if key == PoolName.KV.value:
                if self.store is None or self.mem_pool_host is None:
                    return None
                return _Pool(key, self.mem_pool_host, self.store, self.interface_v1, True)
            pool = self.pools.get(key)
            if pool is None and ("unknown", key) not in self._warned:
                self._warned.add(("unknown", key))
                log.error("KVDrive storage: no host pool %r registered (register_mem_host_pool_v2); its pages miss",
                          key)
            return pool

        def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                            extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
            """The usable prefix of ``keys`` (KV page hashes) where every pool of
            ``pool_transfers`` must be there too, as SGLang's file and Mooncake backends fold it:
            the KV pool's leading run of stored pages; then, per transfer in order, the prefix
            lengths that pool can serve: ``ALL_PAGES``, each of its pages up to there (by the
            same KV keys); ``TRAILING_PAGES``, the last ``len(transfer.keys)`` (at least 1)
            pages before it. ``kv_hit_pages`` is the longest length every pool serves,
            ``restorable_prefix_pages`` all of them, ``extra_pool_hit_pages`` each pool's own
            boundary (KV's too; none for a pool with none). A ``BLOCK_GROUPS`` pool neither
            gates the hit nor gets a boundary (SGLang 0.5.23 defines no backend semantics for
            it). One lookup request per pool; never raises (a failure: no hit)."""
            try:
                return self._exists_v2(list(keys), list(pool_transfers or []))
            except Exception:  # noqa: BLE001 - nothing raises into SGLang
                log.exception("KVDrive storage: batch_exists_v2 failed; answered as no hit")
                return PoolTransferResult(0, {}, [])

        def _exists_v2(self, keys: list[str], transfers: list[PoolTransfer]) -> PoolTransferResult:
            kv_pages = self.batch_exists(keys) if keys else 0
            hits: dict = {PoolName.KV: kv_pages} if kv_pages else {}
            restorable = list(range(1, kv_pages + 1))
            for t in transfers:
                if not restorable:
                    break
                if t.hit_policy == PoolHitPolicy.BLOCK_GROUPS:
                    if ("block_groups", str(t.name)) not in self._warned:
                        self._warned.add(("block_groups", str(t.name)))
                        log.warning("KVDrive storage: pool %s has hit policy BLOCK_GROUPS, which SGLang 0.5.23 "
                                    "defines for no backend: it gets no verdict and does not gate the hit", t.name)
                    continue
                pool = self._pool(t.name)
                there = pool.store.lookup(keys[:kv_pages]) if pool is not None else [False] * kv_pages
                if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                    boundary = next((i for i, f in enumerate(there) if not f), kv_pages)
                    serves = set(range(1, boundary + 1))
                elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                    window = max(1, len(t.keys) if t.keys else 1)
                    serves, run = set(), 0
                    for length, found in enumerate(there, start=1):  # run: stored pages ending at this length
                        run = run + 1 if found else 0
                        if run >= min(window, length):
                            serves.add(length)
                    boundary = max(serves, default=0)
                else:
                    log.error("KVDrive storage: pool %s has hit policy %r; answered as no hit", t.name, t.hit_policy)
                    serves, boundary = set(), 0
                if boundary:
                    hits[t.name] = boundary
                restorable = [n for n in restorable if n in serves]
            return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

        def batch_get_v2(self, transfers: list[PoolTransfer],
                         extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
            """Load each transfer's pages (``transfer.keys``, page ``i`` at
            ``transfer.host_indices[i * page_size]`` of that pool) from its pool's namespace
            into its host pool: per pool name, True for each page loaded. Never raises (a
            failure: False)."""
            return self._io_v2(transfers, self._get_pages)

        def batch_set_v2(self, transfers: list[PoolTransfer],
                         extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
            """Store each transfer's pages from its host pool in its pool's namespace: per
            pool name, True for each page stored (now or before). A rank that is not a
            storage writer stores only pools each rank holds its own share of (Mamba); the
            others, one copy for every rank, are the writer's (True). Never raises."""
            return self._io_v2(transfers, self._set_pages)

        def _io_v2(self, transfers: list[PoolTransfer], move: Any) -> dict[str, list[bool]]:
            results: dict = {}
            for t in transfers or []:
                keys = list(t.keys or [])
                try:
                    results[t.name] = move(t, keys) if keys else []
                except Exception:  # noqa: BLE001 - nothing raises into SGLang
                    log.exception("KVDrive storage: %s of %d page(s) of pool %s failed; treated as not done",
                                  move.__name__.strip("_"), len(keys), t.name)
                    results[t.name] = [False] * len(keys)
            return results

        def _set_pages(self, t: PoolTransfer, keys: list[str]) -> list[bool]:
            pool = self._pool(t.name)
            if pool is None:
                return [False] * len(keys)
            if pool.shared and not self.writer:
                return [True] * len(keys)
            bb = pool.store.block_bytes
            if pool.regions:
                sources = _regions(pool.host, bb, len(keys), t.host_indices)
            elif _whole_pages(pool.host, len(keys), t.host_indices):
                ps = _page_tokens(pool.host)
                sources = [_bytes_of(pool.host.get_data_page(int(t.host_indices[i * ps]), flat=True).contiguous())
                           for i in range(len(keys))]
                if any(v is None or v.nbytes != bb for v in sources):
                    log.error("KVDrive storage: pool %s's flat pages are not CPU pages of %d bytes", t.name, bb)
                    sources = None
            else:
                sources = None
            return [False] * len(keys) if sources is None else pool.store.store(keys, sources)

        def _get_pages(self, t: PoolTransfer, keys: list[str]) -> list[bool]:
            pool = self._pool(t.name)
            if pool is None:
                return [False] * len(keys)
            bb = pool.store.block_bytes
            if pool.regions:
                targets = _regions(pool.host, bb, len(keys), t.host_indices)
                return [False] * len(keys) if targets is None else pool.store.load(keys, targets)
            if not _whole_pages(pool.host, len(keys), t.host_indices):
                return [False] * len(keys)
            pages = [pool.host.get_dummy_flat_data_page() for _ in keys]
            views = [_bytes_of(page) for page in pages]
            if any(v is None or v.nbytes != bb for v in views):
                log.error("KVDrive storage: pool %s's flat pages are not CPU pages of %d bytes", t.name, bb)
                return [False] * len(keys)
            got = pool.store.load(keys, views)
            ps = _page_tokens(pool.host)
            for i, ok in enumerate(got):
                if ok:
                    try:
                        pool.host.set_from_flat_data_page(int(t.host_indices[i * ps]), pages[i])
                    except Exception:  # noqa: BLE001 - this page is a miss
                        log.exception("KVDrive storage: pool %s took no page at host index %d", t.name,
                                      int(t.host_indices[i * ps]))
                        got[i] = False
            return got

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
            """Delete the pages of this backend's namespaces (the KV pool's and each v2 pool's):
            what this user stored there (this process, the other engines of its model, tenant
            and shard, or earlier runs), as SGLang's file backend empties its directory. A rank
            that is not a storage writer deletes only the pools it stores its own share of
            (Mamba state), not the one copy the writer keeps for every rank."""
            stores = [self.store] if self.store is not None and self.writer else []
            stores += [p.store for p in list(self.pools.values()) if self.writer or not p.shared]
            for store in stores:
                deleted = store.delete_all()
                log.info("KVDrive storage: clear() deleted %d page(s) of namespace %s", deleted, store.ns)

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
            """The KV pool's block store's counters (see :meth:`BlockStore.stats`)."""
            return {} if self.store is None else self.store.stats()

        def pool_stats(self) -> dict[str, dict]:
            """Each v2 pool's block store's counters, by pool name."""
            return {name: p.store.stats() for name, p in list(self.pools.items())}

        def close(self) -> None:
            """Free kvstored's buffers and the connections; later calls are misses."""
            if self.store is not None:
                self.store.close()
            for p in list(self.pools.values()):
                p.store.close()

else:

    def __getattr__(name: str) -> Any:
        if name == "KVDriveHiCacheStorage":
            raise ImportError(
                f"KVDriveHiCacheStorage needs SGLang's HiCache storage API (sglang=={SGLANG_VERSION}: "
                f"pip install 'kvdrive[sglang]'); importing it failed: {_IMPORT_ERROR}"
            )
        raise AttributeError(name)
