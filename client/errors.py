"""The SDK's errors: one root, :class:`KVDriveError`; the store's, one type per reply code."""

from __future__ import annotations

from kvdrive.protocol import ErrorCode


class KVDriveError(Exception):
    """Every error KVDrive's SDK raises on its own account derives from this one."""


class StoreError(KVDriveError):
    code: ErrorCode = ErrorCode.INTERNAL

    def __init__(self, message: str, code: ErrorCode | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class NotFoundError(StoreError, KeyError):
    code = ErrorCode.NOT_FOUND

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


class ExistsError(StoreError):
    code = ErrorCode.EXISTS


class StoreFullError(StoreError):
    code = ErrorCode.FULL


class ChecksumError(StoreError):
    code = ErrorCode.CHECKSUM


class BufferError_(StoreError):
    code = ErrorCode.BUFFER


class RequestError(StoreError):
    """The daemon refused the request's form (bad field, range, version, op)."""


class StoreUnavailableError(StoreError):
    """No daemon answered in time, or the daemon ended this client's session."""


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
    try:
        code = ErrorCode(reply.get("code"))
    except ValueError:
        code = ErrorCode.INTERNAL
    cls = _BY_CODE.get(code, RequestError if code is not ErrorCode.INTERNAL else StoreError)
    return cls(f"[{code.value}] {reply.get('error', '')}", code)
