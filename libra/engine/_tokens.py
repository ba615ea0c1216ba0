"""Exact token bookkeeping across turns.

A trajectory's tokens are one growing list. The model's sampled ids are appended
exactly as the server returned them, never re-tokenized; only the *new* messages that
follow a model turn (tool results, env replies) are rendered into ids and appended.
Re-rendering the whole conversation each turn would not always reproduce the earlier
turns' tokens (templates rewrite past turns, text round trips re-tokenize differently),
and then the trainer would learn from tokens the model never sampled.

The new messages are rendered with the server's own chat template (``/tokenize``) after
a fixed two-message base conversation, and the base's tokens are cut off right after
its end-of-turn token, so the template's separator after that token is kept. A turn that
a stop string ended gets the end-of-turn token the model did not sample.

Each rendering is a ``/tokenize`` round trip, unless the engine was given a
:class:`ChatTemplate` that runs in-process (the emulator's, a local tokenizer's) and that
template renders a set of probe conversations exactly as the server does: it is then
used for that server instead (checked once per server and model).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from libra import openai
from libra.engine._client import OpenAIClient, ProbeCache, RequestRejected
from libra.engine._records import TokenSource, WeightSpan
from libra.fleet import Endpoint

_BASE = [
    openai.Message(role="user", content="."),
    openai.Message(role="assistant", content="."),
]
_OTHER = [_BASE[0], openai.Message(role="assistant", content="!")]
_PROBE_TOOL = openai.tool_schema("probe", "a probe", {"type": "object", "properties": {}})
_PROBE_CALL = openai.ToolCall(id="call_1", function=openai.FunctionCall("probe", "{}"))
#: What a local template must render exactly as the server does before it replaces
#: ``/tokenize``: each role, a tool call and its result, with and without ``tools``.
_PROBES: list[tuple[list[openai.Message], list[dict[str, Any]], bool]] = [
    (_BASE, [], False),
    (_OTHER, [], False),
    ([openai.Message(role="user", content="hi")], [], True),
    (
        [
            openai.Message(role="system", content="Be brief."),
            openai.Message(role="user", content="Ünïcode, <b>markup</b> and {json}?"),
            openai.Message(role="assistant", content="Let me see.", tool_calls=[_PROBE_CALL]),
            openai.Message(role="tool", content='{"ok": true}', tool_call_id="call_1"),
        ],
        [_PROBE_TOOL],
        True,
    ),
]


class ChatTemplate(Protocol):
    """A chat template and tokenizer that run in-process."""

    def render_chat(
        self,
        messages: Sequence[openai.Message],
        tools: Sequence[dict[str, Any]] | None,
        add_generation_prompt: bool,
    ) -> list[int]: ...


class TokenLog:
    """``ids``, ``mask`` and ``logprobs`` stay aligned; ``spans`` say which weights sampled."""

    def __init__(self) -> None:
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float | None] = []
        self.spans: list[WeightSpan] = []
        self.source: TokenSource = "exact"

    def __len__(self) -> int:
        return len(self.ids)

    def add_context(self, ids: list[int]) -> None:
        """Prompt, tool or env tokens: the trainer does not learn from them."""
        self.ids += ids
        self.mask += [0] * len(ids)
        self.logprobs += [None] * len(ids)

    def add_sampled(self, ids: list[int], logprobs: list[float] | None, version: int) -> None:
        if logprobs is None or len(logprobs) != len(ids):
            raise RequestRejected(
                f"the server returned {len(ids)} token ids but "
                f"{'no' if logprobs is None else len(logprobs)} logprobs"
            )
        self.spans.append(WeightSpan(len(self.ids), len(self.ids) + len(ids), version))
        self.ids += ids
        self.mask += [1] * len(ids)
        self.logprobs += logprobs

    def absorb_prompt(self, prompt_ids: list[int] | None) -> None:
        """Chat API: extend the log with the part of the server's prompt not yet in it.

        If the server's rendering of the conversation no longer starts with the tokens we
        recorded, the template rewrote an earlier turn: mark the log ``drift`` and keep
        only what was exact.
        """
        if self.source != "exact":
            return
        if prompt_ids is None:
            self.source = "none"
        elif prompt_ids[: len(self.ids)] == self.ids:
            self.add_context(prompt_ids[len(self.ids) :])
        else:
            self.source = "drift"


class TemplateRenderer:
    """Renders messages into token ids with a server's chat template: ``/tokenize``, or
    one of ``local`` that renders as the server does (see the module)."""

    def __init__(self, client: OpenAIClient, local: Sequence[ChatTemplate] = ()) -> None:
        self.client = client
        self.local = list(local)
        self._templates: ProbeCache[tuple[str, str], _TurnEnd] = ProbeCache()
        self._local_of: ProbeCache[tuple[str, str], ChatTemplate | None] = ProbeCache()

    async def prompt(
        self, endpoint: Endpoint, messages: list[openai.Message], tools: list[dict[str, Any]]
    ) -> list[int]:
        return await self.render(endpoint, messages, tools, add_generation_prompt=True)

    async def render(
        self,
        endpoint: Endpoint,
        messages: list[openai.Message],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool,
    ) -> list[int]:
        """``messages`` as the server's template renders them, in-process if it can be."""
        local = await self.local_template(endpoint) if self.local else None
        if local is not None:
            return local.render_chat(messages, tools or None, add_generation_prompt)
        return await self.client.tokenize(
            endpoint, messages, tools, add_generation_prompt=add_generation_prompt
        )

    async def local_template(self, endpoint: Endpoint) -> ChatTemplate | None:
        """The first local template that renders the probes as ``endpoint`` does."""
        key = (endpoint.url, endpoint.model)
        if key in self._local_of:
            return self._local_of[key]

        async def probe() -> ChatTemplate | None:
            try:
                served = [
                    await self.client.tokenize(endpoint, m, t, add_generation_prompt=g)
                    for m, t, g in _PROBES
                ]
            except RequestRejected:  # no /tokenize: nothing to compare with
                return None
            for template in self.local:
                if all(
                    template.render_chat(m, t or None, g) == ids
                    for (m, t, g), ids in zip(_PROBES, served, strict=True)
                ):
                    return template
            return None

        return await self._local_of.get(key, probe)

    async def continuation(
        self, endpoint: Endpoint, new_messages: list[openai.Message], last_sampled: int
    ) -> list[int]:
        """Tokens that follow a model turn whose last token is ``last_sampled``: the new
        messages and the prompt for the next assistant turn.

        A turn cut by a stop string has no end-of-turn token; it is closed here the way
        the template closes turns (a context token: the model did not sample it).
        """
        template = await self._turn_end(endpoint)
        full = await self.render(endpoint, [*_BASE, *new_messages], add_generation_prompt=True)
        if full[: len(template.base)] != template.base:
            raise RequestRejected(
                f"{endpoint.name}: the chat template is not prefix-stable, so tool results"
                " cannot be appended as tokens; use api = 'chat'"
            )
        closing = [] if last_sampled == template.end_of_turn else [template.end_of_turn]
        return closing + full[template.cut :]

    async def _turn_end(self, endpoint: Endpoint) -> _TurnEnd:
        key = (endpoint.url, endpoint.model)
        if key in self._templates:
            return self._templates[key]

        async def probe() -> _TurnEnd:
            base = await self.render(endpoint, _BASE, add_generation_prompt=False)
            other = await self.render(endpoint, _OTHER, add_generation_prompt=False)
            return _TurnEnd.of(endpoint, base, other)

        return await self._templates.get(key, probe)


@dataclass(frozen=True, slots=True)
class _TurnEnd:
    """How a chat template closes an assistant turn, learnt from two renderings that
    differ only in the reply: what follows the reply in both is the closing."""

    base: list[int]  # _BASE rendered
    end_of_turn: int  # the closing's first token (``<|im_end|>``), which models sample
    cut: int  # where, in ``base``, the tokens after the end-of-turn token start

    @classmethod
    def of(cls, endpoint: Endpoint, base: list[int], other: list[int]) -> _TurnEnd:
        common = 0
        while common < min(len(base), len(other)) and base[-1 - common] == other[-1 - common]:
            common += 1
        if common == 0 or common == len(base):
            raise RequestRejected(
                f"{endpoint.name}: the chat template closes assistant turns with no token"
                " of its own, so tool results cannot be appended as tokens; use api = 'chat'"
            )
        start = len(base) - common
        return cls(base, base[start], start + 1)
