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
batch, which one background thread asks kvstored in one request at the step's end; the
answer is ``HIT`` or ``MISS`` at the next lookup. Stores and loads run on that thread
through a :class:`~kvdrive_client.integrations.blocks.BlockStore` and finish through
``get_finished_jobs``. A daemon that is down or dies makes lookups misses and jobs
failures within about a second (no exception reaches vLLM, nothing waits on it); one
that comes back is used again. Blocks are copied between vLLM's CPU tier and one
shared buffer registered with kvstored (one memcpy per block each way).

Verified here: the adapter against vLLM's real base classes and job types, driven as
the tiering manager drives a tier, against a real kvstored (tests/integrations). Not
verified: a vLLM engine serving on a GPU with this tier.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from kvdrive_client.integrations.blocks import BlockStore
from kvdrive_client.locate import DEFAULT

log = logging.getLogger(__name__)

VLLM_VERSION = "0.34.0"

try:
    from vllm.v1.kv_offload.base import LookupResult, Medium, RequestOffloadingContext
    from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
except ImportError as _exc:  # vLLM is not installed: the module imports, the tier does not exist
    _IMPORT_ERROR: ImportError | None = _exc
else:
    _IMPORT_ERROR = None

_STOP = object()


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
        (how long a daemon found down is answered with misses), ``staging_bytes`` (the
        shared buffer blocks move through).
        """

        medium = Medium.STORAGE

        def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                     backpressure_detector: Any = None, *, address: str | None = None, model: str | None = None,
                     tenant: str = "default", lookup_timeout: float = 1.0, timeout: float = 10.0,
                     retry_s: float = 1.0, staging_bytes: int = 64 << 20, locality: Any = None) -> None:
            super().__init__(offloading_spec=offloading_spec, primary_kv_view=primary_kv_view, tier_type=tier_type,
                             backpressure_detector=backpressure_detector)
            spec_model, layout = _model_namespace(offloading_spec)
            model = model or spec_model
            if not model:
                raise ValueError("KVDriveTier needs the model's name: vLLM's offloading config has none; "
                                 "set \"model\" in the tier's configuration")
            flat = np.frombuffer(primary_kv_view.cast("B"), dtype=np.uint8)
            self._rows = flat.reshape(-1, self.block_size_bytes)  # chunk b is row b, no copy
            self.store = BlockStore(self.block_size_bytes, engine="vllm", model=model, tenant=tenant, rank=layout,
                                    address=DEFAULT if address is None else address, timeout=timeout,
                                    lookup_timeout=lookup_timeout, retry_s=retry_s, staging_bytes=staging_bytes)
            self._present: set[bytes] = set()  # keys known stored
            self._absent: set[bytes] = set()  # keys just found missing, answered MISS once
            self._asked: set[bytes] = set()  # keys whose lookup is queued or in flight
            self._batch: list[bytes] = []  # keys to ask at the step's end
            self._finished: list[JobResult] = []
            self._outstanding = 0  # jobs submitted, result not yet handed to vLLM
            self._work: queue.Queue = queue.Queue()
            self._done: queue.SimpleQueue = queue.SimpleQueue()
            self._worker = threading.Thread(target=self._serve, name="kvdrive-vllm-tier", daemon=True)
            self._worker.start()
            log.info("KVDrive tier for vLLM: namespace %s, %d chunks of %d bytes in the CPU tier", self.store.ns,
                     len(self._rows), self.block_size_bytes)

        # ------------------------------------------------------------ scheduler side

        def lookup(self, key: bytes, req_context: Any) -> LookupResult:
            self._drain()
            if key in self._present:
                return LookupResult.HIT
            if key in self._absent:
                self._absent.discard(key)  # asked again next time: another engine may store it
                return LookupResult.MISS
            if key not in self._asked:
                self._asked.add(key)
                self._batch.append(key)
            return LookupResult.RETRY

        def on_schedule_end(self, context: Any) -> None:
            self._flush()

        def has_pending_work(self) -> bool:
            self._drain()
            return bool(self._asked or self._outstanding)

        def submit_store(self, job_metadata: TransferJob) -> None:
            self._outstanding += 1
            self._work.put(("store", job_metadata))

        def submit_load(self, job_metadata: TransferJob) -> None:
            self._outstanding += 1
            self._work.put(("load", job_metadata))

        def get_finished_jobs(self) -> Iterable[JobResult]:
            self._flush()
            self._drain()
            out, self._finished = self._finished, []
            self._outstanding -= len(out)
            return out

        def on_new_request(self, req_context: Any) -> RequestOffloadingContext:
            return RequestOffloadingContext()

        def drain_jobs(self) -> None:
            self._work.join()  # every job ends: each request to kvstored has a timeout
            self._drain()

        def shutdown(self) -> None:
            self._work.put((_STOP, None))
            self._worker.join(timeout=max(30.0, self.store.timeout * 3))
            self.store.close()

        def stats(self) -> dict:
            """The block store's counters (see :meth:`BlockStore.stats`)."""
            return self.store.stats()

        def _flush(self) -> None:
            if self._batch:
                self._work.put(("lookup", self._batch))
                self._batch = []

        def _drain(self) -> None:
            while True:
                try:
                    kind, payload = self._done.get_nowait()
                except queue.Empty:
                    return
                if kind == "lookup":
                    for key, found in payload:
                        self._asked.discard(key)
                        (self._present if found else self._absent).add(key)
                else:  # a job's result, with the keys now known stored or not loadable
                    result, stored, lost = payload
                    self._present.update(stored)
                    self._present.difference_update(lost)
                    self._finished.append(result)

        # ------------------------------------------------------------ the worker thread

        def _serve(self) -> None:
            while True:
                kind, payload = self._work.get()
                try:
                    if kind is _STOP:
                        return
                    if kind == "lookup":
                        self._done.put(("lookup", list(zip(payload, self.store.lookup(payload)))))
                    elif kind == "store":
                        self._done.put(("job", self._store(payload)))
                    else:
                        self._done.put(("job", self._load(payload)))
                except Exception:  # noqa: BLE001 - a bug here must not hang vLLM's jobs
                    log.exception("KVDrive tier: %s failed", kind)
                    if kind == "lookup":
                        self._done.put(("lookup", [(k, False) for k in payload]))
                    elif kind in ("store", "load"):
                        self._done.put(("job", (JobResult(job_id=payload.job_id, success=False), (), ())))
                finally:
                    self._work.task_done()

        def _store(self, job: TransferJob) -> tuple:
            keys = list(job.keys)
            t0 = time.perf_counter()
            ok = self.store.store(keys, [self._rows[int(c)] for c in job.chunk_ids])
            took = time.perf_counter() - t0
            stored = [k for k, good in zip(keys, ok) if good]
            result = JobResult(job_id=job.job_id, success=all(ok), transfer_time=took,
                               transfer_bytes=len(stored) * self.block_size_bytes)
            return result, stored, ()

        def _load(self, job: TransferJob) -> tuple:
            keys = list(job.keys)
            t0 = time.perf_counter()
            ok = self.store.load(keys, [self._rows[int(c)] for c in job.chunk_ids])
            took = time.perf_counter() - t0
            loaded = [k for k, good in zip(keys, ok) if good]
            lost = [k for k, good in zip(keys, ok) if not good]
            result = JobResult(job_id=job.job_id, success=not lost, successful_keys=None if not lost else loaded,
                               transfer_time=took, transfer_bytes=len(loaded) * self.block_size_bytes)
            return result, loaded, lost

else:

    def __getattr__(name: str) -> Any:
        if name == "KVDriveTier":
            raise ImportError(
                f"KVDriveTier needs vLLM's tiering API (vllm=={VLLM_VERSION}: pip install 'kvdrive[vllm]'); "
                f"importing it failed: {_IMPORT_ERROR}"
            )
        raise AttributeError(name)
