"""The life of one trajectory, top to bottom.

``run_trajectory`` is one coroutine: reset the env, then alternate generation calls
(routed by the scheduler) with tool calls (run by the env, maybe in a sandbox), feeding
every tool return to the scheduler, until the model stops, the env ends the episode or
a limit is hit; then score the answer. A generation that a paused or drained server
aborts does not end its turn: the turn goes on where it stopped (``_turn.py`` holds
the mechanics of one model turn, ``_trajectory_state.py`` what is recorded on the way).
Whatever happens (a tool that raises or hangs, garbage from the model, a dead server,
cancellation), the trajectory ends in exactly one record: returned, or, when cancelled,
handed to ``on_cancelled`` (a cancelled coroutine cannot return). ``Engine.on_record``
sees every record too.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from typing import TypeVar

import anyio
import pydantic

from libra import openai
from libra._clock import now
from libra.engine._client import Generation, GenerationError, RequestRejected
from libra.engine._engine import Engine
from libra.engine._job import TrajectoryJob
from libra.engine._records import (
    Status,
    TrajectoryRecord,
)
from libra.engine._tool_threads import ToolThreads
from libra.engine._trajectory_state import TrajectoryState
from libra.engine._turn import (
    ContextFull,
    generate_turn,
)
from libra.envs import (
    Env,
    EnvBugs,
    SandboxError,
    Task,
    ToolCall,
    ToolError,
    ToolResult,
    ToolReturn,
    ToolTimeout,
    cut_middle,
    from_openai,
    valid_utf8,
)
from libra.signals import ToolStatus, signal_of

T = TypeVar("T")


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
    if job.env_cls is None:
        raise TypeError(f"trajectory {job.id} has no env to run (an agent's job?)")
    t = TrajectoryState(job, job.sampling or engine.config.sampling)
    env = job.env_cls()
    started = now()
    if engine.published is not None:
        engine.published.started(t.key, t.env_name, job.step, t.prompt_key)
    try:
        # A bare scope, not ``fail_after``: its deadline is what the wall-clock limit needs.
        with anyio.CancelScope(deadline=started + engine.config.max_wall_s) as wall:
            async with _sandbox(env, engine):
                await _episode(env, t, engine)
        if wall.cancelled_caught:
            t.out_of_time(engine.config.max_wall_s)
    except _End as end:
        t.status, t.stop_reason = end.status, end.reason
        if end.reason == "max_context_tokens" and t.turns == 0:
            t.prompt_too_long(
                f"{len(t.tokens)} tokens; max_context_tokens is {engine.config.max_context_tokens}"
            )
    except TimeoutError:
        t.out_of_time(engine.config.max_wall_s)
    except ContextFull:
        if t.turns == 0:
            t.prompt_too_long(
                f"{len(t.tokens)} tokens; max_context_tokens is {engine.config.max_context_tokens}"
            )
        else:
            t.status, t.stop_reason = "truncated", "max_context_tokens"
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


async def _episode(env: Env, t: TrajectoryState, engine: Engine) -> None:
    prompt: str | list[openai.Message] = await _maybe_await(env.reset_with(t.job.task))
    t.start(env, prompt)
    max_turns = engine.config.max_turns or env.max_turns
    while True:
        if t.turns >= max_turns:
            raise _End("truncated", "max_turns")
        turn = await generate_turn(t, engine, t.trouble)
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
            result = await _run_tool(env, call, timeout_s, engine)
            t.add_tool_return(result)
            if engine.published is not None:
                engine.published.tool(t.key, t.tool_returns[-1])
            engine.scheduler.on_tool_return(t.key, env.signal(result))
        if env.done:
            raise _End("completed", "env_done")


# ---------------------------------------------------------------------------- tools


def _tool_calls(env: Env, generation: Generation) -> list[ToolCall]:
    if generation.tool_calls:
        return from_openai(generation.tool_calls)
    return env.tool_call_parser.parse(generation.text)


async def _run_tool(env: Env, call: ToolCall, timeout_s: float, engine: Engine) -> ToolReturn:
    """Run one call and reduce what came of it, once, to what is recorded and signalled.
    A tool that raised other than ``ToolError`` has a bug: the model reads the error, the
    record names the exception, its author sees the traceback (once)."""
    stopwatch = _Stopwatch()
    exception: str | None = None
    try:
        outcome = await _outcome(env, call, timeout_s, engine.tool_threads, stopwatch)
    except _ToolBug as bug:
        engine.env_bugs.report(f"tool {call.name} of env {type(env).__name__}", bug.error)
        outcome, exception = ToolResult.failure(_describe(bug.error)), type(bug.error).__name__
    latency = stopwatch.elapsed()
    reported: ToolStatus | None
    if isinstance(outcome, ToolResult):
        content, reported = outcome.content, outcome.status
    else:
        content, reported = outcome, None  # plain text: its status is read back from it
    content = cut_middle(valid_utf8(content), env.max_tool_output_chars)
    signal = signal_of(call.name or "?", content, reported)
    return ToolReturn(call.id, signal.tool, content, signal.status, latency, exception)


class _Stopwatch:
    """A tool call's own time: from the call, or from when a blocking tool got its thread
    (waiting for one is the engine's time, not the tool's)."""

    def __init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self.started = now()

    def elapsed(self) -> float:
        return now() - self.started


class _ToolBug(Exception):
    """A tool raised ``error``, which is not a ``ToolError``."""

    def __init__(self, error: Exception) -> None:
        self.error = error


async def _outcome(
    env: Env, call: ToolCall, timeout_s: float, threads: ToolThreads, stopwatch: _Stopwatch
) -> ToolResult | str:
    """What the call produced: a result whose status is known, or plain text. Every
    failure becomes an error message the model can read. An ``async`` tool's timeout
    runs from the call; a blocking tool's starts once it has a thread (waiting for one
    is not its time)."""
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
        if spec.is_async:
            with anyio.CancelScope(deadline=stopwatch.started + timeout_s) as scope:
                output = await method(**arguments)
            if scope.cancelled_caught:
                raise TimeoutError
        else:  # a thread, so a blocking tool cannot stall the event loop
            output = await threads.run(
                partial(method, **arguments), timeout_s, on_place=stopwatch.restart
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


async def _score(env: Env, t: TrajectoryState, bugs: EnvBugs) -> None:
    started = now()
    try:
        t.reward = float(await _maybe_await(env.reward(t.answer)))
    except Exception as exc:
        bugs.report(f"reward of env {type(env).__name__}", exc)
        t.fail("reward_error", _describe(exc))
    t.timings.reward_s = now() - started


async def score_reply(
    engine: Engine, env_cls: type[Env], task: Task, reply: str
) -> tuple[float | None, str | None]:
    """``env_cls``'s reward for ``reply`` to ``task`` (an agent's episode, which no env
    played), with a trajectory's lifecycle: reset on the task in its sandbox, the reward,
    then closed. On a failure, None and why (the traceback reported once per type)."""
    env = env_cls()
    try:
        async with _sandbox(env, engine):
            await _maybe_await(env.reset_with(task))
        return float(await _maybe_await(env.reward(reply))), None
    except Exception as exc:
        engine.env_bugs.report(f"reward of env {env_cls.__name__}", exc)
        return None, _describe(exc)
    finally:
        await _close(env, engine.env_bugs)


async def _close(env: Env, bugs: EnvBugs) -> None:
    if type(env).close is Env.close:
        return  # nothing to release: skip the timeout scope on the hot path
    try:
        with anyio.fail_after(30):
            await env.close()
    except Exception as exc:  # a failing close must not turn a finished trajectory into a lost one
        bugs.report(f"close of env {type(env).__name__}", exc)


async def _finish(env: Env, t: TrajectoryState, engine: Engine, started: float) -> TrajectoryRecord:
    """Release the env, let the scheduler forget the trajectory, hand out its record."""
    await _close(env, engine.env_bugs)
    failed = t.status == "failed"
    engine.scheduler.on_finish(t.key, t.prompt_key, output_tokens=t.output_tokens, failed=failed)
    t.timings.total_s = now() - started
    record = t.record()
    if engine.published is not None:
        engine.published.ended(record)
    if engine.on_record is not None:
        engine.on_record(record)
    return record


async def _maybe_await(value: Awaitable[T] | T) -> T:
    """Env hooks may be plain or ``async``; this takes either."""
    if type(value) in _PLAIN:  # what plain hooks return: no need to ask inspect
        return value  # type: ignore[return-value]
    if inspect.isawaitable(value):
        return await value
    return value


_PLAIN = frozenset({str, float, int, bool, list, type(None)})


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"
