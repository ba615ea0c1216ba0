"""One gateway session: a conversation an external agent drives, kept as a trajectory.

A :class:`Session` is what the engine's turn mechanics need of a conversation
(``libra.engine.Dialogue``) plus what the gateway needs to find it again and record it.
It keeps two views of the chat. ``messages`` is what the model was shown (the tools may
be described in its system message; its replies as it wrote them, tool-call markup
included). The client's view is the messages it sent and the replies it got (tool calls
split out as OpenAI ``tool_calls``): of that only a digest is kept, a hash chain over
the canonical encoding of each message, so that the next request is matched to its
session by one dict access.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from dataclasses import dataclass
from typing import Any, Literal

import anyio
import msgspec

from libra import openai
from libra._clock import now
from libra.engine import (
    SamplingConfig,
    Timings,
    TokenLog,
    ToolReturnRecord,
    TrajectoryRecord,
    Turn,
    record_of,
    with_tools_described,
)
from libra.envs import GroupId, HermesToolCallParser, TaskId, ToolCallParser
from libra.fleet import Endpoint
from libra.gateway._protocol import ChatReply, FinishReason
from libra.signals import ToolSignal, signal_of

Digest = bytes
Status = Literal["completed", "truncated", "failed"]
TokenSource = Literal["exact", "drift", "none"]
_EMPTY: Digest = b""
_PARSER = HermesToolCallParser()  # (it keeps no state: sessions share it)
#: What the Hermes parser reads, removed from the reply the client sees.
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>.*?(?:</tool_call>|$)", re.DOTALL)


def digests_of(messages: list[openai.Message], start: Digest = _EMPTY) -> list[Digest]:
    """The hash chain over ``messages``: entry ``i`` digests ``messages[: i + 1]``."""
    chain, digest = [], start
    for message in messages:
        digest = hashlib.blake2b(digest + _canonical(message), digest_size=16).digest()
        chain.append(digest)
    return chain


# What json.dumps(..., **options) would build on every call (a measurable share of a
# request), built once.
_encode_sorted = json.JSONEncoder(sort_keys=True, separators=(",", ":")).encode
# The same bytes as ``json.dumps(fields, ensure_ascii=False, separators=(",", ":"))``
# encoded to UTF-8 (escapes included: tests/gateway compare the two), ~15x faster. The
# digests name tasks in records and in the scheduler's saved state: they must not change.
_encode_compact = msgspec.json.Encoder().encode


def _canonical(message: openai.Message) -> bytes:
    """What identifies a message whatever client re-sent it: no ``null`` versus ``""``
    content, no key order or spacing in tool arguments, no optional ``name``."""
    calls = [
        [call.id, call.function.name, _canonical_arguments(call.function.arguments)]
        for call in message.tool_calls or ()
    ]
    fields = [message.role, message.content or "", calls, message.tool_call_id or ""]
    return _encode_compact(fields)


def _canonical_arguments(arguments: str) -> str:
    try:
        return _encode_sorted(json.loads(arguments))
    except json.JSONDecodeError:
        return arguments


def prompt_key_of(messages: list[openai.Message], digests: list[Digest]) -> str:
    """The task a conversation is an instance of: its messages before the first reply
    (what C-MLFQ learns prefix histories under, and what records are grouped by)."""
    first_reply = next((i for i, m in enumerate(messages) if m.role == "assistant"), None)
    end = len(messages) if first_reply is None else first_reply
    return digests[end - 1].hex()[:16] if end > 0 else "empty"


@dataclass(slots=True)
class Mark:
    """Where a session stood before a turn, to go back to if the turn is given up."""

    messages: int
    pending: list[openai.Message]
    tokens: int
    source: TokenSource
    tool_returns: int


class Session:
    """One session's state (see the module); ``key`` keys the scheduler and the record."""

    __slots__ = (
        "busy",
        "call_names",
        "client_key",
        "digest",
        "done",
        "endpoints",
        "env",
        "event_id",
        "idle",
        "key",
        "last_endpoint",
        "last_used",
        "messages",
        "output_tokens",
        "parser",
        "pending",
        "prompt_key",
        "replied_at",
        "reward",
        "sampling",
        "seen",
        "started_at",
        "stop_strings",
        "timings",
        "tokens",
        "tool_returns",
        "tools",
        "turns",
        "uses_tools",
        "weight_version",
        "weights_changed_turns",
    )

    def __init__(
        self,
        key: str,
        env: str,
        prompt_key: str,
        sampling: SamplingConfig,
        tools: list[dict[str, Any]],
    ) -> None:
        self.key, self.env, self.prompt_key = key, env, prompt_key
        self.client_key: str | None = None  # the client's own name for it, if it gave one
        self.event_id = key  # (or the episode it is a piece of: ``Sessions.episode_of``)
        self.sampling = sampling
        self.tools = list(tools)  # sent with requests; [] once described in the prompt
        self.uses_tools = bool(tools)
        self.parser: ToolCallParser = _PARSER
        self.stop_strings: list[str] | None = None
        self.messages: list[openai.Message] = []
        self.pending: list[openai.Message] = []
        self.tokens = TokenLog()
        self.turns = 0
        self.output_tokens = 0
        self.last_endpoint: Endpoint | None = None
        self.weight_version: int | None = None
        self.weights_changed_turns = 0
        self.timings = Timings()
        self.tool_returns: list[ToolReturnRecord] = []
        self.endpoints: list[str] = []
        self.call_names: dict[str, str] = {}  # tool call id -> tool name, from the chat
        self.seen = 0  # messages of the client's view
        self.digest: Digest = _EMPTY  # of the client's view
        self.reward: float | None = None
        self.done = False  # the client said it is over
        self.busy = False  # a turn is being generated
        self.idle: anyio.Event | None = None  # set when the turn in progress ends (if waited for)
        self.started_at = self.last_used = self.replied_at = now()

    @property
    def env_name(self) -> str:
        return self.env

    def describe_tools_in_system_message(self) -> None:
        self.messages[:] = with_tools_described(self.messages, self.parser.describe(self.tools))
        self.tools = []

    # ------------------------------------------------------------------ a request

    def extended_by(self, messages: list[openai.Message], digests: list[Digest]) -> bool:
        """Whether ``messages`` are the client's view of the session and something new."""
        return len(messages) > self.seen and (
            self.seen == 0 or digests[self.seen - 1] == self.digest
        )

    def take(self, messages: list[openai.Message]) -> list[ToolSignal]:
        """The request's messages past the client's view join the chat; the tool results
        among those after the last reply become signals (and tool-return records)."""
        new = messages[self.seen :]
        self.messages += new
        self.pending += new
        for message in new:
            for call in message.tool_calls or ():
                self.call_names[call.id] = call.function.name
        last_reply = max((i for i, m in enumerate(new) if m.role == "assistant"), default=-1)
        waited = now() - self.replied_at
        results = [m for m in new[last_reply + 1 :] if m.role == "tool"]
        if results:
            self.timings.tool_s += waited
        return [self._tool_return(m, waited) for m in results]

    def _tool_return(self, message: openai.Message, latency_s: float) -> ToolSignal:
        name = self.call_names.get(message.tool_call_id or "") or message.name or "?"
        content = message.content or ""
        signal = signal_of(name, content, None)
        self.record_tool(signal, len(content), latency_s)
        return signal

    def record_tool(self, signal: ToolSignal, chars: int, latency_s: float) -> None:
        record = ToolReturnRecord(
            signal.tool, signal.status, signal.size_class, chars, round(latency_s, 6)
        )
        self.tool_returns.append(record)

    def mark(self) -> Mark:
        return Mark(
            len(self.messages),
            list(self.pending),
            len(self.tokens),
            self.tokens.source,
            len(self.tool_returns),
        )

    def rollback(self, mark: Mark) -> None:
        """Back to before the request at ``mark`` (which the client may send again)."""
        del self.messages[mark.messages :]
        self.pending = mark.pending
        tokens = self.tokens
        del tokens.ids[mark.tokens :], tokens.mask[mark.tokens :], tokens.logprobs[mark.tokens :]
        tokens.source = mark.source
        del self.tool_returns[mark.tool_returns :]

    # ------------------------------------------------------------------- a reply

    def add_reply(
        self, turn: Turn, request: list[openai.Message], digests: list[Digest]
    ) -> ChatReply:
        """The turn joins the chat as the model wrote it; the client gets it with any
        tool calls written in its text split out, and the session its new view."""
        generation = turn.generation
        prompt_tokens = len(self.tokens)
        self.turns += 1
        self.output_tokens += generation.completion_tokens
        last = turn.pieces[-1]
        self.endpoints.append(last.endpoint.name)
        self.messages.append(
            openai.Message(
                role="assistant", content=generation.text, tool_calls=generation.tool_calls
            )
        )
        turn.add_to(self.tokens)
        content, calls = self._client_view(generation.text, generation.tool_calls)
        for call in calls:
            self.call_names[call.id] = call.function.name
        reply = openai.Message(role="assistant", content=content, tool_calls=calls or None)
        self.seen = len(request) + 1
        self.digest = digests_of([reply], digests[-1] if digests else _EMPTY)[0]
        self.replied_at = now()
        return ChatReply(
            session=self.client_key or self.key,
            content=content,
            tool_calls=calls,
            finish_reason=_finish_reason(generation.finish_reason, calls),
            prompt_tokens=prompt_tokens
            if self.tokens.source == "exact"
            else len(generation.prompt_token_ids or ()),
            completion_tokens=generation.completion_tokens,
            endpoint=last.endpoint.name,
            weight_version=last.weight_version,
        )

    def _client_view(
        self, text: str, calls: list[openai.ToolCall] | None
    ) -> tuple[str | None, list[openai.ToolCall]]:
        """The reply as OpenAI clients expect it: calls in ``tool_calls``, not in text."""
        if calls:
            return text or None, list(calls)
        if not self.uses_tools:
            return text, []
        parsed = [call for call in self.parser.parse(text) if call.error is None]
        if not parsed:
            return text, []
        split = [
            openai.ToolCall(
                id=f"call_{secrets.token_hex(6)}",
                function=openai.FunctionCall(call.name, json.dumps(call.arguments)),
            )
            for call in parsed
        ]
        return _TOOL_CALL_BLOCK.sub("", text).strip() or None, split

    # ----------------------------------------------------------------- the record

    def record(self, status: Status, stop_reason: str, error: str | None) -> TrajectoryRecord:
        """The session as ``libra rollout`` records a trajectory. Its task is its prompt
        (``env/<digest of the messages before the first reply>``), so sessions that
        start alike share a ``task_id`` and a ``group_id`` (at step 0: the gateway knows
        no RL steps; ``weight_versions`` say which weights sampled what)."""
        self.timings.total_s = now() - self.started_at
        task = TaskId(self.env, self.prompt_key)
        return record_of(
            self,
            env=self.env,
            task_id=str(task),
            group_id=str(GroupId(0, task)),
            step=0,
            sample=0,
            status=status,
            stop_reason=stop_reason,
            reward=None if status == "failed" else self.reward,
            error=error,
        )


def _finish_reason(reason: str, calls: list[openai.ToolCall]) -> FinishReason:
    if calls:
        return "tool_calls"
    return "length" if reason == "length" else "stop"


def new_session_key(counter: int) -> str:
    """A session's id: a counter (unique in this gateway) and a random suffix (so that
    one client cannot guess, and report on, another's session)."""
    return f"s{counter}-{_RANDOM.hex(4)}"


class _RandomPool:
    """Random bytes from the OS, read 4 KiB at a time: a read per session key was a
    measurable share of a request."""

    def __init__(self) -> None:
        self._pool, self._used = b"", 0

    def hex(self, size: int) -> str:
        if self._used + size > len(self._pool):
            self._pool, self._used = os.urandom(4096), 0
        start = self._used
        self._used += size
        return self._pool[start : self._used].hex()


_RANDOM = _RandomPool()
