"""kvstored as a secondary tier of vLLM's KV offloading (``TieringOffloadingSpec``).

Built and checked against vLLM 0.34.0 (``pip install kvdrive[vllm]``); the tiering API
is marked experimental by vLLM and changed between releases. Configure it in the
connector's extra config::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 10737418240,
        "secondary_tiers": [{"type": "KVDriveTier",
                             "module_path": "kvdrive_client.integrations.vllm",
                             "address": "ipc:///run/kvdrive/kvstored.sock", "tenant": "team-a"}]}}'

Every option of :class:`KVDriveTier` after ``backpressure_detector`` may be given there.

How it meets the tier's contract (``SecondaryTierManager``): nothing blocks the
scheduler. A lookup of a key not known here answers ``RETRY`` and joins the step's
batch, which a background thread asks kvstored in one request at the step's end; the
answer is ``HIT`` or ``MISS`` at the next lookup. Keys known stored are remembered, at
most ``known_keys`` of them (:mod:`~kvdrive_client.integrations.known_keys`): a key
forgotten is asked again, never a wrong hit; the answers of the last two steps are kept
whatever the bound, so each is read at least once. Stores and loads run on channels of
their own (``store_channels``, default 1, and ``load_channels``, default 2: each a
thread, a connection and a staging region, opened when the tier is built so the first
job pays no set-up; a load never waits behind a store) through a
:class:`~kvdrive_client.integrations.blocks.BlockStore`, and finish through
``get_finished_jobs``. Store jobs queued behind one another are stored by one call, up
to ``COALESCE_BYTES`` (64 MiB): one lookup and puts of up to a staging slot each
instead of a lookup, a put and a commit per job, each job told of its own keys; load
jobs queued together are loaded by one call, up to ``LOAD_COALESCE_BYTES`` (32 MiB). A daemon that is down or dies makes lookups misses and jobs
failures within about a second (no exception reaches vLLM, nothing waits on it); one
that comes back is used again. vLLM's CPU tier is a file in /dev/shm (its
``SharedOffloadRegion``), so the tier registers that file with kvstored as a pool and
kvstored writes loaded blocks into their chunks, and reads stored ones from theirs, in
place: no copy in vLLM's process (``zero_copy``, default on; ``BlockStore.share``).
Where the CPU tier is other memory (or ``zero_copy`` is off), blocks are copied between
it and shared buffers registered with kvstored (one memcpy per block each way; a load's
by one compiled call per get, ``BlockStore.load_rows``). A chunk over 64 MiB
(Llama-3-70B with ``block_size`` 256: 80 MiB) is kept as parts of one sequence.

Keys match across restarts with vLLM's default ``--prefix-caching-hash-algo sha256``;
with ``xxhash`` only where ``PYTHONHASHSEED`` is set alike for every vLLM process
(docs/engines.md, Keys across restarts).

Verified here: the adapter against vLLM's real base classes and job types, driven as
the tiering manager drives a tier, against a real kvstored (tests/integrations). Not
verified: a vLLM engine serving on a GPU with this tier.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvdrive_client.integrations.blocks import BlockStore
from kvdrive_client.integrations.known_keys import DEFAULT_CAPACITY, KnownKeys
from kvdrive_client.locate import DEFAULT

log = logging.getLogger(__name__)

VLLM_VERSION = "0.34.0"

try:
    from vllm.v1.kv_offload.base import (
        Locality, LookupResult, Medium, OffloadingCounterMetadata, OffloadingEvent, OffloadingGaugeMetadata,
        RequestOffloadingContext,
    )
    from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
except ImportError as _exc:  # vLLM is not installed: the module imports, the tier does not exist
    _IMPORT_ERROR: ImportError | None = _exc
else:
    _IMPORT_ERROR = None

_STOP = object()
# Store jobs queued together are stored by one call, up to this many bytes: for small
# blocks a job's fixed cost (a lookup, a put's round trip and commit) is most of its time.
COALESCE_BYTES = 64 << 20
# Load jobs queued together are loaded by one call, up to this many bytes: a call's fixed
# cost (the Python on both sides and a round trip, about 1 ms) is the time of several MiB
# of copies, while the first job of a call waits for the rest of it (32 MiB: about 4 ms).
# Only jobs already queued are taken, so a job that finds the workers free waits for none.
# 64 KiB blocks in place, jobs of 32, DRAM tier, side by side in 7 alternating runs: GB/s
# 5.3-7.1 (mean 6.2) at 16 MiB, 6.6-8.8 (7.2) at 32 MiB, 6.7-8.5 (7.9) at 64 MiB.
LOAD_COALESCE_BYTES = 32 << 20


@dataclass(frozen=True)
class _Metric:
    """One of the tier's own metrics: from which counters of :meth:`KVDriveTier.stats`, with
    which label values each."""

    counter: bool  # else a gauge
    documentation: str
    sources: tuple[tuple[str, tuple[str, ...]], ...]
    labelnames: tuple[str, ...] = ()


# The tier's own metrics; vLLM's tiering manager already counts each tier's bytes, times
# and failed jobs from the job results.
METRICS = {
    "vllm:kv_offload_kvdrive_keys_looked_up": _Metric(
        True, "Keys the KVDrive tier asked kvstored about, by whether their block was found",
        (("keys_found", ("found",)), ("keys_missing", ("missing",))), ("result",)),
    "vllm:kv_offload_kvdrive_blocks_failed": _Metric(
        True, "Blocks whose load, store or lookup in kvstored failed (a miss, or a store not done), by operation",
        (("load_failed", ("load",)), ("store_failed", ("store",)), ("lookup_failed", ("lookup",))), ("op",)),
    "vllm:kv_offload_kvdrive_unavailable": _Metric(
        True, "Times the KVDrive tier found kvstored unavailable (then answered with misses for retry_s)",
        (("unavailable", ()),)),
    "vllm:kv_offload_kvdrive_keys_forgotten": _Metric(
        True, "Keys the KVDrive tier's scheduler side forgot to stay within known_keys (asked again when next "
              "looked up)", (("keys_forgotten", ()),)),
    "vllm:kv_offload_kvdrive_known_keys": _Metric(
        False, "Keys the KVDrive tier's scheduler side knows stored", (("known_keys", ()),)),
}


def _model_namespace(spec: Any) -> tuple[str, str | None]:
    """The model name and the parallel layout from vLLM's offloading config, where given."""
    config = getattr(spec, "config", None)
    model = getattr(getattr(config, "model", None), "name", None)
    dtype = getattr(getattr(config, "model", None), "dtype", None)
    par = getattr(config, "parallel", None)
    layout = None
    if par is not None and not getattr(par, "is_parallelism_agnostic", False):
        layout = f"tp{getattr(par, 'tp_size', 1)}pp{getattr(par, 'pp_size', 1)}"
    name = None if model is None else (f"{model}:{dtype}" if dtype else str(model))
    return name, layout


if _IMPORT_ERROR is None:

    class KVDriveTier(SecondaryTierManager):
        """vLLM's secondary tier in kvstored (see the module for the configuration).

        Options: ``address`` (default: the daemon ``connect()`` finds), ``model`` (default:
        vLLM's model name and dtype), ``tenant`` (a namespace of its own per tenant),
        ``lookup_timeout`` / ``timeout`` (seconds per lookup / data request), ``retry_s``
        (how long a daemon found down is answered with misses), ``staging_bytes`` (each
        staging region), ``load_channels`` / ``store_channels`` (load / store jobs run at
        once, each with a connection and staging region of its own), ``known_keys`` (the
        most keys the scheduler side remembers, :mod:`~kvdrive_client.integrations.known_keys`),
        ``enable_kv_events`` (a stored event for each store job's keys, where vLLM's KV cache
        events are on), ``locality`` (of the events; kvstored is local: ``LOCAL``).
        """

        medium = Medium.STORAGE

        def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                     backpressure_detector: Any = None, *, address: str | None = None, model: str | None = None,
                     tenant: str = "default", lookup_timeout: float = 1.0, timeout: float = 10.0,
                     retry_s: float = 1.0, staging_bytes: int = 64 << 20, load_channels: int = 2,
                     store_channels: int = 1, known_keys: int = DEFAULT_CAPACITY, enable_kv_events: bool = False,
                     locality: str = "LOCAL", zero_copy: bool = True) -> None:
            super().__init__(offloading_spec=offloading_spec, primary_kv_view=primary_kv_view, tier_type=tier_type,
                             backpressure_detector=backpressure_detector)
            spec_model, layout = _model_namespace(offloading_spec)
            model = model or spec_model
            if not model:
                raise ValueError("KVDriveTier needs the model's name: vLLM's offloading config has none; "
                                 "set \"model\" in the tier's configuration")
            flat = np.frombuffer(primary_kv_view.cast("B"), dtype=np.uint8)
            self._rows = flat.reshape(-1, self.block_size_bytes)  # chunk b is row b, no copy
            self._known = KnownKeys(known_keys)
            self.locality = Locality(locality)  # kvstored is a daemon of this host
            self._events: list | None = None
            if enable_kv_events:
                events_on = getattr(getattr(offloading_spec, "kv_events_config", None), "enable_kv_cache_events", False)
                if events_on:
                    self._events = []
                else:
                    log.warning("KVDrive tier: enable_kv_events is set but vLLM's KV cache events are off; "
                                "the tier emits none")
            self._reported: dict[str, int] = {}  # stats() as of the last get_stats()
            self.store = BlockStore(self.block_size_bytes, engine="vllm", model=model, tenant=tenant, rank=layout,
                                    address=DEFAULT if address is None else address, timeout=timeout,
                                    lookup_timeout=lookup_timeout, retry_s=retry_s, staging_bytes=staging_bytes,
                                    load_channels=load_channels, store_channels=store_channels)
            if zero_copy:
                self.store.share(flat)  # vLLM's CPU tier is a file in /dev/shm: kvstored moves its rows in place
            self.store.open_early()  # vLLM builds its tiers at start-up: the first job pays no set-up
            self._asked: set[bytes] = set()  # keys whose lookup is queued or in flight
            # Answers of the last two steps, kept whatever the bound: a request needing more
            # keys than known_keys still gets each answer at least once.
            self._fresh: dict[bytes, bool] = {}
            self._fresh_before: dict[bytes, bool] = {}
            self._batch: list[bytes] = []  # keys to ask at the step's end
            self._finished: list[JobResult] = []
            self._outstanding = 0  # jobs submitted, result not yet handed to vLLM
            self._done: queue.SimpleQueue = queue.SimpleQueue()
            # A queue and its own threads per kind of work: a load never waits behind a store.
            self._queues = {"lookup": queue.Queue(), "load": queue.Queue(), "store": queue.Queue()}
            widths = {"lookup": 1, "load": load_channels, "store": store_channels}
            self._workers = [(kind, threading.Thread(target=self._serve, args=(kind,), name=f"kvdrive-vllm-{kind}-{i}",
                                                     daemon=True)) for kind, n in widths.items() for i in range(n)]
            for _, t in self._workers:
                t.start()
            log.info("KVDrive tier for vLLM: namespace %s, %d chunks of %d bytes in the CPU tier, %d load and %d "
                     "store channels, up to %d keys remembered", self.store.ns, len(self._rows), self.block_size_bytes,
                     load_channels, store_channels, known_keys)

        # ------------------------------------------------------------ scheduler side

        def lookup(self, key: bytes, req_context: Any) -> LookupResult:
            self._drain()
            stored = self._answer(key)
            if stored is not None:
                return LookupResult.HIT if stored else LookupResult.MISS
            if key not in self._asked:
                self._asked.add(key)
                self._batch.append(key)
            return LookupResult.RETRY

        def on_schedule_end(self, context: Any) -> None:
            self._flush()
            self._fresh_before, self._fresh = self._fresh, {}

        def _answer(self, key: bytes) -> bool | None:
            for fresh in (self._fresh, self._fresh_before):
                stored = fresh.get(key)
                if stored is not None:
                    if not stored:
                        del fresh[key]
                        self._known.forget([key])
                    return stored
            return True if self._known.stored(key) else None  # not known: asked (a MISS is answered once)

        def has_pending_work(self) -> bool:
            self._drain()
            return bool(self._asked or self._outstanding)

        def submit_store(self, job_metadata: TransferJob) -> None:
            self._outstanding += 1
            self._queues["store"].put(job_metadata)

        def submit_load(self, job_metadata: TransferJob) -> None:
            self._outstanding += 1
            self._queues["load"].put(job_metadata)

        def get_finished_jobs(self) -> Iterable[JobResult]:
            self._flush()
            self._drain()
            out, self._finished = self._finished, []
            self._outstanding -= len(out)
            return out

        def on_new_request(self, req_context: Any) -> RequestOffloadingContext:
            return RequestOffloadingContext()

        def drain_jobs(self) -> None:
            for kind in ("load", "store"):
                self._queues[kind].join()  # every job ends: each request to kvstored has a timeout
            self._drain()

        def shutdown(self) -> None:
            for kind, _ in self._workers:
                self._queues[kind].put(_STOP)
            for _, t in self._workers:
                t.join(timeout=max(30.0, self.store.timeout * 3))
            self.store.close()

        def take_events(self) -> Iterable[Any]:
            """Stored events of the store jobs finished since the last call (``enable_kv_events``).
            Blocks kvstored deletes (``--quota``, a ``clear``) are not announced: kvstored does
            not tell its clients; a lookup of them misses."""
            if not self._events:
                return ()
            out, self._events = self._events, []
            return out

        @classmethod
        def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
            return {name: (OffloadingCounterMetadata if m.counter else OffloadingGaugeMetadata)(
                        documentation=m.documentation, labelnames=m.labelnames) for name, m in METRICS.items()}

        def get_stats(self) -> Any:
            """:data:`METRICS` since the last call, as vLLM's ``OffloadingConnectorStats``."""
            # Imported here: the module imports vLLM's config and much else.
            from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (  # noqa: PLC0415
                OffloadingConnectorStats,
            )

            now, out = self.stats(), OffloadingConnectorStats()
            for name, m in METRICS.items():
                for key, labels in m.sources:
                    if not m.counter:
                        out.set_gauge(name, now.get(key, 0), labels)
                    elif now.get(key, 0) > self._reported.get(key, 0):
                        out.increase_counter(name, now.get(key, 0) - self._reported.get(key, 0), labels)
            self._reported = now
            return out

        def stats(self) -> dict:
            """The block store's counters (see :meth:`BlockStore.stats`), and ``known_keys`` /
            ``keys_forgotten``: the keys the scheduler side remembers / has had to forget."""
            return {**self.store.stats(), "known_keys": len(self._known), "keys_forgotten": self._known.num_forgotten}

        def _flush(self) -> None:
            if self._batch:
                self._queues["lookup"].put(self._batch)
                self._batch = []

        def _drain(self) -> None:
            while True:
                try:
                    kind, payload = self._done.get_nowait()
                except queue.Empty:
                    return
                if kind == "lookup":
                    self._asked.difference_update(k for k, _ in payload)
                    self._fresh.update(payload)
                    self._known.add_stored(k for k, found in payload if found)
                else:  # a job's result, with the keys now known stored or not loadable
                    result, stored, lost, job = payload
                    if self._events is not None and stored and not job.is_promotion:
                        self._events.append(OffloadingEvent(keys=list(stored), medium=self.medium, removed=False,
                                                            locality=self.locality, ownership=self.tier_type,
                                                            req_context=job.req_context))
                    self._known.add_stored(stored)
                    self._known.forget(lost)
                    for fresh in (self._fresh, self._fresh_before):
                        fresh.update(dict.fromkeys(stored, True))
                        for key in lost:
                            fresh.pop(key, None)
                    self._finished.append(result)

        # ------------------------------------------------------------ the worker threads

        def _serve(self, kind: str) -> None:
            work = self._queues[kind]
            while True:
                taken = [work.get()]
                if kind != "lookup" and taken[0] is not _STOP:
                    limit = COALESCE_BYTES if kind == "store" else LOAD_COALESCE_BYTES
                    taken += self._waiting(work, len(taken[0].keys), limit)
                stop = taken[-1] is _STOP
                try:
                    if not stop or len(taken) > 1:
                        self._run(kind, taken[:-1] if stop else taken)
                finally:
                    for _ in taken:
                        work.task_done()
                if stop:
                    return

        def _waiting(self, work: queue.Queue, keys: int, limit: int) -> list:
            """The jobs queued behind one of ``keys`` blocks, up to ``limit`` bytes with it (and a stop, last)."""
            more: list = []
            while (keys + 1) * self.block_size_bytes <= limit:
                try:
                    job = work.get_nowait()
                except queue.Empty:
                    break
                more.append(job)
                if job is _STOP:
                    break
                keys += len(job.keys)
            return more

        def _run(self, kind: str, payloads: list) -> None:
            try:
                if kind == "lookup":
                    self._done.put(("lookup", list(zip(payloads[0], self.store.lookup(payloads[0])))))
                else:
                    for out in (self._load if kind == "load" else self._store)(payloads):
                        self._done.put(("job", out))
            except Exception:  # noqa: BLE001 - a bug here must not hang vLLM's jobs
                log.exception("KVDrive tier: %s failed", kind)
                if kind == "lookup":
                    self._done.put(("lookup", [(k, False) for k in payloads[0]]))
                else:
                    for job in payloads:
                        self._done.put(("job", (JobResult(job_id=job.job_id, success=False), (), (), job)))

        def _store(self, jobs: list[TransferJob]) -> list[tuple]:
            """Store jobs by one call (one lookup, puts of up to a staging slot each); each job's
            result, its share of the call's time by its blocks."""
            def store(keys: list) -> list[bool]:
                return self.store.store_rows(keys, self._rows, (int(c) for job in jobs for c in job.chunk_ids))

            out = []
            for job, stored, lost, took in self._by_job(jobs, store):
                out.append((JobResult(job_id=job.job_id, success=not lost, transfer_time=took,
                                      transfer_bytes=len(stored) * self.block_size_bytes), stored, (), job))
            return out

        def _load(self, jobs: list[TransferJob]) -> list[tuple]:
            """Load jobs by one call; each job's result, its share of the call's time by its blocks."""
            def load(keys: list) -> list[bool]:
                return self.store.load_rows(keys, self._rows, (int(c) for job in jobs for c in job.chunk_ids))

            out = []
            for job, loaded, lost, took in self._by_job(jobs, load):
                result = JobResult(job_id=job.job_id, success=not lost, successful_keys=None if not lost else loaded,
                                   transfer_time=took, transfer_bytes=len(loaded) * self.block_size_bytes)
                out.append((result, loaded, lost, job))
            return out

        @staticmethod
        def _by_job(jobs: list[TransferJob], move: Callable[[list], list[bool]]) -> list[tuple]:
            """Run ``move`` once on all the jobs' keys, in order; per job, (job, its keys moved,
            those not, its share of the call's time by its blocks)."""
            keys = [list(job.keys) for job in jobs]
            t0 = time.perf_counter()
            ok = move([k for ks in keys for k in ks])
            took = time.perf_counter() - t0
            out, at, total = [], 0, max(1, len(ok))
            for job, ks in zip(jobs, keys):
                mine = ok[at: at + len(ks)]
                at += len(ks)
                done = [k for k, good in zip(ks, mine) if good]
                failed = [k for k, good in zip(ks, mine) if not good]
                out.append((job, done, failed, took * len(ks) / total))
            return out

else:

    def __getattr__(name: str) -> Any:
        if name == "KVDriveTier":
            raise ImportError(
                f"KVDriveTier needs vLLM's tiering API (vllm=={VLLM_VERSION}: pip install 'kvdrive[vllm]'); "
                f"importing it failed: {_IMPORT_ERROR}"
            )
        raise AttributeError(name)
