"""Errors the store reports, one type per reply code."""

from __future__ import annotations

from kvstored.protocol import ErrorCode


class StoreError(Exception):
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
    """No daemon answered in time."""


_BY_CODE = {
    ErrorCode.NOT_FOUND: NotFoundError,
    ErrorCode.EXISTS: ExistsError,
    ErrorCode.FULL: StoreFullError,
    ErrorCode.CHECKSUM: ChecksumError,
    ErrorCode.BUFFER: BufferError_,
}


def error_from_reply(reply: dict) -> StoreError:
    try:
        code = ErrorCode(reply.get("code"))
    except ValueError:
        code = ErrorCode.INTERNAL
    cls = _BY_CODE.get(code, RequestError if code is not ErrorCode.INTERNAL else StoreError)
    return cls(f"[{code.value}] {reply.get('error', '')}", code)
