"""kvdrive_client: the KVDrive SDK.

- :func:`connect` — the low-level client of ``kvstored``: sequences, block puts,
  sparse gets into shared buffers.
"""

from kvdrive_client.errors import (
    ChecksumError,
    ExistsError,
    NotFoundError,
    RequestError,
    StoreError,
    StoreFullError,
    StoreUnavailableError,
)
from kvdrive_client.store import PendingGet, Sequence, StoreClient, connect
from kvdrive.layout.geometry import DType, Geometry

__all__ = [
    "ChecksumError",
    "DType",
    "ExistsError",
    "Geometry",
    "NotFoundError",
    "PendingGet",
    "RequestError",
    "Sequence",
    "StoreClient",
    "StoreError",
    "StoreFullError",
    "StoreUnavailableError",
    "connect",
]
