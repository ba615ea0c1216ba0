"""The emulated vLLM OpenAI-compatible server, as a raw ASGI application: its state and its
routing.

:func:`create_app` builds an app that serves the endpoints the rollout engine and the
scheduler use, shaped like vLLM's: the OpenAI ones in ``_endpoints`` (``/v1/chat/completions``
with the Hermes tool-call parser, ``/v1/completions`` with token-id prompts, ``/tokenize``,
``/detokenize``, ``/v1/models``) and vLLM's own in ``_admin`` (``/health``, ``/metrics``,
``/pause``...). Replies come from a :class:`Script` (tokens, seeds and logprobs in
``_reply``); their timing from a :class:`BatchingEngine` over the configured
:class:`LatencyModel` (none at all with ``LatencyModel.zero()``); injected faults from
``_faults``.

It is a plain ASGI callable without a web framework, so a request costs little more than
decoding and encoding its JSON: a benchmark drives thousands of concurrent clients at it.
It runs under uvicorn (see ``_serve``) or in-process through ``httpx.ASGITransport``, on
asyncio or trio.
"""

from __future__ import annotations

import itertools
import secrets
from collections.abc import Awaitable, Callable
from typing import ClassVar

import anyio

from libra._asgi import ClientDisconnected, Receive, Scope, Send, read_body, serve_lifespan
from libra.emulation import _admin, _endpoints
from libra.emulation._batching import BatchingEngine
from libra.emulation._config import EmulatorConfig
from libra.emulation._faults import Faults
from libra.emulation._http import JSON, HTTPError, Response, encode
from libra.emulation._prefix_cache import PrefixCache
from libra.emulation._reply import ReplySeeds
from libra.emulation._scripts import Script, builtin_script
from libra.emulation._tokenizer import ByteTokenizer
from libra.openai import ErrorBody, ErrorResponse

_Handler = Callable[["EmulatorApp", bytes, Receive, bytes], Awaitable[Response]]


class EmulatorApp:
    """The ASGI app; ``engine`` is None when the latency model is zero.

    ``on_death`` runs when an injected death strikes (a served process exits there);
    after it the app fails every request with :class:`EmulatedServerDied`.
    """

    # Handlers by path and method: functions that take the app, not bound methods. A
    # bound method kept on the app would make a reference cycle, and a server dropped
    # from a fleet (a restart) would then wait for the cycle collector, which a long run
    # may not call for a long time (tests/emulation/test_app.py checks it is freed at once).
    _ROUTES: ClassVar[dict[str, dict[str, _Handler]]] = {
        "/health": {"GET": _admin.health},
        "/v1/models": {"GET": _endpoints.list_models},
        "/metrics": {"GET": _admin.metrics},
        "/v1/chat/completions": {"POST": _endpoints.chat_completions},
        "/v1/completions": {"POST": _endpoints.completions},
        "/tokenize": {"POST": _endpoints.tokenize},
        "/detokenize": {"POST": _endpoints.detokenize},
        "/pause": {"POST": _admin.pause},
        "/resume": {"POST": _admin.resume},
        "/is_paused": {"GET": _admin.is_paused},
        "/collective_rpc": {"POST": _admin.collective_rpc},
        "/reset_prefix_cache": {"POST": _admin.reset_prefix_cache},
    }

    def __init__(
        self,
        config: EmulatorConfig,
        script: Script | None = None,
        on_death: Callable[[], None] | None = None,
    ) -> None:
        self.config = config
        self.tokenizer = ByteTokenizer()
        self.script: Script = script or builtin_script(config.script, config.agent)
        self.engine = (
            None if config.latency.is_zero else BatchingEngine(config.latency, seed=config.seed)
        )
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.weight_reloads = 0
        self.prefix_cache: PrefixCache | None = None
        if config.prefix_caching:
            capacity = config.latency.kv_capacity_tokens
            self.prefix_cache = PrefixCache(capacity, config.prefix_block_tokens)
        self.faults = Faults(
            {
                "error": config.error_rate,
                "stall": config.stall_rate,
                "abort": config.abort_rate,
                "garbage": config.garbage_rate,
                "die": config.die_rate,
            },
            config.seed,
            config.die_after,
            on_death,
        )
        self.seeds = ReplySeeds(config.seed)
        self.models_body = _endpoints.models_body(config)
        self.assistant_header = self.tokenizer.encode("assistant\n")
        # Without a batching engine (zero latency) nothing is ever in flight: a pause only
        # holds new requests, until this event is set.
        self.resumed: anyio.Event | None = None
        self._id_prefix = secrets.token_hex(4)
        self._ids = itertools.count()

    def new_id(self, kind: str) -> str:
        """A fresh response id, such as ``chatcmpl-…``."""
        return f"{kind}-{self._id_prefix}{next(self._ids):016x}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            await self._serve_http(scope, receive, send)
        elif scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
        # Other scopes (websocket) are not served: returning closes them.

    async def _serve_http(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.faults.check_alive()
        try:
            handler = self._route(scope["method"], scope["path"])
            body = await read_body(receive)
            query = scope.get("query_string", b"")
            status, payload, content_type = await handler(self, body, receive, query)
        except HTTPError as error:
            status, content_type = error.status, JSON
            payload = encode(
                ErrorResponse(ErrorBody(message=error.message, type=error.kind, code=error.status))
            )
        except ClientDisconnected:
            return
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", content_type),
                    (b"content-length", str(len(payload)).encode()),
                ],
            }
        )
        await send({"type": "http.response.body", "body": payload})

    def _route(self, method: str, path: str) -> _Handler:
        methods = self._ROUTES.get(path)
        if methods is None:
            raise HTTPError(404, f"Not Found: {path}", "NotFoundError")
        handler = methods.get(method)
        if handler is None:
            raise HTTPError(405, f"Method Not Allowed: {method} {path}", "MethodNotAllowed")
        return handler


def create_app(config: EmulatorConfig | None = None, script: Script | None = None) -> EmulatorApp:
    """An emulated vLLM server as an ASGI app; ``script`` overrides ``config.script``."""
    return EmulatorApp(config or EmulatorConfig(), script)
