"""Requests that do not parse are answered INVALID_ARGUMENT, by the server factory, before any servicer runs.
So are requests with an unsigned 64-bit integer beyond the signed range (`out_of_range`). On the way, a response
stream's serializer serializes the same message object once (`_serializer`): messages are not changed once sent.

gRPC answers a request whose deserializer raises with INTERNAL ("Exception deserializing request!"), logs
nothing useful, and keeps part of the failed call's memory. Here every method's deserializer is wrapped: a
message that does not parse becomes an `Undecodable` value instead of an exception, and the method's
behaviour is wrapped to answer it INVALID_ARGUMENT, naming the method and what was wrong, without calling the
servicer. Both the threaded server (`make_server`) and the `grpc.aio` one (`make_aio_server`) install it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message


class Undecodable:
    """Stands in for a request message that did not parse."""

    __slots__ = ("error",)

    def __init__(self, error: str):
        self.error = error


INT64_MAX = 2**63 - 1
_UNSIGNED_64 = (FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_FIXED64)


def out_of_range(msg: Message, prefix: str = "") -> str | None:
    """The first unsigned 64-bit field of `msg` (nested ones included) above 2^63 - 1, as "name = value", or None.

    Every integer atoll sends fits a signed 64-bit integer, as SQLite, numpy and torch store them; a larger
    one is refused here rather than overflowing where it is stored.
    """
    for f, value in msg.ListFields():
        name = f"{prefix}{f.name}"
        if f.type in _UNSIGNED_64:
            for x in (value if f.is_repeated else (value,)):
                if x > INT64_MAX:
                    return f"{name} = {x}"
        elif f.type == FieldDescriptor.TYPE_MESSAGE:
            if f.message_type.GetOptions().map_entry:
                items = value.items()
                kf, vf = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
                for k, x in items:
                    if (kf.type in _UNSIGNED_64 and k > INT64_MAX) or (vf.type in _UNSIGNED_64 and x > INT64_MAX):
                        return f"{name}[{k}] = {x}"
                    if vf.type == FieldDescriptor.TYPE_MESSAGE and (bad := out_of_range(x, f"{name}[{k}].")):
                        return bad
            else:
                for i, x in enumerate(value if f.is_repeated else (value,)):
                    if bad := out_of_range(x, f"{name}[{i}]." if f.is_repeated else f"{name}."):
                        return bad
    return None


def _safe(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            msg = deserializer(data)
        except Exception as e:  # noqa: BLE001 - DecodeError and kin: any failure to parse is the sender's
            return Undecodable(f"{type(e).__name__}: {str(e)[:200]}")
        if isinstance(msg, Message) and (bad := out_of_range(msg)):
            return Undecodable(f"{bad[:200]} is out of range: integers must be at most 2^63 - 1")
        return msg
    return deserialize


def _serializer(handler: grpc.RpcMethodHandler) -> Callable[[Any], bytes] | None:
    """The handler's response serializer; for a response stream, one that serializes the same message object once
    in a row: a plan published to thousands of plan watches is one message sent on every stream."""
    serialize = handler.response_serializer
    if serialize is None or not handler.response_streaming:
        return serialize
    last: tuple[Any, bytes] = (None, b"")

    def once(msg: Any) -> bytes:
        nonlocal last
        seen = last  # one read and one write of a tuple: threads sharing the serializer never mix two messages
        if seen[0] is msg:
            return seen[1]
        data = serialize(msg)
        last = (msg, data)
        return data
    return once


def _details(method: str, bad: Undecodable) -> str:
    return (f"{method}: the request is not a valid message ({bad.error}); the sender must speak this server's "
            f"atoll.v1 protocol (same atoll version) and keep integers within range")


_KINDS = {(False, False): "unary_unary", (False, True): "unary_stream", (True, False): "stream_unary",
          (True, True): "stream_stream"}


def _checked(requests: Any, context: grpc.ServicerContext, method: str, bad: list[Undecodable]) -> Any:
    for r in requests:
        if isinstance(r, Undecodable):
            bad.append(r)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, _details(method, r))
        yield r


def _reassert(context: grpc.ServicerContext, method: str, bad: list[Undecodable]) -> None:
    """A servicer that turned the abort into a status of its own is overruled: the last abort is what is sent."""
    if bad:
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, _details(method, bad[0]))


def _guard_sync(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    kind = _KINDS[(handler.request_streaming, handler.response_streaming)]
    inner = getattr(handler, kind)
    if not handler.request_streaming:
        def behaviour(request: Any, context: grpc.ServicerContext) -> Any:
            if isinstance(request, Undecodable):
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, _details(method, request))
            return inner(request, context)
    elif not handler.response_streaming:
        def behaviour(requests: Any, context: grpc.ServicerContext) -> Any:
            bad: list[Undecodable] = []
            try:
                return inner(_checked(requests, context, method, bad), context)
            except Exception:
                _reassert(context, method, bad)
                raise
    else:
        def behaviour(requests: Any, context: grpc.ServicerContext) -> Any:
            bad: list[Undecodable] = []
            try:
                yield from inner(_checked(requests, context, method, bad), context)
            except Exception:
                _reassert(context, method, bad)
                raise
    return getattr(grpc, f"{kind}_rpc_method_handler")(
        behaviour, request_deserializer=_safe(handler.request_deserializer),
        response_serializer=_serializer(handler))


def _guard_aio(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
    kind = _KINDS[(handler.request_streaming, handler.response_streaming)]
    inner = getattr(handler, kind)
    if handler.request_streaming:
        if not (inspect.iscoroutinefunction(inner) or inspect.isasyncgenfunction(inner)):
            return _guard_sync(handler, method)  # a plain function on the server's thread pool
        # an async stream of requests: checked as it is read; the servicer sees the abort as an error
        async def checked(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            async for r in requests:
                if isinstance(r, Undecodable):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _details(method, r))
                yield r
        if inspect.isasyncgenfunction(inner):
            async def behaviour(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                async for x in inner(checked(requests, context), context):
                    yield x
        else:
            async def behaviour(requests: Any, context: grpc.aio.ServicerContext) -> Any:  # type: ignore[misc]
                return await inner(checked(requests, context), context)
    elif inspect.isasyncgenfunction(inner):
        async def behaviour(request: Any, context: grpc.aio.ServicerContext) -> Any:  # type: ignore[misc]
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _details(method, request))
            async for x in inner(request, context):
                yield x
    elif inspect.iscoroutinefunction(inner):
        async def behaviour(request: Any, context: grpc.aio.ServicerContext) -> Any:  # type: ignore[misc]
            if isinstance(request, Undecodable):
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, _details(method, request))
            return await inner(request, context)
    else:
        return _guard_sync(handler, method)
    return getattr(grpc, f"{kind}_rpc_method_handler")(
        behaviour, request_deserializer=_safe(handler.request_deserializer),
        response_serializer=_serializer(handler))


class DecodeGuard(grpc.ServerInterceptor):
    """For threaded servers: requests that do not parse are answered INVALID_ARGUMENT."""

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        return None if handler is None else _guard_sync(handler, handler_call_details.method)


class AioDecodeGuard(grpc.aio.ServerInterceptor):
    """For `grpc.aio` servers: requests that do not parse are answered INVALID_ARGUMENT."""

    def __init__(self) -> None:
        self._guarded: dict[tuple[str, int], tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}
        """Each method's guarded handler, made once: a server's handlers do not change, and making it anew cost
        every call (thousands of heartbeats a second) a few inspections and closures."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        key = (method, id(handler))
        known = self._guarded.get(key)
        if known is not None and known[0] is handler:
            return known[1]
        guarded = _guard_aio(handler, method)
        if len(self._guarded) >= 1024:  # handlers made per call (not this server's) would only churn the table
            self._guarded.clear()
        self._guarded[key] = (handler, guarded)
        return guarded
