"""The OpenAI-compatible HTTP client the engine generates with.

It speaks to any OpenAI-compatible server through an :class:`HTTPTransport` (httptools
for real ports, an ASGI transport for an in-process fleet) and
uses vLLM's extensions when the server has them: ``return_token_ids`` and ``logprobs``
for exact training data, ``priority`` for the scheduler, ``/tokenize`` for rendering
tool results into tokens. Bodies are encoded and decoded with msgspec: on a busy engine
JSON is the largest cost after the network itself.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any, Generic, Literal, Protocol, TypeVar

import anyio
import msgspec

from libra import openai
from libra._clock import now
from libra.engine._config import TurnSampling
from libra.engine._http import HTTPTransport, TransportError, TransportTimeout
from libra.fleet import Endpoint

T = TypeVar("T")
K = TypeVar("K")


class GenerationError(Exception):
    """A generation call failed."""


class ServerUnavailable(GenerationError):
    """The server could not be reached or answered 5xx/429: try again, maybe elsewhere."""


class RequestRejected(GenerationError):
    """The server refused the request (4xx): trying again would not help."""


class CallTimedOut(ServerUnavailable):
    """A generation call had no answer within its per-call timeout: its server is hung."""


class CallDeadline(msgspec.Struct, frozen=True):
    """When the generation call in progress must have its answer (anyio's clock).

    Every request the call makes (a probe, a rendering, the generation) gets the time
    left, and the transport's own timer enforces it: no cancel scope is armed per call.
    """

    at: float
    timeout_s: float

    def timed_out(self, endpoint: Endpoint) -> CallTimedOut:
        return CallTimedOut(f"{endpoint.name}: no answer in {self.timeout_s:.1f} s (taken as hung)")


#: The deadline of the generation call this task is making, if any (set by the turn).
call_deadline: ContextVar[CallDeadline | None] = ContextVar("call_deadline", default=None)


class Generation(msgspec.Struct, frozen=True):
    """One generation as the server returned it (``finish_reason`` ``"abort"``: a pause
    or a drain ended it early, with what it had sampled so far).

    ``path`` is the API it went through: ``tokens`` (a token-id prompt to
    ``/v1/completions``) or ``chat`` (messages to ``/v1/chat/completions``, which
    returns the server's rendering of them as ``prompt_token_ids``)."""

    text: str
    finish_reason: str
    completion_tokens: int = 0
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    prompt_token_ids: list[int] | None = None
    tool_calls: list[openai.ToolCall] | None = None
    path: Literal["tokens", "chat"] = "chat"


class Conversation(Protocol):
    """What a generation request is made of: the chat, and (for servers that take token
    ids) the exact token list, rendered on demand for the endpoint."""

    @property
    def messages(self) -> list[openai.Message]: ...

    @property
    def tools(self) -> list[dict[str, Any]]: ...

    async def token_ids(self, endpoint: Endpoint) -> list[int] | None:
        """The prompt as token ids for ``endpoint``; None when they are not kept."""
        ...


_JSON = {"content-type": "application/json"}
_PROBE = [openai.Message(role="user", content="hi")]


class ProbeCache(Generic[K, T]):
    """What one-off probes of a server found, by key.

    Callers that ask about one key at once (a rollout's first turns all do) share a single
    probe instead of each sending its own: at 10,000 concurrent trajectories that was
    20,000 extra requests. They share its failure too, so none waits out a hung server's
    timeout once per caller before it moves on; nothing is cached then: the next caller
    probes again.
    """

    def __init__(self) -> None:
        self._found: dict[K, T] = {}
        self._failed: dict[K, Exception] = {}
        self._locks: dict[K, anyio.Lock] = {}

    def __contains__(self, key: K) -> bool:
        """Whether ``key`` was found: callers on a hot path read it at once (``cache[key]``)
        rather than build a probe and await :meth:`get`."""
        return key in self._found

    def __getitem__(self, key: K) -> T:
        return self._found[key]

    async def get(self, key: K, probe: Callable[[], Awaitable[T]]) -> T:
        if key in self._found:
            return self._found[key]
        failed_before = self._failed.get(key)
        async with self._locks.setdefault(key, anyio.Lock()):
            if key in self._found:  # the probe this caller waited for found it
                return self._found[key]
            error = self._failed.get(key)
            if error is not None and error is not failed_before:  # the probe it waited for failed
                raise error
            try:
                self._found[key] = await probe()
            except Exception as exc:
                self._failed[key] = exc
                raise
        return self._found[key]


class OpenAIClient:
    def __init__(self, http: HTTPTransport, *, timeout_s: float = 600.0) -> None:
        self.http = http
        self.timeout_s = timeout_s
        self._tokenize_support: ProbeCache[str, bool] = ProbeCache()
        self._renders_tools: ProbeCache[str, bool] = ProbeCache()

    async def generate(
        self, endpoint: Endpoint, conversation: Conversation, sampling: TurnSampling
    ) -> Generation:
        """One generation: the token path when the endpoint speaks token ids and the
        conversation keeps them (the ids sent are exactly those recorded), else chat."""
        if await self.speaks_tokens(endpoint):
            prompt_ids = await conversation.token_ids(endpoint)
            if prompt_ids is not None:
                return await self.complete(endpoint, prompt_ids, sampling)
        return await self.chat(endpoint, conversation.messages, conversation.tools, sampling)

    async def speaks_tokens(self, endpoint: Endpoint) -> bool:
        """Whether to send ``endpoint`` token ids: its ``api`` says so, or (``auto``) it
        renders chats into ids (see :meth:`supports_tokens`)."""
        if endpoint.api == "chat":
            return False
        return endpoint.api == "tokens" or await self.supports_tokens(endpoint)

    async def chat(
        self,
        endpoint: Endpoint,
        messages: list[openai.Message],
        tools: list[dict[str, Any]] | None,
        turn: TurnSampling,
    ) -> Generation:
        request = openai.ChatCompletionRequest(
            model=endpoint.model,
            messages=messages,
            tools=tools or None,
            max_tokens=turn.max_tokens,
            temperature=turn.temperature,
            top_p=turn.top_p,
            seed=turn.seed,
            logprobs=True,
            return_token_ids=True,
            priority=turn.priority,
            stop=turn.stop,
        )
        response = await self._post(
            endpoint, "/v1/chat/completions", request, openai.ChatCompletion, turn.session
        )
        choice = _first(response.choices)
        logprobs = choice.logprobs.content if choice.logprobs else None
        text = choice.message.content or ""
        if not choice.message.tool_calls:  # (a call split out took its stop string along)
            text = _with_stop_string(text, choice.stop_reason)
        return Generation(
            text=text,
            finish_reason=choice.finish_reason or "stop",
            completion_tokens=_completion_tokens(response.usage, choice.token_ids),
            token_ids=choice.token_ids,
            logprobs=[t.logprob for t in logprobs] if logprobs is not None else None,
            prompt_token_ids=response.prompt_token_ids,
            tool_calls=choice.message.tool_calls,
            path="chat",
        )

    async def complete(
        self, endpoint: Endpoint, prompt_ids: list[int], turn: TurnSampling
    ) -> Generation:
        request = openai.CompletionRequest(
            model=endpoint.model,
            prompt=prompt_ids,
            max_tokens=turn.max_tokens,
            temperature=turn.temperature,
            top_p=turn.top_p,
            seed=turn.seed,
            logprobs=0,
            return_token_ids=True,
            priority=turn.priority,
            stop=turn.stop,
        )
        response = await self._post(
            endpoint, "/v1/completions", request, openai.Completion, turn.session
        )
        choice = _first(response.choices)
        if choice.token_ids is None:
            raise RequestRejected(f"{endpoint.name} returned no token ids from /v1/completions")
        logprobs = choice.logprobs.token_logprobs if choice.logprobs else None
        return Generation(
            text=_with_stop_string(choice.text, choice.stop_reason),
            finish_reason=choice.finish_reason or "stop",
            completion_tokens=len(choice.token_ids),
            token_ids=choice.token_ids,
            logprobs=[lp or 0.0 for lp in logprobs] if logprobs is not None else None,
            path="tokens",
        )

    async def completion(
        self, endpoint: Endpoint, request: openai.CompletionRequest
    ) -> openai.Completion:
        """A ``/v1/completions`` call as the caller wrote it (the gateway's stateless one)."""
        return await self._post(endpoint, "/v1/completions", request, openai.Completion)

    async def tokenize(
        self,
        endpoint: Endpoint,
        messages: list[openai.Message],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool,
    ) -> list[int]:
        request = openai.TokenizeRequest(
            model=endpoint.model,
            messages=messages,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
        )
        response = await self._post(endpoint, "/tokenize", request, openai.TokenizeResponse)
        return response.tokens

    async def supports_tokens(self, endpoint: Endpoint) -> bool:
        """Whether the server renders chat messages into token ids (vLLM's ``/tokenize``)."""
        if endpoint.url in self._tokenize_support:
            return self._tokenize_support[endpoint.url]

        async def probe() -> bool:
            try:
                await self.tokenize(endpoint, _PROBE, add_generation_prompt=True)
            except RequestRejected:
                return False
            return True

        return await self._tokenize_support.get(endpoint.url, probe)

    async def renders_tools(self, endpoint: Endpoint) -> bool:
        """Whether the server's chat template shows the request's ``tools`` to the model.

        Probed once per server by rendering a message with and without a tool; a server
        without ``/tokenize`` (a hosted API) is trusted to handle ``tools`` itself.
        """
        if endpoint.url in self._renders_tools:
            return self._renders_tools[endpoint.url]

        async def probe() -> bool:
            tool = openai.tool_schema("probe", "", {"type": "object", "properties": {}})
            try:
                plain = await self.tokenize(endpoint, _PROBE, add_generation_prompt=True)
                with_tool = await self.tokenize(
                    endpoint, _PROBE, [tool], add_generation_prompt=True
                )
            except RequestRejected:
                return True
            return plain != with_tool

        return await self._renders_tools.get(endpoint.url, probe)

    async def _post(
        self,
        endpoint: Endpoint,
        path: str,
        body: object,
        into: type[T],
        session: str | None = None,
    ) -> T:
        headers = {**_JSON, **endpoint.headers} if endpoint.headers else _JSON
        if endpoint.session_header is not None and session is not None:
            headers = {**headers, endpoint.session_header: session}
        timeout_s, call = self.timeout_s, call_deadline.get()
        if call is not None:  # within a generation call: no later than its deadline
            left = call.at - now()
            if left <= 0:
                raise call.timed_out(endpoint)
            timeout_s = min(timeout_s, left)
        try:
            status, content = await self.http.post(
                endpoint.url + path, msgspec.json.encode(body), headers, timeout_s
            )
        except TransportTimeout as exc:
            if call is not None and timeout_s < self.timeout_s:
                raise call.timed_out(endpoint) from exc
            raise ServerUnavailable(f"{endpoint.name}: {exc}") from exc
        except TransportError as exc:
            raise ServerUnavailable(f"{endpoint.name}: {exc}") from exc
        if status != 200:
            raise _status_error(endpoint, path, status, content)
        try:
            return msgspec.json.decode(content, type=into)
        except msgspec.DecodeError as exc:
            raise ServerUnavailable(f"{endpoint.name}{path}: malformed response: {exc}") from exc


def _status_error(endpoint: Endpoint, path: str, status: int, content: bytes) -> GenerationError:
    try:
        detail = msgspec.json.decode(content, type=openai.ErrorResponse).error.message
    except msgspec.DecodeError:
        detail = content[:300].decode(errors="replace")
    message = f"{endpoint.name}{path}: HTTP {status}: {detail}"
    retryable = status >= 500 or status in (408, 429)
    return ServerUnavailable(message) if retryable else RequestRejected(message)


def _with_stop_string(text: str, stop_reason: int | str | None) -> str:
    """The reply as the model wrote it: vLLM leaves a matched stop string out of the
    text (though not out of the token ids), and says which one it was."""
    if isinstance(stop_reason, str) and not text.endswith(stop_reason):
        return text + stop_reason
    return text


def _completion_tokens(usage: openai.Usage | None, token_ids: list[int] | None) -> int:
    if token_ids is not None:
        return len(token_ids)
    return usage.completion_tokens if usage is not None else 0


def _first(choices: list[T]) -> T:
    if not choices:
        raise ServerUnavailable("the server returned no choices")
    return choices[0]
