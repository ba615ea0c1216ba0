"""The HTTP surface of ``libra serve``: OpenAI's API over a :class:`GatewayCore`, raw ASGI.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``POST /tokenize`` (vLLM's: a chat rendered into token ids, which with ``/v1/completions``'
``return_token_ids`` and ``logprobs: 0`` gives a trainer exact token ids and logprobs),
``GET /health``, ``GET /metrics`` (Prometheus), ``POST /v1/libra/report`` (a client's
own account of its session: a tool's outcome, its reward, its end), and the admin API
for a trainer: ``POST /admin/pause``, ``/admin/resume``, ``/admin/reload_weights``
``{"path", "version"}``, ``GET /admin/status``, whose answers (refusals too) carry
``X-Libra-Admin: 1``, how a trainer knows a gateway. Nothing else is served: in particular
no request ever reaches an upstream server's own admin endpoints.

A chat request's session is named by the ``X-Libra-Session`` header, else its
``metadata["libra_session"]``, else its ``user`` (else the core finds it by prefix);
the answer carries the session id back in the same header. A ``/v1/completions``
request with that header is the next turn of the client's session (a token-level
client's multi-turn trajectory: C-MLFQ sees its turns, tokens and tool reports as one),
which ends when idle for the session TTL or reported ``done``; the answer carries the
header back. Without it a completion is a one-off. Streaming (``stream:
true``) answers with server-sent events in OpenAI's chunk format: the core returns a
whole turn, which is then sent as deltas (the role, the content, each tool call's id
and name then its arguments, the finish reason, the usage if asked for, ``[DONE]``): a
client reads a stream, but its first token arrives with its last. A client that
disconnects while its turn generates cancels the core's call, and with it the upstream
request.

Like the emulated server this is a plain ASGI callable without a web framework, so a
request costs little more than decoding and encoding its JSON.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import anyio
import httpx
import msgspec

from libra._asgi import (
    ASGIMessage,
    BodyTooLarge,
    ClientDisconnected,
    Receive,
    Scope,
    Send,
    header,
    on_disconnect,
    read_body,
    serve_lifespan,
)
from libra.engine import RequestRejected, ServerUnavailable
from libra.gateway._auth import Keys
from libra.gateway._disconnects import Watch, bare_task
from libra.gateway._metrics import CONTENT_TYPE as _PROMETHEUS
from libra.gateway._metrics import GatewayMetrics
from libra.gateway._protocol import ChatReply, GatewayCore
from libra.gateway._wire_replies import (
    CompletionOut,
    ErrorFields,
    ErrorOut,
    Head,
    chat_chunks,
    chat_completion,
    completion_chunks,
    public_completion,
)
from libra.gateway._wire_requests import (
    ChatRequest,
    CompletionRequest,
    ReloadRequest,
    ReportRequest,
    TokenizeRequest,
    WireError,
    chat_turn,
    decode,
    decode_chat,
    decode_completion,
    upstream_completion,
)
from libra.openai import ADMIN_HEADER, SESSION_HEADER
from libra.sched import NoEndpointAvailable
from libra.serving import WeightSyncError

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024

_log = logging.getLogger("libra.gateway")
_JSON = b"application/json"
_SSE = b"text/event-stream"
_SESSION = SESSION_HEADER.lower().encode()
_ADMIN_MARKER = (ADMIN_HEADER.lower().encode(), b"1")
_T = TypeVar("_T")
_Headers = list[tuple[bytes, bytes]]
_HeaderPairs = tuple[tuple[bytes, bytes], ...]


class _Request(msgspec.Struct, frozen=True):
    scope: Scope
    body: bytes
    watch: Watch | None = None


class _Response(msgspec.Struct, frozen=True):
    status: int
    body: bytes
    content_type: bytes = _JSON
    headers: tuple[tuple[bytes, bytes], ...] = ()


_Handler = Callable[[_Request], Awaitable[_Response]]


@dataclass(frozen=True, slots=True)
class _Route:
    method: str
    handler: _Handler
    name: str
    auth: bool = True  # needs a user key (when auth is on)
    admin: bool = False  # needs an admin key
    generates: bool = False  # calls the model: cancelled when its client disconnects


class GatewayApp:
    """The ASGI app over ``core``; ``keys`` say who may call it."""

    def __init__(
        self,
        core: GatewayCore,
        keys: Keys,
        *,
        metrics: GatewayMetrics | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        any_model: bool = False,
    ) -> None:
        self.core = core
        self.keys = keys
        self.any_model = any_model  # (GatewayConfig.any_model)
        self.metrics = metrics or GatewayMetrics()
        self.max_body_bytes = max_body_bytes
        self._encoder = msgspec.json.Encoder()
        self._reload_decoder = msgspec.json.Decoder(ReloadRequest)
        self._report_decoder = msgspec.json.Decoder(ReportRequest)
        self._tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
        self._id_prefix = secrets.token_hex(4)
        self._ids = itertools.count()
        self._served: frozenset[str] = frozenset()  # models, as last read (_check_model)
        self._routes: dict[str, _Route] = {
            "/v1/chat/completions": _Route("POST", self._chat, "chat", generates=True),
            "/v1/completions": _Route("POST", self._completions, "completions", generates=True),
            "/v1/models": _Route("GET", self._models, "models"),
            "/tokenize": _Route("POST", self._tokenize, "tokenize"),
            "/v1/libra/report": _Route("POST", self._report, "report"),
            "/health": _Route("GET", self._health, "health", auth=False),
            "/metrics": _Route("GET", self._metrics, "metrics"),
            "/admin/pause": _Route("POST", self._pause, "admin", admin=True),
            "/admin/resume": _Route("POST", self._resume, "admin", admin=True),
            "/admin/reload_weights": _Route("POST", self._reload, "admin", admin=True),
            "/admin/status": _Route("GET", self._status, "admin", admin=True),
        }

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._serve_http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await serve_lifespan(receive, send)

    async def _serve_http(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        route = self._routes.get(scope["path"])
        name = route.name if route is not None else "other"
        counts = self.metrics.route(name)
        counts.in_progress.inc()
        self.metrics.totals.in_progress += 1
        try:
            status = await self._exchange(route, scope, receive, send)
        finally:
            counts.in_progress.dec()
            self.metrics.totals.in_progress -= 1
        if status is None:
            counts.disconnects.inc()
        else:
            self.metrics.answered(counts, status, time.perf_counter() - started)

    async def _exchange(
        self, route: _Route | None, scope: Scope, receive: Receive, send: Send
    ) -> int | None:
        """Read, answer and send; the status sent, or None when the client left first."""
        if route is not None and route.admin:  # a refusal too says what answered
            send = partial(_with_admin_marker, send)
        try:
            route = self._check(route, scope)
            body = await read_body(receive, self.max_body_bytes)
        except ClientDisconnected:
            return None
        except (WireError, BodyTooLarge) as error:
            return await self._send(send, self._refusal(error))
        if not route.generates:
            return await self._answer(route, _Request(scope, body), send)
        watch = Watch()
        if on_disconnect(scope, watch.client_left):
            return await self._answer(route, _Request(scope, body, watch), send)
        return await self._answer_watched(route, _Request(scope, body, watch), receive, send)

    async def _answer_watched(
        self, route: _Route, request: _Request, receive: Receive, send: Send
    ) -> int | None:
        """:meth:`_answer`, while a task watches for the client's disconnect (which
        cancels the generation): for servers without the disconnect hook. Once answered,
        the server reports the exchange over through receive(), and the watcher ends."""
        watch = request.watch
        assert watch is not None
        task = bare_task(watch.run(receive))
        if task is not None:
            try:
                return await self._answer(route, request, send)
            finally:
                task.cancel()  # (a no-op once it has ended)
        async with anyio.create_task_group() as group:
            group.start_soon(watch.run, receive)
            status = await self._answer(route, request, send)
            await anyio.lowlevel.checkpoint()  # the watcher ends by itself: cheaper
            if not watch.ended:  # a server that does not report it (none known)
                group.cancel_scope.cancel()
        return status

    async def _answer(self, route: _Route, request: _Request, send: Send) -> int | None:
        """Generate and send; the status sent, or None when the client left first."""
        response = await self._respond(route, request)
        return None if response is None else await self._send(send, response)

    async def _send(self, send: Send, response: _Response) -> int:
        headers: _Headers = [
            (b"content-type", response.content_type),
            (b"content-length", str(len(response.body)).encode()),
            *response.headers,
        ]
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        await send({"type": "http.response.body", "body": response.body})
        return response.status

    async def _respond(self, route: _Route, request: _Request) -> _Response | None:
        """The route's answer (an error's, in OpenAI's shape); None if the client left."""
        try:
            return await route.handler(request)
        except ClientDisconnected:
            return None
        except WireError as error:
            return self._error(error)
        except RequestRejected as error:
            return self._error(WireError(f"The model server refused the request: {error}"))
        except (ServerUnavailable, NoEndpointAvailable) as error:
            message = f"No model server could answer: {error}"
            return self._error(WireError(message, status=503, kind="service_unavailable"))
        except Exception as error:
            if _reload_failed(error):
                message = f"The weights were not reloaded: {_leaves(error)}"
                return self._error(WireError(message, status=502, kind="server_error"))
            # A bug: the client gets a 500, the log the traceback.
            scope = request.scope
            _log.exception("libra serve failed on %s %s", scope["method"], scope["path"])
            return self._error(WireError("Internal error.", status=500, kind="server_error"))

    def _refusal(self, error: WireError | BodyTooLarge) -> _Response:
        if isinstance(error, BodyTooLarge):
            message = f"The request body is larger than {self.max_body_bytes} bytes."
            error = WireError(message, status=413)
        return self._error(error)

    def _check(self, route: _Route | None, scope: Scope) -> _Route:
        """The route, once the method, the key and the declared size are right."""
        if route is None:
            path = scope["path"]
            raise WireError(f"Not found: {path}", status=404, kind="not_found_error")
        if scope["method"] != route.method:
            message = f"Method not allowed: {scope['method']} {scope['path']}"
            raise WireError(message, status=405)
        if route.auth or route.admin:
            self._authenticate(route, scope)
        length = header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise BodyTooLarge
        return route

    def _authenticate(self, route: _Route, scope: Scope) -> None:
        verdict = self.keys.check(header(scope, b"authorization"), admin=route.admin)
        if verdict == "ok":
            return
        if route.admin and not self.keys.admins and verdict != "missing":
            message = "The admin API is closed: start libra serve with LIBRA_ADMIN_KEY set."
            raise WireError(message, status=403, kind="permission_error")
        if verdict == "forbidden":
            message = "This key may not use the admin API; it needs an admin key."
            raise WireError(message, status=403, kind="permission_error")
        message = "Incorrect API key provided."
        if verdict == "missing":
            message = "Missing API key: send 'Authorization: Bearer KEY'."
        raise WireError(message, status=401, kind="invalid_request_error", code="invalid_api_key")

    def _error(self, error: WireError) -> _Response:
        fields = ErrorFields(error.message, error.kind, error.param, error.code)
        return _Response(error.status, self._encoder.encode(ErrorOut(fields)))

    def _json(self, value: Any, headers: tuple[tuple[bytes, bytes], ...] = ()) -> _Response:
        return _Response(200, self._encoder.encode(value), _JSON, headers)

    def _events(self, chunks: list[Any], headers: tuple[tuple[bytes, bytes], ...]) -> _Response:
        encode = self._encoder.encode
        events = b"".join([b"data: " + encode(chunk) + b"\n\n" for chunk in chunks])
        no_cache = (b"cache-control", b"no-cache")
        return _Response(200, events + b"data: [DONE]\n\n", _SSE, (*headers, no_cache))

    # ------------------------------------------------------------------ generation

    async def _chat(self, request: _Request) -> _Response:
        chat = decode_chat(request.body)
        self._check_model(chat.model)
        key = header(request.scope, _SESSION)
        turn = chat_turn(chat, key.decode("latin-1") if key is not None else None)
        reply = await self._in_core("chat", request.watch, partial(self.core.chat, turn))
        return self._chat_response(chat, reply)

    def _chat_response(self, chat: ChatRequest, reply: ChatReply) -> _Response:
        headers = ((_SESSION, _header_value(reply.session)),)
        head = Head(
            f"chatcmpl-{self._id_prefix}{next(self._ids):012x}",
            int(time.time()),
            chat.model,
            parallel=chat.parallel_tool_calls is not False,
        )
        if chat.stream:
            options = chat.stream_options
            include_usage = bool(options is not None and options.include_usage)
            return self._events(chat_chunks(reply, head, include_usage), headers)
        return self._json(chat_completion(reply, head), headers)

    async def _completions(self, request: _Request) -> _Response:
        completion = decode_completion(request.body)
        self._check_model(completion.model)
        upstream = upstream_completion(completion, completion.model)
        key = header(request.scope, _SESSION)
        session = key.decode("latin-1") if key is not None else None
        call = partial(self.core.complete, upstream, session)
        result = public_completion(
            await self._in_core("completions", request.watch, call),
            completion.model,
            token_ids=bool(completion.return_token_ids),
        )
        headers = ((_SESSION, _header_value(session)),) if session is not None else ()
        return self._completion_response(completion, result, headers)

    def _completion_response(
        self, request: CompletionRequest, result: CompletionOut, headers: _HeaderPairs
    ) -> _Response:
        if request.stream:
            options = request.stream_options
            include_usage = bool(options is not None and options.include_usage)
            return self._events(completion_chunks(result, include_usage), headers)
        return self._json(result, headers)

    async def _in_core(
        self, route: str, watch: Watch | None, call: Callable[[], Awaitable[_T]]
    ) -> _T:
        """``call``'s result; cancelled, and :class:`ClientDisconnected` raised, when the
        client goes away first (so the upstream request is cancelled too)."""
        assert watch is not None  # generation routes are watched
        if watch.ended:  # gone already, once its request had come
            raise ClientDisconnected
        started = time.perf_counter()
        try:
            return await watch.call(call)
        finally:
            self.metrics.route(route).core_latency.observe(time.perf_counter() - started)

    def _check_model(self, model: str) -> None:
        """Refuse a model the fleet does not serve. The names served are re-read only on
        a miss (a fleet that grew): reading them for every request cost ~2% of the
        gateway's CPU. A model whose last server left still passes here, and its
        request then finds no server (503)."""
        if model in self._served or self.any_model:
            return
        models = self.core.models()
        self._served = frozenset(models)
        if model not in self._served:
            raise WireError(
                f"The model `{model}` does not exist; this server serves {', '.join(models)}.",
                param="model",
                status=404,
                code="model_not_found",
            )

    # ------------------------------------------------------------------ the rest

    async def _models(self, request: _Request) -> _Response:
        cards = [
            {"id": m, "object": "model", "created": 0, "owned_by": "libra"}
            for m in self.core.models()
        ]
        return self._json({"object": "list", "data": cards})

    async def _tokenize(self, request: _Request) -> _Response:
        tokenize: TokenizeRequest = decode(self._tokenize_decoder, request.body)
        self._check_model(tokenize.model)
        add = tokenize.add_generation_prompt is not False
        tokens = await self.core.tokenize(tokenize.messages, tokenize.tools, add)
        return self._json({"tokens": tokens, "count": len(tokens)})

    async def _health(self, request: _Request) -> _Response:
        if any(self.core.status().healthy.values()):
            return _Response(200, b'{"status":"ok"}')
        return _Response(503, b'{"status":"no healthy model server"}')

    async def _metrics(self, request: _Request) -> _Response:
        return _Response(200, self.metrics.exposition(), _PROMETHEUS)

    async def _report(self, request: _Request) -> _Response:
        report: ReportRequest = decode(self._report_decoder, request.body)
        tool = (report.tool.name, report.tool.status) if report.tool is not None else None
        try:
            await self.core.report(
                report.session, tool=tool, reward=report.reward, done=report.done
            )
        except KeyError:
            message = f"No live session {report.session!r}."
            raise WireError(message, param="session", status=404, kind="not_found_error") from None
        return self._json({"session": report.session})

    async def _pause(self, request: _Request) -> _Response:
        await self.core.pause()
        return self._json({"paused": True})

    async def _resume(self, request: _Request) -> _Response:
        await self.core.resume()
        return self._json({"paused": False})

    async def _reload(self, request: _Request) -> _Response:
        reload: ReloadRequest = decode(self._reload_decoder, request.body)
        seconds = await self.core.reload_weights(reload.path, reload.version)
        return self._json({"version": reload.version, "seconds": seconds})

    async def _status(self, request: _Request) -> _Response:
        return self._json(self.core.status())


async def _with_admin_marker(send: Send, message: ASGIMessage) -> None:
    """Send ``message``, its response start marked as the gateway's admin API: how a
    trainer tells a gateway from other servers before it sends a key."""
    if message["type"] == "http.response.start":
        message = {**message, "headers": [*message["headers"], _ADMIN_MARKER]}
    await send(message)


def _reload_failed(error: BaseException) -> bool:
    """A weight reload that failed upstream: the sync's own refusal, or its HTTP client's
    errors (grouped when several servers were synced at once)."""
    if isinstance(error, BaseExceptionGroup):
        return all(_reload_failed(e) for e in error.exceptions)
    return isinstance(error, WeightSyncError | httpx.HTTPError)


def _leaves(error: BaseException) -> str:
    if isinstance(error, BaseExceptionGroup):
        return "; ".join(_leaves(e) for e in error.exceptions)
    return f"{type(error).__name__}: {error}"


def _header_value(session: str) -> bytes:
    """``session`` as a header value: as it is when printable ASCII, else %-escaped."""
    if session.isascii() and session.isprintable():
        return session.encode()
    return urllib.parse.quote(session, safe="").encode()


def create_gateway(
    core: GatewayCore,
    keys: Keys,
    *,
    metrics: GatewayMetrics | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    any_model: bool = False,
) -> GatewayApp:
    """The ASGI app of ``libra serve`` over ``core``."""
    return GatewayApp(
        core, keys, metrics=metrics, max_body_bytes=max_body_bytes, any_model=any_model
    )
