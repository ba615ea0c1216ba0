"""Exact token bookkeeping: the log's aligned lists and spans, and the template renderer
that appends what follows a model turn as the server's own template renders it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from libra._asgi import Receive, Scope, Send
from libra.emulation import (
    EOS_ID,
    ByteTokenizer,
    EmulatorConfig,
    LatencyModel,
    create_app,
    render_chat,
)
from libra.engine import (
    OpenAIClient,
    RequestRejected,
    TemplateRenderer,
    TokenLog,
    WeightSpan,
    http_transport,
)
from libra.engine._tokens import _TurnEnd
from libra.fleet import Endpoint
from libra.openai import Message
from tests._helpers import CALCULATOR, MODEL

QUESTION = [Message(role="user", content="What is 6 times 7?")]
ANSWER = Message(role="assistant", content="42")
TOOL_RESULT = Message(role="tool", content="42", tool_call_id="call_1", name="calculator")
EMULATED = Endpoint("http://emulated", model=MODEL)


# ------------------------------------------------------------------------------ TokenLog


def test_context_and_sampled_tokens_stay_aligned_and_spans_name_the_weights() -> None:
    log = TokenLog()
    log.add_context([1, 2, 3])
    log.add_sampled([4, 5], [-0.1, -0.2], version=7)
    log.add_context([6])
    log.add_sampled([8], [-0.3], version=8)
    assert len(log) == 7
    assert log.ids == [1, 2, 3, 4, 5, 6, 8]
    assert log.mask == [0, 0, 0, 1, 1, 0, 1]
    assert log.logprobs == [None, None, None, -0.1, -0.2, None, -0.3]
    assert log.spans == [WeightSpan(3, 5, 7), WeightSpan(6, 7, 8)]
    assert [log.ids[span.start : span.end] for span in log.spans] == [[4, 5], [8]]


@pytest.mark.parametrize("logprobs", [None, [-0.1]])
def test_sampled_tokens_without_a_logprob_each_are_refused_and_leave_the_log_as_it_was(
    logprobs: list[float] | None,
) -> None:
    log = TokenLog()
    log.add_context([1])
    with pytest.raises(RequestRejected, match="2 token ids but"):
        log.add_sampled([2, 3], logprobs, version=0)
    assert (log.ids, log.mask, log.logprobs, log.spans) == ([1], [0], [None], [])


def test_a_prompt_that_extends_the_log_adds_only_its_new_tokens_as_context() -> None:
    log = TokenLog()
    log.absorb_prompt([1, 2])
    log.add_sampled([3], [-0.5], version=0)
    log.absorb_prompt([1, 2, 3, 4, 5])
    assert (log.ids, log.mask, log.source) == ([1, 2, 3, 4, 5], [0, 0, 1, 0, 0], "exact")


def test_a_rewritten_earlier_turn_marks_drift_and_keeps_only_what_was_exact() -> None:
    log = TokenLog()
    log.absorb_prompt([1, 2])
    log.add_sampled([3], [-0.5], version=0)
    log.absorb_prompt([1, 9, 3, 4])  # the template re-rendered the first turn
    assert (log.ids, log.source) == ([1, 2, 3], "drift")
    log.absorb_prompt([1, 2, 3, 4])  # once inexact, nothing more is appended
    assert (log.ids, log.source) == ([1, 2, 3], "drift")


def test_a_server_without_prompt_ids_leaves_a_log_of_no_tokens() -> None:
    log = TokenLog()
    log.absorb_prompt(None)
    assert (log.ids, log.source) == ([], "none")


# ---------------------------------------------------------------------- TemplateRenderer


@pytest.fixture
async def renderer() -> AsyncIterator[TemplateRenderer]:
    app = create_app(EmulatorConfig(latency=LatencyModel.zero()))
    async with http_transport(httpx.ASGITransport(app=app)) as http:
        yield TemplateRenderer(OpenAIClient(http))


@pytest.mark.anyio
async def test_the_prompt_is_the_servers_rendering_with_tools(renderer: TemplateRenderer) -> None:
    prompt = await renderer.prompt(EMULATED, QUESTION, [CALCULATOR])
    assert prompt == render_chat(QUESTION, [CALCULATOR], add_generation_prompt=True)


@pytest.mark.anyio
@pytest.mark.parametrize("closed_by_the_model", [True, False])
async def test_a_continuation_appended_to_the_sampled_turn_is_the_whole_rendering(
    renderer: TemplateRenderer, closed_by_the_model: bool
) -> None:
    """Whether the model sampled its end-of-turn token or a stop string cut the turn
    first, prompt + sampled + continuation is what the template renders for the chat."""
    sampled = [*b"42", EOS_ID] if closed_by_the_model else list(b"42")
    continuation = await renderer.continuation(EMULATED, [TOOL_RESULT], sampled[-1])
    assert (continuation[0] == EOS_ID) != closed_by_the_model
    prompt = render_chat(QUESTION, add_generation_prompt=True)
    whole = render_chat([*QUESTION, ANSWER, TOOL_RESULT], add_generation_prompt=True)
    assert prompt + sampled + continuation == whole


def test_a_template_that_does_not_close_turns_with_a_token_of_its_own_is_refused() -> None:
    # Renderings of two replies that share no closing, or differ only in their closing.
    for base, other in (([5, 6, 1], [5, 6, 2]), ([1, 2], [3, 1, 2])):
        with pytest.raises(RequestRejected, match="closes assistant turns with no token"):
            _TurnEnd.of(EMULATED, base, other)
    turn_end = _TurnEnd.of(EMULATED, [5, 6, 1, EOS_ID, 10], [5, 6, 2, EOS_ID, 10])
    assert (turn_end.end_of_turn, turn_end.cut) == (EOS_ID, 4)


class _Counted:
    """An ASGI app, and how many requests each path got."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.paths: dict[str, int] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.paths[scope["path"]] = self.paths.get(scope["path"], 0) + 1
        await self.app(scope, receive, send)


@pytest.mark.anyio
@pytest.mark.parametrize("renders_tools", [True, False])
async def test_a_local_template_replaces_tokenize_only_where_it_renders_as_the_server(
    renders_tools: bool,
) -> None:
    """The emulator's own template renders in-process once the probes agree; where the
    server drops ``tools`` (and so renders otherwise), every rendering stays remote."""
    config = EmulatorConfig(latency=LatencyModel.zero(), template_renders_tools=renders_tools)
    server = _Counted(create_app(config))
    async with http_transport(httpx.ASGITransport(app=server)) as http:
        renderer = TemplateRenderer(OpenAIClient(http), [ByteTokenizer()])
        assert (await renderer.local_template(EMULATED) is not None) == renders_tools
        probed = server.paths["/tokenize"]
        prompt = await renderer.prompt(EMULATED, QUESTION, [CALCULATOR])
        continuation = await renderer.continuation(EMULATED, [TOOL_RESULT], EOS_ID)
        remote = server.paths["/tokenize"] - probed
    tools = [CALCULATOR] if renders_tools else None
    assert prompt == render_chat(QUESTION, tools, add_generation_prompt=True)
    whole = render_chat([*QUESTION, ANSWER, TOOL_RESULT], add_generation_prompt=True)
    first = render_chat(QUESTION, add_generation_prompt=True)
    assert [*first, *b"42", EOS_ID, *continuation] == whole
    # Remote: the prompt, the turn end's two probes, the continuation.
    assert remote == (0 if renders_tools else 4)
