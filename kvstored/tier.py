"""The media blocks live on, behind one interface, and the registry that opens them.

A tier owns bytes and the space in them; it decides nothing about which blocks it holds
(that is residency.py for the cache tier, and the catalog for the durable one). The store
has two roles for tiers: a *cache* tier that holds copies of the blocks read most (DRAM),
and a *durable* tier that holds every stored block (the SSD data file). Each medium is one
file (dram.py, ssd.py) and one line in :data:`TIERS`; ``Store`` opens the medium each role
names through :func:`open_tier`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

from kvdrive.layout.format import DATA_FILE
from kvstored.config import DaemonConfig, SyncPolicy


class Tier(ABC):
    """What every medium answers: its capacity, the bytes it holds, and closing."""

    name: str = ""
    capacity: int = 0

    @property
    @abstractmethod
    def used_bytes(self) -> int:
        """Bytes held now (for a reader on another thread: a snapshot, maybe stale)."""

    def describe(self) -> dict:
        """The tier's figures for ``stats``: its capacity and the bytes it holds."""
        return {"tier": self.name, "capacity_bytes": self.capacity, "used_bytes": self.used_bytes}

    @abstractmethod
    def close(self) -> None:
        """Release what the tier holds open; the store calls it once, at close."""


def _dram(cfg: DaemonConfig) -> Tier:
    from kvstored.dram import DramTier

    return DramTier(cfg.dram_bytes)


def _ssd(cfg: DaemonConfig) -> Tier:
    from kvstored.ssd import SsdTier

    return SsdTier(cfg.ssd_dir / DATA_FILE, cfg.ssd_max_bytes, cfg.direct_io,
                   cached_writes=cfg.sync == SyncPolicy.WRITE_BEHIND, backlog_bytes=cfg.write_behind_backlog_bytes)


# Medium name -> how to open it from the daemon's configuration.
TIERS: dict[str, Callable[[DaemonConfig], Tier]] = {
    "dram": _dram,
    "ssd": _ssd,
}

# Which medium plays each role.
ROLES = {"cache": "dram", "durable": "ssd"}


def open_tier(role: str, cfg: DaemonConfig) -> Tier:
    return TIERS[ROLES[role]](cfg)
