"""A reused prompt's sliding-window layers: their KV at its restore point, stored beside its pages.

A model's sliding-window layers keep their window in transformers' own cache layers, not
in the store. A reused prompt loads its pages up to a restore point and runs the model
over the rest (:mod:`.prefix`), so those layers must start with the window they held
there: every sliding layer's K and V of the ``window - 1`` tokens before it. The session
that stores a prompt keeps them in a sequence per row beside the prompt's pages, named
after the prompt and the restore point (``<prompt's name>-w<pages restored>``), one store
layer per sliding layer, the window's tokens ending on the last of its ``pages`` pages
(zeros before the prompt's first token); a session that reuses the prompt loads them and
seeds its sliding layers (:meth:`kvdrive_client.hooks.KVDriveCache.seed_windows`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvdrive.layout.geometry import Geometry
from kvdrive_client.decode.prefix import create_all, drop_stale, stale
from kvdrive_client.errors import NotFoundError
from kvdrive_client.store import Sequence

if TYPE_CHECKING:
    from kvdrive_client.decode.fetch import StoreIO

log = logging.getLogger(__name__)


class Windows:
    """The sliding layers' windows of one session's prompt (``sizes``: each layer's window)."""

    def __init__(self, io: StoreIO, sizes: list[int]) -> None:
        s = io.ctx.cfg.page_size
        self.io = io
        self.sizes = sizes
        self.pages = max(1, -(-(max(sizes) - 1) // s))  # pages that hold the widest window
        g = io.geometry
        self.geometry = Geometry(len(sizes), g.num_kv_heads, g.head_dim, g.dtype, s)
        self.names: list[str] | None = None  # to create and store at prefill (None: nothing to store)
        self.at = 0  # the restore point, in pages
        self.seqs: list[Sequence] = []
        self.captured: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @staticmethod
    def names_of(names: list[str], at: int) -> list[str]:
        return [f"{n}-w{at}" for n in names]

    def find(self, names: list[str], at: int) -> str:
        """Open the rows' windows at restore point ``at``: "" if every row's is there, else why
        not (and, where no row's is, plan to store them at prefill)."""
        seqs = self._open(names, at)
        if not seqs:
            self.plan(names, at)
            return "stored without the sliding-window layers' windows at this restore point"
        if len(seqs) < len(names) or any(q.geometry != self.geometry or q.complete_pages < self.pages for q in seqs):
            if stale(seqs) and all(q.geometry == self.geometry for q in seqs):
                drop_stale(self.io, seqs)
                self.plan(names, at)
                return "their sliding-window layers' windows were left incomplete by a process that stopped"
            return "their sliding-window layers' windows are incomplete"
        self.seqs = seqs
        return ""

    def drop_stale(self, names: list[str], at: int) -> None:
        """Delete the rows' windows at restore point ``at`` where a process left them and no
        session is writing them (:func:`~kvdrive_client.decode.prefix.stale`)."""
        seqs = self._open(names, at)
        if stale(seqs):
            drop_stale(self.io, seqs)

    def _open(self, names: list[str], at: int) -> list[Sequence]:
        """The rows' windows at restore point ``at`` that are stored."""
        seqs = []
        for name in self.names_of(names, at):
            try:
                seqs.append(self.io.store.open(self.io.ctx.cfg.namespace, name))
            except NotFoundError:
                pass
        return seqs

    def plan(self, names: list[str], at: int) -> None:
        self.names, self.at = (self.names_of(names, at), at) if at > 0 else (None, 0)

    def create(self) -> None:
        """At prefill: the planned sequences, all made by this session or none."""
        if self.names is None:
            return
        made = create_all(self.io, self.names, self.geometry)
        if made is None:
            log.info("not storing this prompt's sliding-window layers' windows: another process stores them")
            self.names = None
            return
        self.seqs = made

    def capture(self, j: int, keys: torch.Tensor, values: torch.Tensor, shift: int) -> None:
        """Sliding layer ``j``'s prefill K and V ``[B, H, T, D]`` (the model's tokens): its window at the restore point."""
        if self.names is None:
            return
        s, n = self.io.ctx.cfg.page_size, self.pages * self.io.ctx.cfg.page_size
        end = self.at * s - shift  # the restore point, in the model's tokens
        b, h, _, d = keys.shape
        if (h, d) != (self.geometry.num_kv_heads, self.geometry.head_dim):
            log.warning("a sliding-window layer's KV is [%d heads, %d] where the global layers' is [%d, %d]: this "
                        "prompt is stored without its windows, and not reused", h, d, self.geometry.num_kv_heads,
                        self.geometry.head_dim)
            self.names = None
            return
        start = max(0, end - n)
        kv = keys.new_zeros(2, b, h, n, d)
        kv[0, :, :, n - (end - start) :] = keys[:, :, start:end]
        kv[1, :, :, n - (end - start) :] = values[:, :, start:end]
        self.captured[j] = (kv[0], kv[1])

    def put(self) -> None:
        """Store the captured windows (once every sliding layer's is there; then forget them)."""
        if not self.seqs or self.names is None or len(self.captured) < len(self.sizes):
            return
        s, d = self.io.ctx.cfg.page_size, self.geometry.head_dim
        k = torch.stack([self.captured[j][0] for j in range(len(self.sizes))], dim=1)  # [B, L, H, n, D]
        v = torch.stack([self.captured[j][1] for j in range(len(self.sizes))], dim=1)
        b, l, h = k.shape[:3]
        data = torch.stack([k.reshape(b, l, h, self.pages, s, d), v.reshape(b, l, h, self.pages, s, d)], dim=4)
        for row, seq in enumerate(self.seqs):  # [L, H, pages, 2, S, D]: the blocks in put order
            self.io.store.put(seq, range(l), range(self.pages), data[row].contiguous().cpu())
        self.captured, self.names = {}, None

    def load(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each sliding layer's stored window, ``[B, H, pages * S, D]`` K and V."""
        g, s = self.geometry, self.geometry.page_size
        blocks = np.array([(j, h, p) for j in range(g.num_layers) for h in range(g.num_kv_heads)
                           for p in range(self.pages)], dtype=np.int32)
        dtype = self.io.ctx.shape.dtype
        rows = [torch.from_numpy(self.io.store.get(seq, blocks)).view(dtype) for seq in self.seqs]
        kv = torch.stack(rows).view(len(rows), g.num_layers, g.num_kv_heads, self.pages, 2, s, g.head_dim)
        kv = kv.permute(1, 4, 0, 2, 3, 5, 6).reshape(g.num_layers, 2, len(rows), g.num_kv_heads, -1, g.head_dim)
        device = self.io.ctx.device
        return [(kv[j, 0].to(device), kv[j, 1].to(device)) for j in range(g.num_layers)]
