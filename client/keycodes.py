"""The per-key code index: every key kept whole, each channel in a few bits, scored directly."""

from __future__ import annotations

import torch

from kvdrive.kernels import Kernels
from kvdrive.kernels import reference as ref
from kvdrive_client.index_kind import IndexKind
from kvdrive_client.selector_base import Selector, _grow

ROTATION_SEED = 0x6B76  # the same rotation for every layer, head and run: codes compare across runs


def rotation(head_dim: int, device: torch.device | None = None) -> torch.Tensor:
    """A fixed random orthogonal ``[D, D]`` matrix: it spreads each key's energy over every
    channel, so one scale per key fits all its channels (``q . k = (q R) . (k R)``)."""
    g = torch.Generator().manual_seed(ROTATION_SEED + head_dim)
    q, r = torch.linalg.qr(torch.randn(head_dim, head_dim, generator=g, dtype=torch.float64))
    return (q * torch.sign(torch.diagonal(r))).to(device=device, dtype=torch.float32)


def encode(u: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated keys ``[..., T, D]`` -> (packed codes ``[..., T, D * bits / 8]`` uint8, fp16 scales ``[..., T]``).

    Each channel is the floor of its value over the key's step, ``2**(bits-1)`` steps to the
    key's largest ``|value|``, clamped to ``[-2**(bits-1), 2**(bits-1) - 1]``; it decodes to
    the middle of its step."""
    levels = 2 ** (bits - 1)
    scale = (u.abs().amax(dim=-1) / levels).clamp_min(1e-8).to(torch.float16)
    q = torch.floor(u / scale.float()[..., None]).clamp(-levels, levels - 1).to(torch.int16) + levels  # 0 .. 2L-1
    per = 8 // bits
    q = q.reshape(*q.shape[:-1], q.shape[-1] // per, per)
    packed = sum(q[..., j] << (bits * j) for j in range(per))
    return packed.to(torch.uint8), scale


def decode(codes: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`encode`, to float32 ``[..., T, D]`` (each channel at the middle of its step)."""
    levels, per = 2 ** (bits - 1), 8 // bits
    c = codes.to(torch.int16)
    parts = torch.stack([(c >> (bits * j)) & (2 * levels - 1) for j in range(per)], dim=-1)
    steps = parts.reshape(*codes.shape[:-1], codes.shape[-1] * per).float() - (levels - 0.5)
    return steps * scale.float()[..., None]


class KeyCodeIndex(Selector):
    """Every key as ``bits``-bit codes of all its channels (no projection), pages ranked by
    estimated attention mass.

    A key is rotated by a fixed random orthogonal matrix (:func:`rotation`), then each of its
    ``D`` channels kept in ``bits`` bits (4 or 2) against one fp16 scale per key
    (:func:`encode`). A step rotates the query the same way and takes ``q . k`` over the
    decoded codes; a page's score is the log of its estimated share of the softmax mass,
    summed over the query heads of its KV head, as :class:`kvdrive_client.lowrank.LowRankIndex`
    scores from its sketches. Nothing is fitted: the codes read every direction a query
    may take, where a sketch fitted to the prefill's queries keeps only the leading ones.

    Device memory per token and KV head: ``D * bits / 8`` bytes of codes, 2 of scale and a
    validity byte: 35 bytes at head dim 64 and 4 bits (0.137 of an fp16 K+V token), 19 at 2
    bits. Selection runs in torch (no compiled kernel yet).
    """

    kind = IndexKind.KEYCODES

    def __init__(self, page_size: int, scaling: float, bits: int = 4, kernels: Kernels | None = None) -> None:
        if bits not in (2, 4):
            raise ValueError(f"key codes take 2 or 4 bits, got {bits}")
        super().__init__(page_size, kernels)
        self.scaling = scaling
        self.bits = bits

    def _encode(self, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return encode(torch.matmul(keys.float(), self.rot), self.bits)

    def build(self, keys, valid, query=None):
        b, d = keys.shape[0], keys.shape[3]
        if d * self.bits % 8:
            raise ValueError(f"key codes of {self.bits} bits need a head dim that fills whole bytes, got {d}")
        self.rot = rotation(d, keys.device).expand(b, 1, d, d)  # batch-first, as rows() slices every index tensor
        p = keys.shape[2] // self.page_size
        t = p * self.page_size
        self.codes, self.scale = self._encode(keys[:, :, :t])
        self.valid = valid[:, :t].clone()
        self.num_pages = p
        return None

    def add_page(self, keys, valid):
        n, s = self.num_pages, self.page_size
        self.codes = _grow(self.codes, (n + 1) * s)
        self.scale = _grow(self.scale, (n + 1) * s)
        self.valid = _grow(self.valid, (n + 1) * s, dim=1, fill=False)
        self.codes[:, :, n * s : (n + 1) * s], self.scale[:, :, n * s : (n + 1) * s] = self._encode(keys)
        self.valid[:, n * s : (n + 1) * s] = valid
        self.num_pages += 1

    def scores(self, query):
        t = self.num_pages * self.page_size
        keys = decode(self.codes[:, :, :t], self.scale[:, :, :t], self.bits)  # [B, H, T, D]
        logits = torch.matmul(torch.matmul(query.float(), self.rot), keys.transpose(-1, -2)) * self.scaling
        logits = logits.masked_fill(~self.valid[:, None, None, :t], ref.NEG_INF)
        logits = logits - torch.logsumexp(logits, dim=-1, keepdim=True).nan_to_num(neginf=0.0)
        b, h, g, _ = logits.shape
        return torch.logsumexp(logits.reshape(b, h, g, self.num_pages, self.page_size), dim=(2, 4))

    def select_and_score(self, query, selectable, k, cached):
        scores = self.scores(query)
        pages, top = self._top(scores, selectable, k)
        return pages, top, None if cached is None else ref.gather_scores(scores, cached)

    @property
    def index_bytes(self):
        t = self.num_pages * self.page_size
        parts = (self.codes[:, :, :t], self.scale[:, :, :t], self.valid[:, :t], self.rot[0, 0])
        return sum(x.numel() * x.element_size() for x in parts)
