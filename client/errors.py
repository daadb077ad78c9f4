"""The SDK's errors: one root, :class:`KVDriveError`; the store's, one type per reply code."""

from __future__ import annotations

from kvdrive.protocol import ErrorCode


class KVDriveError(Exception):
    """Every error KVDrive's SDK raises on its own account derives from this one."""


class StoreError(KVDriveError):
    """An error of the store: the daemon's reply said so (``code`` is its error code), or no daemon answered."""

    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class NotFoundError(StoreError, KeyError):
    """No such sequence for this user, or a get named a block never put."""

    code = ErrorCode.NOT_FOUND

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class ExistsError(StoreError):
    """The sequence exists (with another geometry, or ``exist_ok`` was not given), or a put's block is stored already."""

    code = ErrorCode.EXISTS


class StoreFullError(StoreError):
    """The SSD tier reached ``--ssd-max`` (or its disk is full), or the block index ``--index-max``: delete sequences."""

    code = ErrorCode.FULL


class ChecksumError(StoreError):
    """A block read from the SSD does not match its CRC-32C: it is damaged (``kvstore-inspect --verify`` lists them)."""

    code = ErrorCode.CHECKSUM


class BufferError_(StoreError):
    """A registered buffer the daemon cannot use for the request (unknown, too small for the blocks)."""

    code = ErrorCode.BUFFER


class RequestError(StoreError):
    """The daemon refused the request's form (bad field, range, version, op)."""


class StoreUnavailableError(StoreError):
    """No daemon at the address (no socket there, or one nobody listens on), none answered in
    time, or the daemon ended this client's session; the message says which, and how to start one."""


class SessionLostError(StoreUnavailableError):
    """The daemon no longer knows this client's session (it restarted, or ended the
    session): the request did not run. The client has opened a new session; retrying
    is safe."""

    code = ErrorCode.SESSION


class UnsafeStoreError(StoreError):
    """The daemon's socket is in a place another user could control; the client will not use it."""


class BusyError(StoreError):
    """The daemon refused the request for now (too many requests or sessions); retry later."""

    code = ErrorCode.BUSY


class ExpiredError(StoreError):
    """The request's deadline passed before the daemon could start it; it did not run."""

    code = ErrorCode.EXPIRED


class CudaUnavailableError(StoreError):
    """The daemon cannot open CUDA IPC buffers (its probe found no usable CUDA device;
    the message says why), or this client cannot make one: register a shared buffer
    (``StoreClient.register``) instead."""

    code = ErrorCode.CUDA_UNAVAILABLE


_BY_CODE = {
    ErrorCode.NOT_FOUND: NotFoundError,
    ErrorCode.EXISTS: ExistsError,
    ErrorCode.FULL: StoreFullError,
    ErrorCode.CHECKSUM: ChecksumError,
    ErrorCode.BUFFER: BufferError_,
    ErrorCode.SESSION: SessionLostError,
    ErrorCode.BUSY: BusyError,
    ErrorCode.EXPIRED: ExpiredError,
    ErrorCode.UNAVAILABLE: StoreUnavailableError,
    ErrorCode.CUDA_UNAVAILABLE: CudaUnavailableError,
}


def error_from_reply(reply: dict) -> StoreError:
    """The error a failed reply stands for: one type per error code, the daemon's message kept."""
    try:
        code = ErrorCode(reply.get("code"))
    except ValueError:
        code = ErrorCode.INTERNAL
    cls = _BY_CODE.get(code, RequestError if code is not ErrorCode.INTERNAL else StoreError)
    return cls(f"[{code.value}] {reply.get('error', '')}", code)
