"""Random inputs for the kernel tests, ragged and padded the ways a decode step's are."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvdrive.kernels import reference as ref

# The kernel sets that run on CPU tensors (choices of kvdrive.kernels.for_device).
BACKENDS = ("cpu", "reference")

# (rank, int8 channels, int2 channels, query heads): whole eight-channel passes and passes
# plus single channels; int4 channels in odd and even numbers (an odd one leaves a spare
# nibble), none, or all; int2 channels in whole and partial rows of four. (27, 1, 12), the
# default at head dim 64, is the fused logit pass; its query-head counts 3; 4 + 1; 4; 4 + 2
# cover its chunks. (22, 0, 0), the former default, takes the tiled pass.
LOWRANK_SHAPES = [(8, 5, 0, 3), (13, 8, 0, 3), (8, 8, 0, 3), (13, 0, 0, 3), (27, 1, 12, 3), (27, 1, 12, 5),
                  (27, 1, 12, 4), (27, 1, 12, 6), (22, 0, 0, 3), (14, 2, 7, 3), (10, 0, 10, 3)]

# Rows of a low-rank case.
FEW_SELECTABLE_ROW = 0  # (in the selection tests) three selectable pages, fewer than k
PADDED_ROW = 1  # left padding: its first three pages hold no valid token
EMPTY_ROW = 2  # no valid token at all: every page scores -inf
NONE_SELECTABLE_ROW = 3  # (in the selection tests) no selectable page


@dataclass
class LowRankCase:
    query: torch.Tensor  # [B, H, G, D] in the case's dtype
    qproj: torch.Tensor  # [B, H, D, R]
    scale: torch.Tensor  # [B, H, R]
    codes: torch.Tensor  # packed, with spare capacity past num_pages
    layout: ref.SketchLayout
    values: torch.Tensor  # the unpacked codes [B, H, R, T]
    valid: torch.Tensor  # [B, T], spare capacity included
    page_size: int
    num_pages: int
    scaling: float = 0.2

    def reference_scores(self) -> torch.Tensor:
        """:func:`reference.score_lowrank` over the unpacked codes of the first ``num_pages`` pages."""
        t = self.num_pages * self.page_size
        return ref.score_lowrank(self.query.float(), self.qproj, self.values[..., :t], self.scale, self.valid[:, :t],
                                 self.page_size, self.scaling)

    def rows(self, n: int) -> "LowRankCase":
        """The first ``n`` rows, contiguous."""
        return LowRankCase(*(x[:n].contiguous() for x in (self.query, self.qproj, self.scale, self.codes)), self.layout,
                           self.values[:n].contiguous(), self.valid[:n].contiguous(), self.page_size,
                           self.num_pages, self.scaling)


def lowrank_case(seed: int, dtype: torch.dtype = torch.float32, spare: int = 3,
                 shape: tuple[int, int, int, int] | None = None) -> LowRankCase:
    """Packed codes with ``spare`` pages of capacity past the ``num_pages`` in use (which the
    kernels must not read), and rows padded as :data:`PADDED_ROW` and :data:`EMPTY_ROW` say."""
    g = torch.Generator().manual_seed(seed)
    R, wide, narrow, G = shape or LOWRANK_SHAPES[seed % len(LOWRANK_SHAPES)]
    layout = ref.SketchLayout(R, wide, narrow)
    B, H, D, S, P = 4, 3, 32, 16, 40
    query = torch.randn(B, H, G, D, generator=g).to(dtype)
    qproj = torch.randn(B, H, D, R, generator=g) * 0.3
    scale = torch.rand(B, H, R, generator=g) * 0.05 + 1e-3
    values = torch.randint(-127, 128, (B, H, R, (P + spare) * S), generator=g, dtype=torch.int8)
    values[:, :, wide:] = torch.randint(-8, 8, values[:, :, wide:].shape, generator=g, dtype=torch.int8)
    values[:, :, R - narrow:] = torch.randint(-2, 2, values[:, :, R - narrow:].shape, generator=g, dtype=torch.int8)
    codes = ref.pack_lowrank_codes(values, layout)
    valid = torch.rand(B, (P + spare) * S, generator=g) > 0.1
    valid[PADDED_ROW, : 3 * S] = False
    valid[EMPTY_ROW] = False
    return LowRankCase(query, qproj, scale, codes, layout, values, valid, S, P)


def random_slots(g: torch.Generator, b: int, h: int, k: int, n: int) -> torch.Tensor:
    """``[b, h, k]`` distinct values below ``n`` per (row, head)."""
    return torch.stack([torch.randperm(n, generator=g)[:k] for _ in range(b * h)]).reshape(b, h, k)


def widened(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """float32 copies: the exact values a half-precision tensor holds."""
    return tuple(t.float() for t in tensors)
