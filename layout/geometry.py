"""Sequence geometry: the shape of one sequence's KV cache."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from functools import cached_property

MAX_LAYERS = 1024
MAX_KV_HEADS = 1024
MAX_HEAD_DIM = 4096
MAX_PAGE_SIZE = 4096
# Pages per (layer, KV head): 2^24 pages of 16 tokens is 256M tokens.
MAX_PAGES = 1 << 24


class DType(enum.Enum):
    FLOAT16 = "float16"
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"

    @property
    def itemsize(self) -> int:
        return 4 if self is DType.FLOAT32 else 2


@dataclass(frozen=True)
class Geometry:
    """Shape of a sequence's KV cache; a block is one page of K and V of one head."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: DType
    page_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.dtype, DType):
            names = ", ".join(d.value for d in DType)
            if not isinstance(self.dtype, str):
                raise ValueError(f"dtype must be a string, one of {names}; got {type(self.dtype).__name__}")
            try:
                object.__setattr__(self, "dtype", DType(self.dtype))
            except ValueError:
                raise ValueError(f"dtype {self.dtype!r:.64} is not one of {names}") from None
        limits = {
            "num_layers": MAX_LAYERS,
            "num_kv_heads": MAX_KV_HEADS,
            "head_dim": MAX_HEAD_DIM,
            "page_size": MAX_PAGE_SIZE,
        }
        for name, limit in limits.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= limit:
                raise ValueError(f"{name} must be an integer in 1..{limit}, got {value!r}")

    @cached_property  # read per extent at start-up: millions of times for a store of small blocks
    def block_bytes(self) -> int:
        """Bytes of one block: K then V, each [page_size, head_dim]."""
        return 2 * self.page_size * self.head_dim * self.dtype.itemsize

    def to_dict(self) -> dict:
        d = asdict(self)
        d["dtype"] = self.dtype.value
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Geometry":
        if not isinstance(d, dict):
            raise ValueError("geometry must be a map")
        fields = ("num_layers", "num_kv_heads", "head_dim", "dtype", "page_size")
        missing = [f for f in fields if f not in d]
        extra = [k for k in d if k not in fields]
        if missing or extra:
            raise ValueError(f"geometry fields: missing {missing}, unknown {extra}")
        return cls(**{f: d[f] for f in fields})
