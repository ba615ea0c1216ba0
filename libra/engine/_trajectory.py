"""The life of one trajectory, top to bottom.

``run_trajectory`` is one coroutine: reset the env, then alternate generation calls
(routed by the scheduler) with tool calls (run by the env, maybe in a sandbox), feeding
every tool return to the scheduler, until the model stops, the env ends the episode or
a limit is hit; then score the answer. A generation that a paused or drained server
aborts does not end its turn: the turn goes on where it stopped (see ``_generate``).
Whatever happens (a tool that raises or hangs, garbage from the model, a dead server,
cancellation), the trajectory ends in exactly one record: returned, or, when cancelled,
handed to ``on_cancelled`` (a cancelled coroutine cannot return). ``Engine.on_record``
sees every record too.
"""

from __future__ import annotations

import inspect
import json
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import KW_ONLY, dataclass, field
from functools import partial
from typing import Any, TypeVar

import anyio
import msgspec
import pydantic

from libra import openai
from libra.engine._client import (
    Generation,
    GenerationError,
    OpenAIClient,
    RequestRejected,
    ServerUnavailable,
)
from libra.engine._config import EngineConfig, SamplingConfig, TurnSampling
from libra.engine._http import HTTPTransport
from libra.engine._records import (
    SamplingRecord,
    Status,
    Timings,
    ToolReturnRecord,
    TrajectoryRecord,
)
from libra.engine._tokens import TemplateRenderer, TokenLog
from libra.envs import (
    Env,
    EnvBugs,
    GroupId,
    HermesToolCallParser,
    SandboxError,
    SandboxProvider,
    Task,
    TaskId,
    ToolCall,
    ToolCallParser,
    ToolError,
    ToolResult,
    ToolReturn,
    ToolTimeout,
    TrajectoryId,
    cut_middle,
    from_openai,
    valid_utf8,
)
from libra.fleet import Endpoint
from libra.sched import CallOutcome, NoEndpointAvailable, Route, Router, RouteRequest, Scheduler
from libra.signals import ToolStatus, signal_of

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class TrajectoryJob:
    """One trajectory to run: sample ``sample`` of ``task`` at RL step ``step``."""

    env_cls: type[Env]
    task: Task
    sample: int = 0
    step: int = 0

    @classmethod
    def seeded(
        cls, env_cls: type[Env], env_name: str, seed: int, sample: int = 0, step: int = 0
    ) -> TrajectoryJob:
        """A job of a seeded env: its task is keyed by ``seed``."""
        return cls(env_cls, Task.from_seed(env_name, seed), sample, step)

    @property
    def task_id(self) -> TaskId:
        return self.task.id

    @property
    def id(self) -> TrajectoryId:
        return TrajectoryId(self.step, self.task.id, self.sample)

    @property
    def group_id(self) -> GroupId:
        return GroupId(self.step, self.task.id)


@dataclass
class Engine:
    """What trajectories share: the client, the scheduler, sandboxes and the limits.

    The engine builds its client over ``http`` itself, so every limit in ``config``
    (the request timeout included) is the one that applies.
    """

    http: HTTPTransport
    scheduler: Scheduler
    _: KW_ONLY
    config: EngineConfig = field(default_factory=EngineConfig)
    sandboxes: SandboxProvider | None = None
    #: Sees every record the engine makes, whichever session ran it (a log, a test);
    #: the consumer of a rollout reads its session's stream instead.
    on_record: Callable[[TrajectoryRecord], None] | None = None
    client: OpenAIClient = field(init=False)
    renderer: TemplateRenderer = field(init=False)
    #: Exceptions raised by env code: each place and type's first traceback on stderr.
    env_bugs: EnvBugs = field(init=False, default_factory=EnvBugs)
    #: The trajectories its sessions hold (queued or running): no two alike at once,
    #: whichever session holds them, since the scheduler keys its state by them.
    live_ids: set[TrajectoryId] = field(init=False, default_factory=set)

    def __post_init__(self) -> None:
        self.client = OpenAIClient(self.http, timeout_s=self.config.request_timeout_s)
        self.renderer = TemplateRenderer(self.client)


# How vLLM (and the emulator) refuse a request that does not fit the model's context.
_CONTEXT_FULL = "maximum context length"


class _End(Exception):
    """The episode is over (normally): carries the status and why."""

    def __init__(self, status: Status, reason: str) -> None:
        self.status, self.reason = status, reason


async def run_trajectory(
    job: TrajectoryJob,
    engine: Engine,
    *,
    on_cancelled: Callable[[TrajectoryRecord], None] | None = None,
) -> TrajectoryRecord:
    t = _Trajectory(job, engine.config.sampling)
    env = job.env_cls()
    started = anyio.current_time()
    try:
        with anyio.fail_after(engine.config.max_wall_s):
            async with _sandbox(env, engine):
                await _episode(env, t, engine)
    except _End as end:
        t.status, t.stop_reason = end.status, end.reason
        if end.reason == "max_context_tokens" and t.turns == 0:
            t.prompt_too_long(
                f"{len(t.tokens)} tokens; max_context_tokens is {engine.config.max_context_tokens}"
            )
    except TimeoutError:
        t.status, t.stop_reason = "truncated", "max_wall_s"
    except GenerationError as exc:
        if not (isinstance(exc, RequestRejected) and _CONTEXT_FULL in str(exc)):
            t.fail("server_error", str(exc))
        elif t.turns == 0:
            t.prompt_too_long(f"the server said: {exc}")
        else:  # the server's context is smaller than max_context_tokens: it ends here
            t.status, t.stop_reason = "truncated", "max_context_tokens"
    except SandboxError as exc:
        t.fail("sandbox_error", str(exc))
    except anyio.get_cancelled_exc_class():
        t.fail("cancelled", "the rollout was cancelled")
        with anyio.CancelScope(shield=True):
            record = await _finish(env, t, engine, started)
        if on_cancelled is not None:
            on_cancelled(record)
        raise
    except Exception as exc:  # a bug in the env: report it, never crash the rollout
        engine.env_bugs.report(f"env {type(env).__name__}", exc)
        t.fail("env_error", _describe(exc))
    if t.status != "failed":
        await _score(env, t, engine.env_bugs)
    return await _finish(env, t, engine, started)


async def _episode(env: Env, t: _Trajectory, engine: Engine) -> None:
    prompt: str | list[openai.Message] = await _maybe_await(env.reset_with(t.job.task))
    t.start(env, prompt)
    max_turns = engine.config.max_turns or env.max_turns
    while True:
        if t.turns >= max_turns:
            raise _End("truncated", "max_turns")
        turn = await _generate(t, engine)
        t.add_model_turn(turn)
        generation = turn.generation
        calls = _tool_calls(env, generation)
        if generation.finish_reason == "length":
            if len(t.tokens) >= engine.config.max_context_tokens:
                raise _End("truncated", "max_context_tokens")
            if engine.config.on_max_tokens == "truncate" or not calls:
                raise _End("truncated", "max_tokens")
        if not calls:
            follow_up = await _maybe_await(env.on_reply(generation.text))
            if follow_up is None or env.done:
                raise _End("completed", "env_done" if env.done else "model_stop")
            t.add_messages([openai.Message(role="user", content=follow_up)])
            continue
        for call in calls:
            timeout_s = engine.config.tool_timeout_s or env.tool_timeout_s
            result = await _run_tool(env, call, timeout_s, engine.env_bugs)
            t.add_tool_return(result)
            engine.scheduler.on_tool_return(t.key, env.signal(result))
        if env.done:
            raise _End("completed", "env_done")


# ------------------------------------------------------------------------- generation


async def _generate(t: _Trajectory, engine: Engine) -> _Turn:
    """One model turn, in as many generations as it takes.

    A generation that ends with ``finish_reason: "abort"`` (a paused or drained server)
    is not the end of the turn. On the token path its sampled tokens are kept and the
    same turn is asked for again, through routing (so maybe on another endpoint), as a
    continuation of the token list with what is left of the turn's token budget; the
    pieces make one turn. The chat path cannot continue a partial reply, so there the
    turn starts over (what it had sampled is dropped). After ``max_continuations`` such
    restarts a further abort fails the trajectory as a server error.
    """
    config = engine.config
    turn = _Turn()
    for _ in range(config.max_continuations + 1):
        if turn.pieces and _turn_budget(t, config, turn) <= 0:
            return turn.ended("length")  # the abort came on the turn's last token
        piece = await _attempt(t, engine, turn)
        if piece.generation.path == "chat":
            turn.pieces.clear()  # a chat reply is always the whole turn
        turn.pieces.append(piece)
        if piece.generation.finish_reason != "abort":
            return turn
    raise ServerUnavailable(f"a turn was aborted {config.max_continuations + 1} times")


async def _attempt(t: _Trajectory, engine: Engine, turn: _Turn) -> _Piece:
    """One generation call: route, call, release with what happened; on a server failure
    retry (elsewhere if possible). A failure on an instance the fleet has retired since
    (drained, removed) costs no attempt; with no usable endpoint the call waits for
    capacity. An aborted generation came from a healthy server (paused or drained): it
    is released as ``migrated``, and the turn goes on in the next piece."""
    config, scheduler = engine.config, engine.scheduler
    failed: set[str] = set()
    backoff = config.retry_backoff_s
    attempts = 0
    capacity = _CapacityWait(config.capacity_wait_s)
    while True:
        route = await _route(t, turn, scheduler, failed, capacity)
        generation: Generation | None = None
        outcome: CallOutcome = "cancelled"  # unless the call says otherwise below
        try:
            generation = await _call(t, engine, route, turn)
            outcome = "migrated" if generation.finish_reason == "abort" else "ok"
            t.weights_changed_turns += route.weights_changed
            return _Piece(generation, route.endpoint, route.weight_version)
        except ServerUnavailable as exc:
            capacity.last_error = str(exc)
            if route.retired:
                outcome = "migrated"
                continue  # planned: go on elsewhere at once, no attempt spent
            outcome = "failed"
            failed.add(route.endpoint.name)
            attempts += 1
            if attempts >= config.max_attempts:
                raise
        except RequestRejected:
            outcome = "rejected"
            raise
        finally:
            sampled = len(generation.token_ids or ()) if generation is not None else 0
            scheduler.release(route, outcome=outcome, new_tokens=sampled)
        await anyio.sleep(backoff)
        backoff *= 2


class NoCapacity(ServerUnavailable):
    """No endpoint became usable within ``capacity_wait_s``."""


class _CapacityWait:
    """What one call may still wait for an endpoint, and the failure to report if none."""

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.last_error = ""

    async def wait(self, router: Router, why: str) -> None:
        """Until the router gains a usable endpoint (or the budget is spent: fail)."""
        if self.budget_s <= 0:
            after = f" (last failure: {self.last_error})" if self.last_error else ""
            raise NoCapacity(f"no endpoint for {why}{after}")
        started = anyio.current_time()
        with anyio.move_on_after(self.budget_s):
            await router.membership.wait()
        self.budget_s -= anyio.current_time() - started


async def _route(
    t: _Trajectory, turn: _Turn, scheduler: Scheduler, failed: set[str], capacity: _CapacityWait
) -> Route:
    request = RouteRequest(
        t.key,
        t.prompt_key,
        t.turns,
        len(t.tokens) + turn.produced,
        t.last_endpoint,
        generated_tokens=t.output_tokens + turn.produced,
        env=t.job.task.id.env,
    )
    while True:
        try:
            route = scheduler.route(request, frozenset(failed))
        except NoEndpointAvailable as exc:
            if failed:
                failed.clear()  # every endpoint failed once: they may be back, try them all
                continue
            await capacity.wait(scheduler.router, str(exc))
            continue
        if t.weight_version is None:  # the weights it started on
            t.weight_version = route.weight_version
        return route


async def _call(t: _Trajectory, engine: Engine, route: Route, turn: _Turn) -> Generation:
    endpoint, client = route.endpoint, engine.client
    if t.turns == 0 and t.tools and not await client.renders_tools(endpoint):
        t.describe_tools_in_system_message()
    started = anyio.current_time()
    if t.tokens.source == "exact" and await client.speaks_tokens(endpoint):
        await _render_pending(t, engine.renderer, endpoint)  # the budget sees the whole prompt
    sampling = _turn_sampling(t, engine.config, route, turn)
    generation = await client.generate(endpoint, _Prompt(t, turn, engine.renderer), sampling)
    if generation.path == "chat":
        t.tokens.absorb_prompt(generation.prompt_token_ids)
    t.timings.generation_s += anyio.current_time() - started
    t.last_endpoint = endpoint
    return generation


@dataclass(frozen=True, slots=True)
class _Prompt:
    """A generation request's conversation (see ``OpenAIClient.generate``): the chat, or
    the exact token list, a partial turn included, with pending messages rendered."""

    t: _Trajectory
    turn: _Turn
    renderer: TemplateRenderer

    @property
    def messages(self) -> list[openai.Message]:
        return self.t.messages

    @property
    def tools(self) -> list[dict[str, Any]]:
        return self.t.tools

    async def token_ids(self, endpoint: Endpoint) -> list[int] | None:
        if self.t.tokens.source != "exact":
            return None
        await _render_pending(self.t, self.renderer, endpoint)
        return self.t.tokens.ids + self.turn.token_ids


async def _render_pending(t: _Trajectory, renderer: TemplateRenderer, endpoint: Endpoint) -> None:
    """Append the messages that arrived since the last model turn as token ids."""
    if not t.tokens.ids:
        t.tokens.add_context(await renderer.prompt(endpoint, t.messages, t.tools))
    elif t.pending:
        t.tokens.add_context(await renderer.continuation(endpoint, t.pending, t.tokens.ids[-1]))
    t.pending = []


def _turn_budget(t: _Trajectory, config: EngineConfig, turn: _Turn) -> int:
    """Tokens the turn may still sample: its own limit, and the room left in the context."""
    room = config.max_context_tokens - len(t.tokens)
    return min(room, config.sampling.max_tokens_per_turn) - turn.produced


def _turn_sampling(t: _Trajectory, config: EngineConfig, route: Route, turn: _Turn) -> TurnSampling:
    """Every sampling parameter of the next request: the turn's remaining budget (capped
    by the room left in the context), a per-turn seed, the route's priority."""
    if config.max_context_tokens - len(t.tokens) <= 0:
        raise _End("truncated", "max_context_tokens")
    sampling = config.sampling
    seed = sampling.seed
    if seed is not None:  # reproducible, yet different for every sample and turn
        seed = zlib.crc32(f"{seed}/{t.key}/{t.turns}".encode())
    return TurnSampling(
        max_tokens=_turn_budget(t, config, turn),
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=seed,
        priority=route.priority,
        stop=t.stop_strings,
    )


@dataclass(frozen=True, slots=True)
class _Piece:
    """One generation of a turn, and where and by which weights it was sampled."""

    generation: Generation
    endpoint: Endpoint
    weight_version: int


@dataclass(slots=True)
class _Turn:
    """A model turn: one generation, or several when aborted ones were continued."""

    pieces: list[_Piece] = field(default_factory=list)
    finish_reason: str | None = None  # set when the turn ended for a reason of its own

    @property
    def produced(self) -> int:
        return sum(piece.generation.completion_tokens for piece in self.pieces)

    @property
    def token_ids(self) -> list[int]:
        return [i for piece in self.pieces for i in piece.generation.token_ids or ()]

    def ended(self, finish_reason: str) -> _Turn:
        self.finish_reason = finish_reason
        return self

    @property
    def generation(self) -> Generation:
        """The pieces as one generation (the text joined, the ids and logprobs too)."""
        last = self.pieces[-1].generation
        if len(self.pieces) == 1 and self.finish_reason is None:
            return last
        generations = [piece.generation for piece in self.pieces]
        return Generation(
            text="".join(g.text for g in generations),
            finish_reason=self.finish_reason or last.finish_reason,
            completion_tokens=self.produced,
            token_ids=self.token_ids,
            logprobs=[lp for g in generations for lp in g.logprobs or ()],
            prompt_token_ids=last.prompt_token_ids,
            tool_calls=last.tool_calls,
            path=last.path,
        )


# ---------------------------------------------------------------------------- tools


def _tool_calls(env: Env, generation: Generation) -> list[ToolCall]:
    if generation.tool_calls:
        return from_openai(generation.tool_calls)
    return env.tool_call_parser.parse(generation.text)


async def _run_tool(env: Env, call: ToolCall, timeout_s: float, bugs: EnvBugs) -> ToolReturn:
    """Run one call and reduce what came of it, once, to what is recorded and signalled.
    A tool that raised other than ``ToolError`` has a bug: the model reads the error, the
    record names the exception, its author sees the traceback (once)."""
    started = anyio.current_time()
    exception: str | None = None
    try:
        outcome = await _outcome(env, call, timeout_s)
    except _ToolBug as bug:
        bugs.report(f"tool {call.name} of env {type(env).__name__}", bug.error)
        outcome, exception = ToolResult.failure(_describe(bug.error)), type(bug.error).__name__
    latency = anyio.current_time() - started
    reported: ToolStatus | None
    if isinstance(outcome, ToolResult):
        content, reported = outcome.content, outcome.status
    else:
        content, reported = outcome, None  # plain text: its status is read back from it
    content = cut_middle(valid_utf8(content), env.max_tool_output_chars)
    signal = signal_of(call.name or "?", content, reported)
    return ToolReturn(call.id, signal.tool, content, signal.status, latency, exception)


class _ToolBug(Exception):
    """A tool raised ``error``, which is not a ``ToolError``."""

    def __init__(self, error: Exception) -> None:
        self.error = error


async def _outcome(env: Env, call: ToolCall, timeout_s: float) -> ToolResult | str:
    """What the call produced: a result whose status is known, or plain text. Every
    failure becomes an error message the model can read."""
    spec = env.tool_specs().get(call.name)
    if call.error is not None:
        return ToolResult.failure(call.error)
    if spec is None:
        known = ", ".join(env.tool_specs()) or "none"
        return ToolResult.failure(f"unknown tool {call.name!r}. Available tools: {known}")
    try:
        arguments = spec.validate(call.arguments)
    except pydantic.ValidationError as exc:
        return ToolResult.failure(f"invalid arguments for {call.name}: {_brief(exc)}")
    method = getattr(env, call.name)
    try:
        with anyio.fail_after(timeout_s):
            if spec.is_async:
                output = await method(**arguments)
            else:  # a thread, so a blocking tool cannot stall the event loop
                output = await anyio.to_thread.run_sync(
                    partial(method, **arguments), abandon_on_cancel=True
                )
    except TimeoutError:
        return ToolResult.of_error(ToolTimeout.after(call.name, timeout_s))
    except ToolError as exc:  # a ToolTimeout too: the tool ran out of its own time
        return ToolResult.of_error(exc)
    except SandboxError:
        raise  # the sandbox itself is broken: not the model's fault, not its problem to fix
    except Exception as exc:
        raise _ToolBug(exc) from exc
    if isinstance(output, ToolResult | str):
        return output
    if isinstance(output, bytes):  # what a program printed, say: text for the model
        return output.decode("utf-8", "replace")
    return json.dumps(output, default=str)


def _brief(exc: pydantic.ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(map(str, e['loc'])) or 'arguments'}: {e['msg']}" for e in exc.errors()
    )


# ------------------------------------------------------------------ episode bookends


@asynccontextmanager
async def _sandbox(env: Env, engine: Engine) -> AsyncIterator[None]:
    spec = env.sandbox_spec
    if spec is None:
        yield
        return
    if engine.sandboxes is None:
        raise SandboxError(f"{type(env).__name__} runs tools in a sandbox, but none is configured")
    async with engine.sandboxes.sandbox(spec) as sandbox:
        env.sandbox = sandbox
        yield


async def _score(env: Env, t: _Trajectory, bugs: EnvBugs) -> None:
    started = anyio.current_time()
    try:
        t.reward = float(await _maybe_await(env.reward(t.answer)))
    except Exception as exc:
        bugs.report(f"reward of env {type(env).__name__}", exc)
        t.fail("reward_error", _describe(exc))
    t.timings.reward_s = anyio.current_time() - started


async def _close(env: Env, bugs: EnvBugs) -> None:
    if type(env).close is Env.close:
        return  # nothing to release: skip the timeout scope on the hot path
    try:
        with anyio.fail_after(30):
            await env.close()
    except Exception as exc:  # a failing close must not turn a finished trajectory into a lost one
        bugs.report(f"close of env {type(env).__name__}", exc)


async def _finish(env: Env, t: _Trajectory, engine: Engine, started: float) -> TrajectoryRecord:
    """Release the env, let the scheduler forget the trajectory, hand out its record."""
    await _close(env, engine.env_bugs)
    failed = t.status == "failed"
    engine.scheduler.on_finish(t.key, t.prompt_key, output_tokens=t.output_tokens, failed=failed)
    t.timings.total_s = anyio.current_time() - started
    record = t.record()
    if engine.on_record is not None:
        engine.on_record(record)
    return record


async def _maybe_await(value: Awaitable[T] | T) -> T:
    """Env hooks may be plain or ``async``; this takes either."""
    if inspect.isawaitable(value):
        return await value
    return value


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


# ----------------------------------------------------------------- trajectory state


class _Trajectory:
    """Everything recorded about one trajectory while it runs."""

    def __init__(self, job: TrajectoryJob, sampling: SamplingConfig) -> None:
        self.job = job
        # The scheduler's keys, rendered once (see ``RouteRequest``).
        self.key = str(job.id)
        self.prompt_key = str(job.task.id)
        self.sampling = sampling
        self.weight_version: int | None = None  # of the endpoint of its first call
        self.messages: list[openai.Message] = []
        self.tools: list[dict[str, Any]] = []  # sent with requests; [] once in the prompt
        self.parser: ToolCallParser = HermesToolCallParser()
        self.stop_strings: list[str] | None = None
        self.pending: list[openai.Message] = []  # messages not yet in ``tokens``
        self.tokens = TokenLog()
        self.tool_returns: list[ToolReturnRecord] = []
        self.endpoints: list[str] = []
        self.last_endpoint: Endpoint | None = None
        self.weights_changed_turns = 0  # turns whose endpoint loaded new weights mid-call
        self.timings = Timings()
        self.turns = 0
        self.output_tokens = 0  # generated by the model, counted even where ids are not kept
        self.status: Status = "failed"
        self.stop_reason = "unfinished"
        self.error: str | None = None
        self.reward: float | None = None

    def start(self, env: Env, prompt: str | list[openai.Message]) -> None:
        self.tools = env.tool_schemas()
        self.parser = env.tool_call_parser
        self.stop_strings = list(env.stop_strings) or None
        messages = (
            [openai.Message(role="user", content=prompt)] if isinstance(prompt, str) else prompt
        )
        if env.system_prompt and not any(m.role == "system" for m in messages):
            messages = [openai.Message(role="system", content=env.system_prompt), *messages]
        self.messages = _valid(messages)
        env.messages = self.messages

    def describe_tools_in_system_message(self) -> None:
        """For servers whose chat template drops ``tools`` (SmolLM2's does): teach the
        model the tools and the call format in the system message instead."""
        guide = self.parser.describe(self.tools)
        self.tools = []
        first = self.messages[0] if self.messages else None
        if first is not None and first.role == "system":
            self.messages[0] = openai.Message(role="system", content=f"{first.content}\n\n{guide}")
        else:
            self.messages.insert(0, openai.Message(role="system", content=guide))

    @property
    def answer(self) -> str:
        replies = [m for m in self.messages if m.role == "assistant"]
        return (replies[-1].content or "") if replies else ""

    def add_model_turn(self, turn: _Turn) -> None:
        """The turn's reply, and its sampled tokens piece by piece (each with the weight
        version of the endpoint that sampled it)."""
        generation = turn.generation
        self.turns += 1
        self.output_tokens += generation.completion_tokens
        self.endpoints.append(turn.pieces[-1].endpoint.name)
        self.messages.append(
            openai.Message(
                role="assistant", content=generation.text, tool_calls=generation.tool_calls
            )
        )
        for piece in turn.pieces:
            if self.tokens.source != "exact":
                return
            if piece.generation.token_ids is None:
                self.tokens.source = "none"
                return
            if piece.generation.token_ids:  # an abort can come before the first token
                ids, logprobs = piece.generation.token_ids, piece.generation.logprobs
                self.tokens.add_sampled(ids, logprobs, piece.weight_version)

    def add_messages(self, messages: list[openai.Message]) -> None:
        messages = _valid(messages)
        self.messages += messages
        self.pending += messages

    def add_tool_return(self, result: ToolReturn) -> None:
        self.timings.tool_s += result.latency_s
        self.tool_returns.append(
            ToolReturnRecord(
                tool=result.tool,
                status=result.status,
                size_class=result.size_class,
                chars=len(result.content),
                latency_s=round(result.latency_s, 6),
                exception=result.exception,
            )
        )
        message = openai.Message(
            role="tool", content=result.content, tool_call_id=result.call_id, name=result.tool
        )
        self.add_messages([message])

    def fail(self, reason: str, error: str) -> None:
        self.status, self.stop_reason, self.error = "failed", reason, error

    def prompt_too_long(self, why: str) -> None:
        """The task's prompt alone fills the context: the env's doing, not the model's
        (which sampled nothing), so the trajectory fails unscored."""
        self.fail("prompt_too_long", f"the prompt does not fit the context: {why}")

    def record(self) -> TrajectoryRecord:
        exact = self.tokens.source != "none"
        job, sampling = self.job, self.sampling
        return TrajectoryRecord(
            id=self.key,
            env=job.task.id.env,
            task_id=self.prompt_key,
            group_id=str(job.group_id),
            step=job.step,
            sample=job.sample,
            status=self.status,
            stop_reason=self.stop_reason,
            reward=self.reward,
            turns=self.turns,
            messages=self.messages,
            token_ids=self.tokens.ids if exact else [],
            loss_mask=self.tokens.mask if exact else [],
            logprobs=self.tokens.logprobs if exact else [],
            tokens=self.tokens.source,
            weight_versions=self.tokens.spans if exact else [],
            tool_returns=self.tool_returns,
            endpoints=self.endpoints,
            sampling=SamplingRecord(
                sampling.temperature, sampling.top_p, sampling.max_tokens_per_turn, sampling.seed
            ),
            weight_version=self.weight_version,
            timings=self.timings,
            error=self.error,
            weights_changed_turns=self.weights_changed_turns,
        )


def _valid(messages: list[openai.Message]) -> list[openai.Message]:
    """The messages, their text valid UTF-8 (env code may hand over undecodable bytes,
    which neither a request nor the record could carry)."""
    return [
        m
        if m.content is None or (text := valid_utf8(m.content)) is m.content
        else msgspec.structs.replace(m, content=text)
        for m in messages
    ]
