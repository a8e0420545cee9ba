"""Statuses of the C library (kvtier.h's KVT_STATUS_LIST) as Python enums and exceptions."""

from __future__ import annotations

import enum

from . import _lib


class Status(enum.IntEnum):
    """kvt_status: KVT_OK = 0, every error negative. Mirrors KVT_STATUS_LIST; test_errors.py
    checks every name against kvt_status_name() of the loaded library."""

    OK = 0
    ERR_INVALID_ARGUMENT = -1
    ERR_OUT_OF_MEMORY = -2
    ERR_POOL_EXHAUSTED = -3
    ERR_CAPACITY = -4
    ERR_UNSUPPORTED = -5
    ERR_NO_DEVICE = -6
    ERR_PARSE = -7
    ERR_IO = -8
    ERR_OUT_OF_RANGE = -9
    ERR_BAD_STATE = -10
    ERR_POLICY_MISMATCH = -11
    ERR_CORRUPT = -12
    ERR_INVARIANT = -13
    ERR_DROPPED = -14
    ERR_ARCHIVE_FULL = -15
    ERR_MISMATCH = -16

    @property
    def c_name(self) -> str:
        """The symbolic name the library gives it ("KVT_ERR_BAD_STATE")."""
        return status_name(self)


def strerror(status: int) -> str:
    """kvt_strerror: the static description of a status."""
    return _lib.lib.kvt_strerror(int(status)).decode()


def status_name(status: int) -> str:
    """kvt_status_name: "KVT_ERR_POOL_EXHAUSTED" (or "KVT_UNKNOWN_STATUS")."""
    return _lib.lib.kvt_status_name(int(status)).decode()


class KvtError(Exception):
    """A kvtier call returned an error status.

    Attributes: ``status`` (a :class:`Status`, or the raw int for a code this binding does not
    know), ``name`` (the library's symbolic name, e.g. ``"KVT_ERR_BAD_STATE"``), ``message`` (the
    library's detail: kvt_last_error() or the call's err buffer), ``function`` (the C function).
    """

    def __init__(self, status: int, function: str, message: str):
        try:
            self.status = Status(status)
        except ValueError:
            self.status = status
        self.name = status_name(status)
        self.message = message
        self.function = function
        text = f"{function}: {self.name} ({strerror(status)})"
        if message:
            text += f": {message}"
        super().__init__(text)


def _class_name(member: Status) -> str:
    words = member.name[len("ERR_"):].split("_")
    return "".join(w.capitalize() for w in words) + "Error"


# One subclass per error status: InvalidArgumentError, OutOfMemoryError, ..., ArchiveFullError.
ERROR_CLASSES: dict[int, type[KvtError]] = {}
for _m in Status:
    if _m is Status.OK:
        continue
    _cls = type(_class_name(_m), (KvtError,), {
        "__doc__": f"{_m.name}: raised when a call returns KVT_{_m.name}.",
        "__module__": "kvtier",
    })
    ERROR_CLASSES[int(_m)] = _cls
    globals()[_cls.__name__] = _cls

__all__ = ["Status", "KvtError", "strerror", "status_name", "ERROR_CLASSES"] + [
    c.__name__ for c in ERROR_CLASSES.values()]


def error(status: int, function: str, message: str) -> KvtError:
    return ERROR_CLASSES.get(int(status), KvtError)(status, function, message)


def check(status: int, function: str, err_buffer=None) -> None:
    """Raise the status as an exception. Call it right after the C call: kvt_last_error() is
    valid only until the thread's next kvtier call."""
    if status == 0:
        return
    message = ""
    if err_buffer is not None:
        message = err_buffer.value.decode("utf-8", "replace")
    if not message:
        message = _lib.last_error()
    raise error(status, function, message)
