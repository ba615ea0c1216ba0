"""The engine's threads for blocking tools: bounded, abandoned ones included, and a
call's timeout starts only once it has a thread."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import anyio
import pytest

from libra.engine import EngineConfig
from libra.engine._tool_threads import ToolThreads
from tests._helpers import emulated_engine

pytestmark = pytest.mark.anyio


def waiting_on(gate: threading.Event, answer: str = "done") -> Callable[[], str]:
    """A blocking tool that returns once ``gate`` is set (never blocks past 10 s)."""

    def tool() -> str:
        gate.wait(10)
        return answer

    return tool


def opened() -> threading.Event:
    gate = threading.Event()
    gate.set()
    return gate


async def until(condition: Callable[[], bool]) -> None:
    with anyio.fail_after(5):
        while not condition():  # noqa: ASYNC110 (counters a thread changes, not an event)
            await anyio.sleep(0.01)


async def hang_past_timeout(threads: ToolThreads, gate: threading.Event) -> None:
    with pytest.raises(TimeoutError):
        await threads.run(waiting_on(gate), timeout_s=0.05)


async def test_waiting_for_a_thread_is_not_the_tool_s_time() -> None:
    threads, first, results = ToolThreads(1), threading.Event(), list[str]()

    async def call(gate: threading.Event, answer: str, timeout_s: float) -> None:
        results.append(await threads.run(waiting_on(gate, answer), timeout_s))

    async with anyio.create_task_group() as tg:
        tg.start_soon(call, first, "first", 5.0)
        await until(lambda: threads.busy == 1)
        tg.start_soon(call, opened(), "second", 0.2)
        await until(lambda: threads.waiting == 1)
        await anyio.sleep(0.4)  # twice the second's timeout, spent waiting for the thread
        assert (threads.busy, threads.waiting, results) == (1, 1, [])
        first.set()
    assert results == ["first", "second"]
    assert (threads.busy, threads.abandoned) == (0, 0)


@pytest.mark.faults
async def test_a_hung_tool_s_thread_keeps_its_place_until_it_returns() -> None:
    threads, gate = ToolThreads(2), threading.Event()
    await hang_past_timeout(threads, gate)
    assert (threads.busy, threads.abandoned) == (1, 1)
    await anyio.sleep(0.1)
    assert (threads.busy, threads.abandoned) == (1, 1)  # still running: still counted
    gate.set()
    await until(lambda: threads.busy == 0)
    assert threads.abandoned == 0


@pytest.mark.faults
async def test_the_bound_holds_with_every_thread_hung(caplog: pytest.LogCaptureFixture) -> None:
    threads, gates, results = ToolThreads(2), [threading.Event(), threading.Event()], list[str]()
    with caplog.at_level(logging.WARNING, logger="libra.engine._engine"):
        for gate in gates:
            await hang_past_timeout(threads, gate)
    assert (threads.busy, threads.abandoned) == (2, 2)

    async def third() -> None:
        results.append(await threads.run(waiting_on(opened(), "third"), timeout_s=0.2))

    async with anyio.create_task_group() as tg:
        tg.start_soon(third)
        await until(lambda: threads.waiting == 1)
        await anyio.sleep(0.4)  # the N+1th call waits, its timeout not yet started
        assert (threads.waiting, results) == (1, [])
        gates[0].set()
    assert results == ["third"]
    gates[1].set()
    await until(lambda: threads.busy == 0)
    warnings = [r for r in caplog.records if "tool threads are held" in r.getMessage()]
    assert len(warnings) == 1  # once, when abandoned threads passed half the bound
    assert "2 of 2 tool threads" in warnings[0].getMessage()


async def test_the_engine_owns_tool_threads_of_the_configured_bound() -> None:
    config = EngineConfig(tool_threads=3)
    async with emulated_engine(["hi"], config=config) as (engine, _):
        assert (engine.tool_threads.bound, engine.tool_threads.busy) == (3, 0)
