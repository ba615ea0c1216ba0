"""The emulated vLLM OpenAI-compatible server, as a raw ASGI application.

:func:`create_app` builds an app that serves the endpoints the rollout engine and the
scheduler use, shaped like vLLM's (``/v1/chat/completions`` with the Hermes tool-call
parser, ``/v1/completions`` with token-id prompts, ``/tokenize``, ``/detokenize``,
``/health``, ``/v1/models``, ``/metrics``). Replies come from a :class:`Script`; their
timing from a :class:`BatchingEngine` over the configured :class:`LatencyModel` (none at
all with ``LatencyModel.zero()``).

It is a plain ASGI callable without a web framework, so a request costs little more than
decoding and encoding its JSON: a benchmark drives thousands of concurrent clients at it.
It runs under uvicorn (see ``_serve``) or in-process through ``httpx.ASGITransport``, on
asyncio or trio.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import random
import re
import secrets
import time
import urllib.parse
from array import array
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar

import anyio
import msgspec
from pydantic import BaseModel, ConfigDict, Field, model_validator

from libra._asgi import (
    ClientDisconnected,
    Receive,
    Scope,
    Send,
    cancel_on_disconnect,
    read_body,
    serve_lifespan,
)
from libra.emulation._faults import Fault, Faults
from libra.emulation._latency import BatchingEngine, LatencyModel, PauseMode
from libra.emulation._prefix_cache import PrefixCache
from libra.emulation._scripts import AgentScript, Conversation, Reply, Script, builtin_script
from libra.emulation._tokenizer import (
    EOS_ID,
    IM_END_ID,
    IM_START_ID,
    VOCAB_SIZE,
    ByteTokenizer,
    pack_ids,
)
from libra.openai import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorBody,
    ErrorResponse,
    FunctionCall,
    Message,
    TokenizeRequest,
    TokenizeResponse,
    TokenLogprob,
    ToolCall,
    Usage,
)

_JSON = b"application/json"
_PAUSE_MODES: tuple[PauseMode, ...] = ("abort", "wait", "keep")
_PROMETHEUS = b"text/plain; version=0.0.4; charset=utf-8"
_MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
# vLLM's Hermes tool parser: closed blocks, or one unterminated block at the end.
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.S)

_Request = TypeVar("_Request")
# Continuations of aborted seedless requests whose seed keys are remembered (oldest dropped).
_MAX_ABORTED_KEYS = 65536


class EmulatorConfig(BaseModel):
    """Settings of one emulated server."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    model_name: str = Field(
        default="libra-emulated", description="Served model name (requests must use it)."
    )
    latency: LatencyModel = Field(
        default_factory=LatencyModel,
        description="Timing model; LatencyModel.zero() answers at once.",
    )
    script: Literal["agent", "echo"] = Field(
        default="agent", description="Built-in model behaviour, unless create_app gets one."
    )
    agent: AgentScript = Field(
        default_factory=AgentScript, description="Settings of the 'agent' script."
    )
    seed: int = Field(default=0, description="Seeds replies, logprobs and failure injection.")
    max_model_len: int = Field(
        default=32768, ge=1, description="Context length: prompt plus new tokens, in tokens."
    )
    error_rate: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="Fraction of generation requests answered with HTTP 500 (injected).",
    )
    stall_rate: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="Fraction of generation requests never answered (until the client gives up).",
    )
    abort_rate: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="Fraction of generation requests ended early with a partial output and "
        "finish_reason 'abort', as vLLM ends them when paused in abort mode.",
    )
    garbage_rate: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="Fraction of generation requests answered 200 with a body that is not "
        "an OpenAI response (truncated or foreign JSON).",
    )
    die_rate: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="Probability per generation request that the server dies on it.",
    )
    die_after: int | None = Field(
        default=None,
        ge=0,
        description="The server dies on the generation request after this many (None: never). "
        "Run as a process it exits; in-process every later request fails to connect.",
    )
    prefix_caching: bool = Field(
        default=False,
        description="Reuse the KV of prompt prefixes seen before (vLLM's automatic prefix "
        "caching): only the uncached part of a prompt is prefilled.",
    )
    prefix_block_tokens: int = Field(
        default=256,
        ge=1,
        description="Granularity of the prefix cache in tokens (vLLM's blocks are 16; "
        "coarser blocks keep the emulator cheap and round hits down by less than one block).",
    )
    check_model_name: bool = Field(
        default=True, description="Answer 404 to requests for another model, like vLLM."
    )
    template_renders_tools: bool = Field(
        default=True,
        description="False: the chat template drops the request's tools, as SmolLM2's does "
        "(clients must describe them in the conversation).",
    )

    @model_validator(mode="after")
    def _check_fault_rates(self) -> EmulatorConfig:
        # One draw per request picks at most one fault, so the rates must fit in [0, 1].
        total = (
            self.error_rate + self.stall_rate + self.abort_rate + self.garbage_rate + self.die_rate
        )
        if total > 1:
            raise ValueError(f"the fault rates add up to {total:g}, more than 1")
        return self


class _HTTPError(Exception):
    """An error answer, in OpenAI's shape."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


@dataclass(frozen=True, slots=True)
class _Reply:
    """The tokens a request generates, why they end, and the stop string that ended them."""

    tokens: list[int]
    finish_reason: Literal["stop", "length", "abort"]
    stop_string: str | None = None

    def cut_to(self, produced: int) -> _Reply:
        """What a request stopped by a pause returns: the tokens produced so far."""
        if produced >= len(self.tokens):
            return self
        return _Reply(self.tokens[:produced], "abort")


_Response = tuple[int, bytes, bytes]  # status, body, content type
_Handler = Callable[[bytes, Receive, bytes], Awaitable[_Response]]


class EmulatorApp:
    """The ASGI app; ``engine`` is None when the latency model is zero.

    ``on_death`` runs when an injected death strikes (a served process exits there);
    after it the app fails every request with :class:`EmulatedServerDied`.
    """

    # Handlers by path and method, named rather than bound: a bound method kept on the
    # app would make a reference cycle, and a server dropped from a fleet (a restart)
    # would then wait for the cycle collector, which a long run may not call for a
    # long time (tests/emulation/test_app.py checks it is freed at once).
    _ROUTES: ClassVar[dict[str, dict[str, str]]] = {
        "/health": {"GET": "_health"},
        "/v1/models": {"GET": "_list_models"},
        "/metrics": {"GET": "_metrics"},
        "/v1/chat/completions": {"POST": "_chat_completions"},
        "/v1/completions": {"POST": "_completions"},
        "/tokenize": {"POST": "_tokenize"},
        "/detokenize": {"POST": "_detokenize"},
        "/pause": {"POST": "_pause"},
        "/resume": {"POST": "_resume"},
        "/is_paused": {"GET": "_is_paused"},
        "/collective_rpc": {"POST": "_collective_rpc"},
        "/reset_prefix_cache": {"POST": "_reset_prefix_cache"},
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
        # Seedless requests draw their seed keys from here: samples of one prompt differ.
        self._unseeded = random.Random(f"unseeded:{config.seed}")
        self._aborted_keys: dict[bytes, int] = {}
        self._id_prefix = secrets.token_hex(4)
        self._ids = itertools.count()
        self._encoder = msgspec.json.Encoder()
        self._chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
        self._completion_decoder = msgspec.json.Decoder(CompletionRequest)
        self._tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
        self._detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)
        self._models_body = self._encoder.encode(self._models())
        self._assistant_header = self.tokenizer.encode("assistant\n")
        # Without a batching engine (zero latency) nothing is ever in flight: a pause only
        # holds new requests, until this event is set.
        self._resumed: anyio.Event | None = None

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
            status, payload, content_type = await handler(body, receive, query)
        except _HTTPError as error:
            status, content_type = error.status, _JSON
            payload = self._encoder.encode(
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
            raise _HTTPError(404, f"Not Found: {path}", "NotFoundError")
        name = methods.get(method)
        if name is None:
            raise _HTTPError(405, f"Method Not Allowed: {method} {path}", "MethodNotAllowed")
        handler: _Handler = getattr(self, name)
        return handler

    # ------------------------------------------------------------------ simple GETs

    async def _health(self, body: bytes, receive: Receive, query: bytes) -> _Response:
        return 200, b"", _JSON

    async def _list_models(self, body: bytes, receive: Receive, query: bytes) -> _Response:
        return 200, self._models_body, _JSON

    def _models(self) -> dict[str, Any]:
        card = {
            "id": self.config.model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "libra",
            "root": self.config.model_name,
            "max_model_len": self.config.max_model_len,
        }
        return {"object": "list", "data": [card]}

    async def _metrics(self, body: bytes, receive: Receive, query: bytes) -> _Response:
        engine, cache = self.engine, self.prefix_cache
        gauges = {
            "vllm:num_requests_running": engine.num_running if engine else 0,
            "vllm:num_requests_waiting": engine.num_waiting if engine else 0,
            "vllm:kv_cache_usage_perc": engine.kv_usage if engine else 0.0,
        }
        counters = {
            "vllm:prompt_tokens_total": self.prompt_tokens_total,
            "vllm:generation_tokens_total": self.generation_tokens_total,
            "vllm:prefix_cache_queries_total": cache.queries if cache else 0,
            "vllm:prefix_cache_hits_total": cache.hits if cache else 0,
            "vllm:num_preemptions_total": engine.num_preemptions if engine else 0,
        }
        name = self.config.model_name.replace("\\", "\\\\").replace('"', '\\"')
        label = f'{{model_name="{name}"}}'
        lines: list[str] = []
        for kind, values in (("gauge", gauges), ("counter", counters)):
            for metric, value in values.items():
                lines.append(f"# TYPE {metric} {kind}")
                lines.append(f"{metric}{label} {float(value)}")
        return 200, ("\n".join(lines) + "\n").encode(), _PROMETHEUS

    # ----------------------------------------------------------------------- pause

    async def _pause(self, body: bytes, receive: Receive, query: bytes) -> _Response:
        """vLLM's ``POST /pause?mode=abort|wait|keep`` (its dev-mode RL route): new
        requests queue until ``/resume``; ``abort`` ends those in flight now with the
        tokens produced so far (``finish_reason: "abort"``), ``wait`` answers once the
        running ones have finished, ``keep`` freezes them. (vLLM's deprecated
        ``clear_cache`` is accepted and ignored.)"""
        mode = urllib.parse.parse_qs(query.decode()).get("mode", ["abort"])[-1]
        if mode not in _PAUSE_MODES:
            return 422, self._encoder.encode(_invalid_mode(mode)), _JSON
        if self.engine is None:
            self._resumed = self._resumed or anyio.Event()
        else:
            self.engine.pause(mode)
            if mode == "wait":
                await self.engine.wait_until_idle()
        return 200, b'{"status":"paused"}', _JSON

    async def _resume(self, body: bytes, receive: Receive, query: bytes) -> _Response:
        if self.engine is not None:
            self.engine.resume()
        elif self._resumed is not None:
            self._resumed.set()
            self._resumed = None
        return 200, b'{"status":"resumed"}', _JSON

    async def _is_paused(self, body: bytes, receive: Receive, query: bytes) -> _Response:
        engine = self.engine
        paused = self._resumed is not None if engine is None else engine.paused is not None
        return 200, self._encoder.encode({"is_paused": paused}), _JSON

    async def _collective_rpc(self, body: bytes, receive: Receive, query: bytes) -> _Response:
        """vLLM's dev-mode ``POST /collective_rpc``: ``reload_weights`` (what a weight
        sync calls) succeeds at once, as replies do not depend on weights here."""
        method = json.loads(body or b"{}").get("method")
        if method != "reload_weights":
            raise _HTTPError(400, f"the emulator runs no {method!r} RPC")
        self.weight_reloads += 1
        return 200, b'{"results":[null]}', _JSON

    async def _reset_prefix_cache(self, body: bytes, receive: Receive, query: bytes) -> _Response:
        """vLLM's dev-mode ``POST /reset_prefix_cache``: cached KV is forgotten."""
        if self.prefix_cache is not None:
            self.prefix_cache.clear()
        return 200, b'{"success":true}', _JSON

    # ------------------------------------------------------------------- tokenizer

    async def _tokenize(self, body: bytes, receive: Receive, query: bytes) -> _Response:
        request = _decode(self._tokenize_decoder, body)
        self._check_model(request.model)
        if request.messages is not None:
            # vLLM's TokenizeChatRequest adds the generation prompt unless told not to.
            add_generation_prompt = request.add_generation_prompt is not False
            tokens = self.tokenizer.render_chat(
                request.messages, self._rendered_tools(request.tools), add_generation_prompt
            )
        elif request.prompt is not None:
            tokens = self.tokenizer.encode(request.prompt)
        else:
            raise _HTTPError(400, "Either 'prompt' or 'messages' is required.")
        response = TokenizeResponse(
            tokens=tokens, count=len(tokens), max_model_len=self.config.max_model_len
        )
        return 200, self._encoder.encode(response), _JSON

    def _rendered_tools(self, tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        return tools if self.config.template_renders_tools else None

    async def _detokenize(self, body: bytes, receive: Receive, query: bytes) -> _Response:
        request = _decode(self._detokenize_decoder, body)
        self._check_model(request.model)
        self._check_token_ids(request.tokens)
        response = DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))
        return 200, self._encoder.encode(response), _JSON

    # ------------------------------------------------------------------ generation

    async def _chat_completions(self, body: bytes, receive: Receive, query: bytes) -> _Response:
        request = _decode(self._chat_decoder, body)
        self._check_model(request.model)
        self._check_streaming(request.stream)
        prompt = self.tokenizer.render_chat(
            request.messages, self._rendered_tools(request.tools), True
        )
        max_new_tokens = self._max_new_tokens(len(prompt), request.max_tokens)
        fault = await self._draw_fault(receive)
        key = self._seed_key(prompt, request.seed)
        rng = random.Random(key)
        conversation = Conversation(
            prompt, request.messages, request.tools or [], rng, self.tokenizer
        )
        reply = self._run_script(conversation)
        generation = self._reply_tokens(reply.text, request.stop, max_new_tokens)
        generation = self._cut_if_aborted(generation, fault)
        generation = await self._generate(prompt, generation, request.priority, receive)
        self._remember_if_aborted(prompt, generation, key, request.seed)
        generated = generation.tokens
        finish_reason: str = generation.finish_reason

        text = self._reply_text(generation, request.include_stop_str_in_output, True)
        message = Message(role="assistant", content=text)
        if request.tools and finish_reason != "abort":
            parsed = _parse_hermes_tool_calls(text, rng)
            if parsed is not None:
                message, finish_reason = parsed, "tool_calls"
        logprobs = None
        if request.logprobs:
            texts = self.tokenizer.token_texts(generated)
            entries = zip(texts, _logprobs(key, len(generated)), strict=True)
            content = [TokenLogprob(text, logprob) for text, logprob in entries]
            logprobs = ChatLogprobs(content=content)
        with_ids = bool(request.return_token_ids)
        choice = ChatChoice(
            index=0,
            message=message,
            finish_reason=finish_reason,
            stop_reason=generation.stop_string,
            logprobs=logprobs,
            token_ids=generated if with_ids else None,
        )
        response = ChatCompletion(
            id=self._new_id("chatcmpl"),
            choices=[choice],
            model=self.config.model_name,
            created=int(time.time()),
            usage=self._usage(len(prompt), len(generated)),
            prompt_token_ids=prompt if with_ids else None,
        )
        return 200, self._answer_body(self._encoder.encode(response), fault), _JSON

    async def _completions(self, body: bytes, receive: Receive, query: bytes) -> _Response:
        request = _decode(self._completion_decoder, body)
        self._check_model(request.model)
        self._check_streaming(request.stream)
        if isinstance(request.prompt, str):
            prompt = self.tokenizer.encode(request.prompt)
        else:
            prompt = request.prompt
        packed = pack_ids(prompt)  # once: the checks, the seed, the cache and the decoding
        self._check_token_ids(prompt, packed)
        if not prompt:
            raise _HTTPError(400, "The prompt cannot be empty.")
        if request.logprobs is not None and not 0 <= request.logprobs <= _MAX_LOGPROBS:
            raise _HTTPError(400, f"logprobs must be between 0 and {_MAX_LOGPROBS}.")
        max_new_tokens = self._max_new_tokens(len(prompt), request.max_tokens)
        fault = await self._draw_fault(receive)
        # A prompt that ends inside an assistant turn (a turn a pause cut short) goes on
        # with that turn's reply: the script sees the conversation up to the turn's start,
        # and the reply, its seed and its logprobs are the uninterrupted turn's.
        partial = self._partial_turn(prompt)
        turn_prompt = prompt[: len(prompt) - len(partial)] if partial else prompt
        turn_packed = pack_ids(turn_prompt) if partial else packed
        key = None
        if partial and request.seed is None and packed is not None:
            key = self._aborted_keys.pop(packed, None)
        if key is None:
            key = self._seed_key(turn_prompt, request.seed, turn_packed)
        rng = random.Random(key)
        conversation = Conversation.from_prompt(turn_prompt, rng, self.tokenizer, turn_packed)
        reply = self._run_script(conversation)
        generation = self._reply_tokens(reply.text, request.stop, max_new_tokens, partial)
        generation = self._cut_if_aborted(generation, fault)
        generation = await self._generate(prompt, generation, request.priority, receive, packed)
        self._remember_if_aborted(prompt, generation, key, request.seed)
        generated = generation.tokens

        skip_special = request.skip_special_tokens is not False
        logprobs = None
        if request.logprobs is not None:
            logprobs = CompletionLogprobs(
                token_logprobs=list(_logprobs(key, len(partial) + len(generated))[len(partial) :]),
                tokens=self.tokenizer.token_texts(generated),
            )
        with_ids = bool(request.return_token_ids)
        choice = CompletionChoice(
            index=0,
            text=self._reply_text(generation, request.include_stop_str_in_output, skip_special),
            finish_reason=generation.finish_reason,
            stop_reason=generation.stop_string,
            logprobs=logprobs,
            token_ids=generated if with_ids else None,
            prompt_token_ids=prompt if with_ids else None,
        )
        response = Completion(
            id=self._new_id("cmpl"),
            choices=[choice],
            model=self.config.model_name,
            created=int(time.time()),
            usage=self._usage(len(prompt), len(generated)),
        )
        return 200, self._answer_body(self._encoder.encode(response), fault), _JSON

    async def _generate(
        self,
        prompt: list[int],
        reply: _Reply,
        priority: int | None,
        receive: Receive,
        packed: bytes | None = None,
    ) -> _Reply:
        """Spend the emulated GPU time of a request; abort it if the client goes away.

        Returns the reply as far as it got: cut short (finish reason ``"abort"``) when a
        pause in abort mode stopped it. With prefix caching, the cached part of the prompt
        costs no prefill, and the prompt and reply are cached for the next request that
        starts with them.
        """
        engine, cache = self.engine, self.prefix_cache
        self.prompt_tokens_total += len(prompt)
        if engine is None:
            while self._resumed is not None:  # paused: queue until /resume
                await self._resumed.wait()
            self.generation_tokens_total += len(reply.tokens)
            return reply
        cached, chain, digests = (0, None, []) if cache is None else cache.lookup(prompt, packed)
        produced: int | None = None
        async with anyio.create_task_group() as group:
            group.start_soon(cancel_on_disconnect, receive, group.cancel_scope)
            # A stop string at the very start still cost the model one decode step.
            produced = await engine.generate(
                len(prompt), max(1, len(reply.tokens)), priority=priority or 0, cached_tokens=cached
            )
            group.cancel_scope.cancel()
        if produced is None:
            raise ClientDisconnected
        reply = reply.cut_to(produced)
        self.generation_tokens_total += len(reply.tokens)
        if cache is not None and chain is not None:
            cache.store(digests + chain.extend(reply.tokens))
        return reply

    def _partial_turn(self, prompt: list[int]) -> list[int]:
        """The tokens of the assistant turn that ``prompt`` ends inside, if any (none
        when it ends with a bare generation prompt or outside an assistant turn)."""
        for index in range(len(prompt) - 1, -1, -1):
            token = prompt[index]
            if token == IM_END_ID:
                return []
            if token == IM_START_ID:
                body = index + 1 + len(self._assistant_header)
                if prompt[index + 1 : body] != self._assistant_header:
                    return []
                return prompt[body:]
        return []

    # --------------------------------------------------------------------- helpers

    def _check_model(self, model: str) -> None:
        if self.config.check_model_name and model != self.config.model_name:
            raise _HTTPError(404, f"The model `{model}` does not exist.", "NotFoundError")

    @staticmethod
    def _check_streaming(stream: bool | None) -> None:
        if stream:
            raise _HTTPError(400, "Streaming is not supported by the emulated server.")

    def _check_token_ids(self, ids: list[int], packed: bytes | None = None) -> None:
        if not self.tokenizer.in_vocabulary(ids, packed):
            bad = next(token_id for token_id in ids if not 0 <= token_id < VOCAB_SIZE)
            raise _HTTPError(400, f"Token id {bad} is out of vocabulary.")

    def _max_new_tokens(self, prompt_tokens: int, max_tokens: int | None) -> int:
        """The most tokens a request may generate; 400 when it cannot fit the context."""
        limit = self.config.max_model_len
        if max_tokens is not None and max_tokens < 1:
            raise _HTTPError(400, f"max_tokens must be at least 1, got {max_tokens}.")
        if prompt_tokens >= limit:
            raise _HTTPError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your "
                f"request has {prompt_tokens} input tokens. Please reduce the length of "
                "the input messages.",
            )
        if max_tokens is None:
            return limit - prompt_tokens
        if prompt_tokens + max_tokens > limit:
            raise _HTTPError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the "
                f"messages, {max_tokens} in the completion).",
            )
        return max_tokens

    # ---------------------------------------------------------------------- faults

    async def _draw_fault(self, receive: Receive) -> Fault | None:
        """The fault injected into this generation request, if any. An HTTP 500, a stall
        (an answer never comes) and a death happen here; an abort and garbage are applied
        to the reply later."""
        fault = self.faults.draw()
        if fault == "error":
            rate = self.config.error_rate
            raise _HTTPError(500, f"Injected failure (error_rate={rate}).", "InternalServerError")
        if fault == "stall":
            await _wait_for_disconnect(receive)
        return fault

    def _cut_if_aborted(self, reply: _Reply, fault: Fault | None) -> _Reply:
        if fault != "abort":
            return reply
        return _Reply(reply.tokens[: self.faults.cut(len(reply.tokens))], "abort")

    def _answer_body(self, body: bytes, fault: Fault | None) -> bytes:
        return self.faults.garble(body) if fault == "garbage" else body

    def _remember_if_aborted(
        self, prompt: list[int], reply: _Reply, key: int, request_seed: int | None
    ) -> None:
        """Keep the seed key of a seedless request that ended early, so that its
        continuation (the prompt plus what it produced) goes on with the same reply."""
        if request_seed is not None or reply.finish_reason != "abort":
            return
        continuation = pack_ids([*prompt, *reply.tokens])
        if continuation is None:
            return
        if len(self._aborted_keys) >= _MAX_ABORTED_KEYS:
            del self._aborted_keys[next(iter(self._aborted_keys))]
        self._aborted_keys[continuation] = key

    def _seed_key(
        self, prompt: list[int], request_seed: int | None, packed: bytes | None = None
    ) -> int:
        """The reply's random seed: server seed, request seed and the prompt's ids.

        Without a request seed the request seed is drawn, so that samples of one prompt
        differ (as a GRPO group needs); the draws repeat from one server run to the next.
        """
        if request_seed is None:
            request_seed = self._unseeded.getrandbits(63)
        digest = hashlib.blake2b(f"{self.config.seed}:{request_seed}:".encode(), digest_size=8)
        digest.update(packed if packed is not None else array("H", prompt).tobytes())
        return int.from_bytes(digest.digest(), "little")

    def _run_script(self, conversation: Conversation) -> Reply:
        try:
            return self.script(conversation)
        except Exception as error:  # a script bug is the server's error, as a 500
            message = f"Script failed: {type(error).__name__}: {error}"
            raise _HTTPError(500, message, "InternalServerError") from error

    def _reply_tokens(
        self, text: str, stop: list[str] | None, max_new_tokens: int, partial: Sequence[int] = ()
    ) -> _Reply:
        """The tokens the model emits for ``text`` after the ``partial`` turn it already
        wrote (as many tokens of the reply are skipped), and why it stopped.

        Ends with EOS unless a stop string ended the text (its tokens are kept, as vLLM
        keeps them) or ``max_new_tokens`` truncated it (finish reason ``"length"``).
        """
        matches = [(i, s) for s in stop or () if (i := text.find(s)) >= 0]
        if matches:
            cut, stop_string = min(matches)
            tokens = self.tokenizer.encode(text[: cut + len(stop_string)])
        else:
            stop_string, tokens = None, [*self.tokenizer.encode(text), EOS_ID]
        if partial:
            tokens = tokens[len(partial) :] or [EOS_ID]
        if len(tokens) > max_new_tokens:
            return _Reply(tokens[:max_new_tokens], "length")
        return _Reply(tokens, "stop", stop_string)

    def _reply_text(self, reply: _Reply, include_stop: bool | None, skip_special: bool) -> str:
        """What vLLM returns as text: the stop string left out unless asked for."""
        text = self.tokenizer.decode(reply.tokens, skip_special=skip_special)
        if reply.stop_string is not None and not include_stop:
            return text.removesuffix(reply.stop_string)
        return text

    def _usage(self, prompt_tokens: int, completion_tokens: int) -> Usage:
        return Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )

    def _new_id(self, kind: str) -> str:
        return f"{kind}-{self._id_prefix}{next(self._ids):016x}"


def create_app(config: EmulatorConfig | None = None, script: Script | None = None) -> EmulatorApp:
    """An emulated vLLM server as an ASGI app; ``script`` overrides ``config.script``."""
    return EmulatorApp(config or EmulatorConfig(), script)


# ------------------------------------------------------------------------ functions


def _decode(decoder: msgspec.json.Decoder[_Request], body: bytes) -> _Request:
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as error:  # malformed JSON, or a field of the wrong shape
        raise _HTTPError(400, f"Invalid request: {error}") from error


def _parse_hermes_tool_calls(text: str, rng: random.Random) -> Message | None:
    """The assistant message vLLM's Hermes parser makes of ``text``, or None.

    None when there is no ``<tool_call>`` or any block fails to parse; then vLLM returns
    the whole text as content. Otherwise the content is the text before the first block.
    """
    start = text.find("<tool_call>")
    if start < 0:
        return None
    calls: list[ToolCall] = []
    for closed, unclosed in _TOOL_CALL.findall(text):
        try:
            payload = json.loads(closed or unclosed)
        except json.JSONDecodeError:
            return None
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            return None
        if "arguments" not in payload:
            return None
        arguments = json.dumps(payload["arguments"], ensure_ascii=False)
        call_id = f"call_{rng.getrandbits(96):024x}"
        calls.append(ToolCall(id=call_id, function=FunctionCall(payload["name"], arguments)))
    return Message(role="assistant", content=text[:start] or None, tool_calls=calls)


async def _wait_for_disconnect(receive: Receive) -> None:
    """A stalled request: nothing is answered; it ends when the client gives up."""
    while (await receive())["type"] != "http.disconnect":
        pass
    raise ClientDisconnected


def _invalid_mode(mode: str) -> dict[str, Any]:
    """FastAPI's validation error, as vLLM answers a ``/pause`` mode it does not know."""
    message = "Input should be 'wait', 'abort' or 'keep'"
    detail = {"type": "literal_error", "loc": ["query", "mode"], "msg": message, "input": mode}
    return {"detail": [detail]}


def _make_logprob_table(size: int) -> list[float]:
    rng = random.Random(0x6C6F6770726F6273)
    return [-(rng.expovariate(4.0) + 1e-4) for _ in range(size)]


# Sampled-token logprobs are read off this table from a per-request offset: deterministic,
# plausible (negative, mostly near zero) and cheap, since a reply may have thousands.
_LOGPROB_TABLE = _make_logprob_table(8191)


def _logprobs(key: int, count: int) -> list[float]:
    """``count`` logprobs for the request whose seed key is ``key``."""
    table = _LOGPROB_TABLE
    offset = key % len(table)
    values = table[offset : offset + count]
    while len(values) < count:
        values += table[: count - len(values)]
    return values
