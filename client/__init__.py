"""kvdrive_client: the KVDrive SDK.

- :func:`attach` — make a transformers model decode through KVDrive.
- :func:`connect` — the low-level client of ``kvstored``: sequences, block puts,
  sparse gets into shared buffers. ``connect()`` reaches the default daemon,
  ``connect(None)`` starts a private one.
- :class:`kvdrive_client.engine.SparseKV` — sparse decode attention for engines that
  are not transformers.

What ``Handle.stats()`` and ``StoreClient.stats()`` report is in docs/stats.md.
"""

if __name__ == "client":  # imported from the repository root by its bare folder name: see tools/checkout.py
    from tools.checkout import step_aside

    step_aside(__name__)
else:
    from kvdrive_client.errors import (
        ChecksumError,
        ExistsError,
        KVDriveError,
        NotFoundError,
        RequestError,
        StoreError,
        StoreFullError,
        StoreUnavailableError,
    )
    from kvdrive_client.store import PendingGet, Sequence, StoreClient, connect
    from kvdrive.layout.geometry import DType, Geometry

    from kvdrive.protocol.release import version as _version

    __version__ = _version()

    __all__ = [
        "ChecksumError",
        "DType",
        "ExistsError",
        "Geometry",
        "KVDriveError",
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

    _LAZY = {
        "attach": "kvdrive_client.handle",
        "Handle": "kvdrive_client.handle",
        "KVDriveCache": "kvdrive_client.hooks",
        "UnsupportedModelError": "kvdrive_client.architecture",
        "AttachConfig": "kvdrive_client.config",
    }
    __all__ += list(_LAZY)


    def __getattr__(name: str):
        # attach() pulls in transformers; the store client alone does not need it.
        if name in _LAZY:
            import importlib

            return getattr(importlib.import_module(_LAZY[name]), name)
        raise AttributeError(f"module 'kvdrive_client' has no attribute {name!r}")
