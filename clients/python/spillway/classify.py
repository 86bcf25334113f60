"""What a call's exception says about the dependency: a timeout ('t') or a
failure ('f'), for the exceptions of the clients people use, without
importing any of them: a library the process has not imported cannot have
raised its exception, so each is looked up in sys.modules.

Timeouts: TimeoutError (socket.timeout, asyncio.TimeoutError and
concurrent.futures.TimeoutError are TimeoutError from Python 3.11; the older
classes are checked too), requests' Timeout (ConnectTimeout, ReadTimeout),
urllib3's TimeoutError (ConnectTimeoutError, ReadTimeoutError), a urllib3
MaxRetryError whose reason is one and the requests ConnectionError that
wraps it (not NewConnectionError, a connection refused, though urllib3 1.26
derives it from ConnectTimeoutError), httpx's TimeoutException (connect, read, write, pool), and a grpc
RpcError whose code is DEADLINE_EXCEEDED. An exception raised explicitly
from one of these (``raise ApiError(...) from e``) is a timeout too, as
Go's errors.Is finds a wrapped one."""

from __future__ import annotations

import sys

from . import protocol as P

_MAX_CHAIN = 8  # causes followed, so that a cycle cannot loop


def default_classify(exc: BaseException) -> str:
    """'t' for a timeout of any client listed in the module, else 'f'."""
    return P.TIMEOUT if is_timeout(exc) else P.FAILURE


def is_timeout(exc: BaseException) -> bool:
    """Whether exc, or an exception it was raised from, is a timeout."""
    for _ in range(_MAX_CHAIN):
        if exc is None:
            return False
        if _is_timeout(exc):
            return True
        exc = exc.__cause__
    return False


def _module_class(module: str, name: str):
    m = sys.modules.get(module)
    c = getattr(m, name, None) if m is not None else None
    return c if isinstance(c, type) else None


def _is_timeout(exc: BaseException) -> bool:
    if isinstance(exc, TimeoutError):
        return True
    refused = _module_class("urllib3.exceptions", "NewConnectionError")
    if refused is not None and isinstance(exc, refused):
        return False  # a ConnectTimeoutError by inheritance in urllib3 1.26, but refused, not slow
    for module, name in (("asyncio", "TimeoutError"), ("concurrent.futures", "TimeoutError"),
                         ("requests.exceptions", "Timeout"), ("urllib3.exceptions", "TimeoutError"),
                         ("httpx", "TimeoutException")):
        c = _module_class(module, name)
        if c is not None and isinstance(exc, c):
            return True
    retry = _module_class("urllib3.exceptions", "MaxRetryError")
    if retry is not None:
        # requests wraps urllib3's MaxRetryError of a read timeout in its
        # ConnectionError (only a connect timeout becomes ConnectTimeout).
        wrapped = exc.args[0] if exc.args and isinstance(exc.args[0], retry) else exc
        if isinstance(wrapped, retry):
            reason = getattr(wrapped, "reason", None)
            if reason is not None and reason is not wrapped and _is_timeout(reason):
                return True
    grpc = sys.modules.get("grpc")
    rpc_error = getattr(grpc, "RpcError", None) if grpc is not None else None
    if isinstance(rpc_error, type) and isinstance(exc, rpc_error):
        code = getattr(exc, "code", None)
        try:
            return callable(code) and code() == grpc.StatusCode.DEADLINE_EXCEEDED
        except Exception:  # an RpcError without a status
            return False
    return False
