"""What tools read of a session: its facts, figures and per-layer state, nothing it runs."""

from __future__ import annotations

from collections import Counter

import torch

from kvdrive_client.config import AttachConfig
from kvdrive_client.decode.plan import prompt_shift
from kvdrive_client.decode.state import Context, ModelShape, Observer


class SessionView:
    """The read-only side of :class:`~kvdrive_client.session.Session` (its ``ctx``, ``io``
    and ``tuning``), kept apart so that the session itself is the decode it runs."""

    ctx: Context
    shift: int  # KVDrive's padding tokens before the prompt (see the session)

    @property
    def cfg(self) -> AttachConfig:
        return self.ctx.cfg

    @property
    def shape(self) -> ModelShape:
        return self.ctx.shape

    @property
    def batch(self) -> int:
        return self.ctx.batch

    @property
    def stats(self) -> Counter:
        return self.ctx.stats

    @property
    def kernels(self):
        return self.ctx.kernels

    @property
    def block_bytes(self) -> int:
        """Bytes of one stored block: one page of one (layer, KV head), K and V."""
        return self.io.block_bytes

    @property
    def step(self) -> int:
        return self.ctx.step

    @property
    def micro_batch(self) -> int:
        return self.tuning.micro_batch

    @property
    def calibration(self) -> str | None:
        """What warm-up calibration chose, once it has (also logged)."""
        return self.tuning.calibration

    @property
    def cache_multiplier(self) -> float:
        """Device cache per (layer, KV head) as a multiple of a step's selection (calibrated or given)."""
        return self.ctx.multiplier

    def fold_counts(self) -> Counter:
        """The stats, with the figures still on the device added (a copy to the host)."""
        self.ctx.counts.fold(self.stats)
        return self.stats

    def add_observer(self, observer: Observer) -> None:
        """Call ``observer``'s hooks from now on (a measurement tool's view of prefill and decode)."""
        self.ctx.observers.append(observer)

    def remove_observer(self, observer: Observer) -> None:
        self.ctx.observers.remove(observer)

    def num_pages(self, layer: int) -> int:
        """Complete pages of a layer: indexed and (to be) stored."""
        return self.ctx.layers[layer].num_pages

    def local_window(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """A layer's local window: K and V ``[B, H, L, D]`` and the position of its first token."""
        window = self.ctx.layers[layer].window
        return *window.linear(), window.start

    def cache(self, layer: int):
        """A layer's device cache (None before its prefill)."""
        return self.ctx.layers[layer].cache

    def prompt_shift(self, prompt_tokens: int) -> int:
        """The padding tokens KVDrive puts before a prompt of ``prompt_tokens`` (the model's,
        padding included), so that it ends on a page boundary."""
        return prompt_shift(prompt_tokens, self.ctx.cfg.page_size)

    # ------------------------------------------------------------ figures

    def index_bytes(self) -> int:
        return sum(ls.selector.index_bytes for ls in self.ctx.layers if ls.selector is not None)

    def cache_bytes(self) -> int:
        """Bytes the device cache reserves on the compute device, all layers (its K and V slots)."""
        return sum(ls.cache.nbytes for ls in self.ctx.layers if ls.cache is not None)

    def kv_bytes(self) -> int:
        """Bytes of the context's K and V in the layers KVDrive serves, all rows (the model's
        padding included, KVDrive's own ``shift`` before the prompt not)."""
        sh = self.shape
        per_token = 2 * sh.num_kv_heads * sh.head_dim * sh.dtype.itemsize * self.batch
        return sum(max(0, ls.num_tokens - self.shift) for ls in self.ctx.layers) * per_token
