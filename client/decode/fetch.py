"""The store side of a session: its sequences, staging buffers, fetches and puts.

Every complete page is in ``kvstored``, one store sequence per batch row. With reuse,
pages below ``base_pages`` live in a kept, token-named prefix sequence per row
instead (:mod:`.prefix`). A fetch is one sparse get naming each block's sequence, into one of two
staging buffers (one fetch lands while the previous one is read). Pages completed
while decoding are written at the end of the step, all layers in one put per row.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass

import numpy as np
import torch

from kvdrive_client.decode.state import Context
from kvdrive_client.decode.prefix import create_prefix
from kvdrive_client.device_cache import HostPlacement
from kvdrive_client.errors import RequestError, StoreError
from kvdrive_client.store import Sequence, StoreClient

log = logging.getLogger(__name__)


@dataclass
class Fetch:
    """A get in flight: ``n`` blocks of ``layer`` into ``staging``."""

    layer: int
    pending: object
    n: int
    staging: object
    started: float
    slot: int = 0


class StoreIO:
    def __init__(self, ctx: Context, store: StoreClient) -> None:
        self.ctx = ctx
        self.store = store
        self.geometry = ctx.shape.geometry(ctx.cfg.page_size)
        self.block_bytes = self.geometry.block_bytes
        self.seqs: list[Sequence] = []
        self.base_names: list[str] | None = None
        self.base_seqs: list[Sequence] = []
        self.base_pages = 0
        self.restored = False
        self.windows = None  # a hybrid model's sliding-layer windows, with reuse (decode/windows.py)
        self._staging: list = [None, None]
        self._staged: list = [None, None]  # each staging buffer as a flat tensor of the model's dtype
        # Prefill puts in flight, by put buffer (layers alternate between two).
        self._put_staging: list = [None, None]
        self._puts: list[list] = [[], []]
        self._page_parts: dict[int, list] = {}
        if not store.hello().get("get_seqs"):
            raise RequestError(f"kvstored at {store.address} does not take gets across sequences; "
                               "upgrade it to this client's version")

    # ------------------------------------------------------------ sequences

    def create_sequences(self) -> None:
        cfg = self.ctx.cfg
        for row in range(self.ctx.batch):
            self.seqs.append(self.store.create(cfg.namespace, f"{uuid.uuid4().hex}-{row}", self.geometry))
        create_prefix(self)

    # ------------------------------------------------------------ puts

    def put_layer(self, layer: int, keys, values, num_pages: int, cluster, importance) -> None:
        """Start storing a layer's prefill pages, with their cluster ids and importance; below
        ``base_pages`` into the kept prefix sequences (unless they came from there).

        The puts are asynchronous: the bytes are copied into one of two put buffers and the
        daemon writes them while the model computes the next layer (a durable put waits for
        the disk). A buffer is reused two layers later, once its puts are acknowledged;
        :meth:`finish_puts` waits for the rest, and a put's error is raised there.
        """
        t0 = time.perf_counter()
        slot = layer % 2
        self._wait_puts(slot)
        b, h, _, d = keys.shape
        s, bb = self.ctx.cfg.page_size, self.block_bytes
        imp = importance.detach().float().cpu().numpy()
        clu = None if cluster is None else cluster.detach().cpu().numpy().astype(np.int32)
        split = min(self.base_pages, num_pages)
        parts = [(self.seqs, split, num_pages)] + ([(self.base_seqs, 0, split)] if split and not self.restored else [])
        parts = [(seqs, lo, hi) for seqs, lo, hi in parts if hi > lo]
        buf = self._put_buffer(slot, sum(b * h * (hi - lo) * bb for _, lo, hi in parts))
        offset, pending = 0, []
        for seqs, lo, hi in parts:
            n = hi - lo
            region = torch.from_numpy(buf.array[offset : offset + b * h * n * bb])
            kv = region.view(keys.dtype).view(b, h, n, 2, s, d)  # one block: its page's K then V
            kv[:, :, :, 0].copy_(keys[:, :, lo * s : hi * s].reshape(b, h, n, s, d))
            kv[:, :, :, 1].copy_(values[:, :, lo * s : hi * s].reshape(b, h, n, s, d))
            for row, seq in enumerate(seqs):
                pending.append(self.store.put_async(
                    seq, [layer], range(lo, hi), buf, offset + row * h * n * bb,
                    cluster=None if clu is None else clu[row : row + 1, :, lo:hi],
                    importance=imp[row : row + 1, :, lo:hi]))
            offset += b * h * n * bb
        self._puts[slot] = pending
        self.ctx.stats["bytes_put"] += offset
        self.ctx.stats["prefill_put_ms"] += (time.perf_counter() - t0) * 1e3

    def _put_buffer(self, slot: int, nbytes: int):
        buf = self._put_staging[slot]
        if buf is None or buf.size < nbytes:
            if buf is not None:
                self.store.unregister(buf)
            buf = self._put_staging[slot] = self.store.register(max(nbytes, 1 << 20))
        return buf

    def _wait_puts(self, slot: int) -> None:
        pending, self._puts[slot] = self._puts[slot], []
        if not pending:
            return
        t0 = time.perf_counter()
        failed = None
        for put in pending:  # every reply is taken, even after an error: the buffer is then free
            try:
                put.wait()
            except StoreError as exc:
                failed = failed or exc
        self.ctx.stats["prefill_put_wait_ms"] += (time.perf_counter() - t0) * 1e3
        if failed is not None:
            raise failed

    def finish_puts(self) -> None:
        """Wait until every prefill put is stored (raising the first error), then free the put
        buffers. Called after the last layer's prefill: no page is fetched before it is stored."""
        t0 = time.perf_counter()
        try:
            for slot in range(len(self._puts)):
                try:
                    self._wait_puts(slot)
                except StoreError:
                    self._wait_puts(1 - slot)  # the other buffer's puts too, before it is freed
                    raise
        finally:
            for slot, buf in enumerate(self._put_staging):
                if buf is not None:
                    self.store.unregister(buf)
                    self._put_staging[slot] = None
            self.ctx.stats["prefill_put_ms"] += (time.perf_counter() - t0) * 1e3

    def queue_page(self, layer: int, page: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """A page completed while decoding, ``[B, H, S, D]``, kept on the device until every layer
        has it; it then travels to the host with the next copy a step makes (:meth:`take_pages`)."""
        self._page_parts.setdefault(page, []).append((layer, torch.stack([keys, values], dim=2)))

    def take_pages(self) -> tuple[list[int], torch.Tensor, int] | None:
        """The pages every layer has completed, as one flat int64 tensor on the device holding their
        bytes (layer-major per page: ``[L, B, H, 2, S, D]``; zero bytes added up to a whole word),
        to copy to the host, and the number of bytes; None when there are none. Such a page is
        local for at least a page of steps more, so nothing fetches it before it is put."""
        pages = [p for p, parts in sorted(self._page_parts.items()) if len(parts) == self.ctx.shape.num_layers]
        if not pages:
            return None
        data = torch.stack([kv for p in pages for _, kv in sorted(self._page_parts.pop(p), key=lambda x: x[0])])
        nbytes = data.numel() * data.element_size()
        if data.shape[-1] * data.element_size() % 8 == 0:
            return pages, data.view(torch.int64).view(-1), nbytes
        flat = data.view(torch.uint8).view(-1)
        return pages, torch.cat([flat, flat.new_zeros(-nbytes % 8)]).view(torch.int64), nbytes

    def put_pages(self, pages: list[int], host_bytes: np.ndarray) -> None:
        """Write taken pages (their bytes on the host) to the store: all layers at once, one put per row."""
        sh, stats = self.ctx.shape, self.ctx.stats
        b = self.ctx.batch
        per_page = host_bytes.reshape(len(pages), sh.num_layers, b, sh.num_kv_heads, self.block_bytes)
        for page, data in zip(pages, per_page):
            t0 = time.perf_counter()
            for row, seq in enumerate(self.seqs):
                self.store.put(seq, range(sh.num_layers), [page], data[:, row, :, None, :])
            stats["bytes_put"] += data.nbytes
            stats["pages_flushed"] += 1
            stats["put_ms"] += (time.perf_counter() - t0) * 1e3

    def flush(self) -> None:
        """Write the pages every layer has completed now (their own copy to the host)."""
        taken = self.take_pages()
        if taken is not None:
            self.put_pages(taken[0], taken[1].cpu().numpy().view(np.uint8)[: taken[2]])

    # ------------------------------------------------------------ gets

    def _staging_buffer(self, slot: int, nbytes: int):
        """Staging buffer ``slot``, at least ``nbytes`` large, once the last copy out of it is done."""
        transfer = self.ctx.kernels.transfer
        transfer.before_reuse(slot)
        buf = self._staging[slot]
        if buf is None or buf.size < nbytes:
            if buf is not None:
                transfer.unregister(buf.array)
                self.store.unregister(buf)
            buf = self._staging[slot] = self.store.register(max(nbytes, 1 << 20))
            transfer.register(buf.array)
            # The buffer as the model's dtype, made once: a fetch's pages are a slice of it.
            self._staged[slot] = torch.from_numpy(buf.array).view(self.ctx.shape.dtype)
        return buf

    def submit(self, layer: int, row0: int, host: HostPlacement, slot: int) -> Fetch | None:
        """Ask the store for the missed pages of rows ``row0 ..`` into staging buffer ``slot``:
        one sparse get naming each block's sequence. None when nothing is missed."""
        n = host.num_misses
        if n == 0:
            return None
        if self._puts[0] or self._puts[1]:  # layers prefilled out of order: nothing is fetched before it is stored
            self.finish_puts()
        staging = self._staging_buffer(slot, n * self.block_bytes)
        rows, page_ids = host.rows + row0, host.missed_pages
        blocks = np.stack([np.full(n, layer), host.heads, page_ids], axis=1)
        # A row's pages below base_pages are in its stored prompt sequence (a restored
        # prefix is loaded before the session's own sequences exist), the rest in its own.
        in_base = page_ids < self.base_pages
        uids = np.empty(n, dtype=np.int64)
        for seqs, where in ((self.base_seqs, in_base), (self.seqs, ~in_base)):
            if where.any():
                uids[where] = np.array([seq.uid for seq in seqs], dtype=np.int64)[rows[where]]
        first = (self.base_seqs if in_base[0] else self.seqs)[int(rows[0])]
        started = time.perf_counter()
        return Fetch(layer, self.store.get_async(first, blocks, staging, seqs=uids), n, staging, started, slot)

    def wait(self, fetch: Fetch, mb: int = 0) -> torch.Tensor:
        """Wait for a fetch; its pages as ``[n, 2, S, D]`` (K, V) on the compute device.

        On the CPU they are views of the staging buffer, valid until that buffer's
        next fetch: copy them (the cache's ``fill`` does) before then.
        """
        ctx = self.ctx
        t0 = time.perf_counter()
        reply = fetch.pending.wait()
        t1 = time.perf_counter()
        worked = reply.get("ms", 0.0) / 1e3
        ctx.timeline.add("fetch", "daemon", fetch.started, fetch.started + worked, layer=fetch.layer, mb=mb, pages=fetch.n)
        ctx.stats["blocks_dram"] += reply["dram"]
        ctx.stats["blocks_ssd"] += reply["ssd"]
        s, d, bb = ctx.cfg.page_size, ctx.shape.head_dim, self.block_bytes
        raw = self._staged[fetch.slot][: fetch.n * 2 * s * d].view(fetch.n, 2, s, d)
        raw = ctx.kernels.transfer.to_device(raw, fetch.slot)
        ctx.stats["bytes_fetched"] += fetch.n * bb
        ctx.stats["fetch_wait_ms"] += (t1 - t0) * 1e3
        ctx.stats["fetch_ms"] += worked * 1e3
        return raw

    # ------------------------------------------------------------ end

    def close(self) -> None:
        if any(self._puts):  # a prefill that did not finish: its puts still use the buffers
            try:
                self.finish_puts()
            except (StoreError, OSError) as exc:
                log.warning("a prefill put of an unfinished prefill failed: %s", exc)
        self.flush()
        for i, buf in enumerate(self._staging):
            if buf is not None:
                self.ctx.kernels.transfer.unregister(buf.array)
                self._staged[i] = None
                self.store.unregister(buf)
                self._staging[i] = None
        if not self.ctx.cfg.keep:
            for seq in self.seqs:
                self.store.delete(seq.ns, seq.name)
