"""The latency model and continuous-batching engine, in virtual time (trio's MockClock)."""

from __future__ import annotations

import random
from typing import Any

import anyio
import httpx
import msgspec
import pytest
from trio.testing import MockClock

from libra.emulation import (
    BatchingEngine,
    EmulatorConfig,
    LatencyModel,
    ScriptedReplies,
    create_app,
    render_chat,
)
from libra.openai import ChatCompletion
from tests._helpers import GROWING

pytestmark = pytest.mark.anyio

LATENCY = LatencyModel(
    prefill_s_per_token=0.001,
    step_base_s=0.01,
    step_per_seq_s=0.001,
    step_per_ctx_token_s=1e-5,
    max_num_seqs=8,
    kv_capacity_tokens=100_000,
)
# Steps of exactly 0.01 s whatever the batch, so times are easy to state.
CONSTANT = LatencyModel(
    prefill_s_per_token=0.001,
    step_base_s=0.01,
    step_per_seq_s=0.0,
    step_per_ctx_token_s=0.0,
    max_num_seqs=8,
    kv_capacity_tokens=100_000,
)


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    """Trio with a clock that jumps whenever every task sleeps: virtual time."""
    return "trio", {"clock": MockClock(autojump_threshold=0)}


def decode_time(latency: LatencyModel, prompt: int, tokens: int, batch: int = 1) -> float:
    """Seconds for ``batch`` identical sequences to decode ``tokens`` tokens together."""
    return sum(latency.step_time(batch, batch * (prompt + k)) for k in range(tokens))


class Finishes:
    """Runs requests concurrently and records when (and in which order) each ends."""

    def __init__(self, engine: BatchingEngine) -> None:
        self.engine = engine
        self.start = anyio.current_time()
        self.at: dict[str, float] = {}

    async def run(self, name: str, prompt: int, tokens: int, priority: int = 0) -> None:
        await self.engine.generate(prompt, tokens, priority=priority)
        self.at[name] = anyio.current_time() - self.start

    @property
    def order(self) -> list[str]:
        return sorted(self.at, key=self.at.__getitem__)


def test_latency_model_defaults_are_documented_and_zero_is_zero() -> None:
    default = LatencyModel()
    assert 0.002 < default.step_time(1, 1000) < 0.02  # a small model: ~100-400 tokens/s alone
    assert default.kv_capacity_tokens > 100_000 and default.max_num_seqs == 256
    for name, field in LatencyModel.model_fields.items():
        assert field.description, name
    assert LatencyModel.zero().is_zero and not default.is_zero


async def test_one_request_takes_prefill_plus_its_steps() -> None:
    engine = BatchingEngine(LATENCY)
    start = anyio.current_time()
    await engine.generate(50, 100)
    elapsed = anyio.current_time() - start
    assert elapsed == pytest.approx(50 * 0.001 + decode_time(LATENCY, 50, 100))
    assert (engine.num_running, engine.num_waiting, engine.kv_used_tokens) == (0, 0, 0)


async def test_concurrent_requests_share_decode_steps() -> None:
    engine = BatchingEngine(LATENCY)
    finishes = Finishes(engine)
    async with anyio.create_task_group() as group:
        group.start_soon(finishes.run, "a", 50, 100)
        group.start_soon(finishes.run, "b", 50, 100)
    together = 50 * 0.001 + decode_time(LATENCY, 50, 100, batch=2)
    assert finishes.at == pytest.approx({"a": together, "b": together})
    alone = 50 * 0.001 + decode_time(LATENCY, 50, 100)
    assert together < 1.2 * alone  # batching: two for little more than the price of one


async def test_kv_capacity_makes_a_request_wait() -> None:
    latency = LATENCY.model_copy(update={"kv_capacity_tokens": 300})
    engine = BatchingEngine(latency)
    finishes = Finishes(engine)
    async with anyio.create_task_group() as group:
        for name in "abc":
            group.start_soon(finishes.run, name, 50, 100)  # each needs 150 of 300 tokens
        await anyio.sleep(0.2)
        assert (engine.num_running, engine.num_waiting) == (2, 1)
        assert 0 < engine.kv_usage <= 1
        assert engine.kv_used_tokens > 2 * 50  # prompts plus the tokens produced so far
    first = 50 * 0.001 + decode_time(latency, 50, 100, batch=2)
    then = first + 50 * 0.001 + decode_time(latency, 50, 100)
    assert sorted(finishes.at.values()) == pytest.approx([first, first, then])


async def test_waiting_queue_is_served_by_priority_then_arrival() -> None:
    latency = LATENCY.model_copy(update={"kv_capacity_tokens": 150})  # one request at a time
    engine = BatchingEngine(latency)
    finishes = Finishes(engine)
    async with anyio.create_task_group() as group:
        for name, priority in (("first", 9), ("low", 5), ("high", 1), ("mid", 3), ("high2", 1)):
            group.start_soon(finishes.run, name, 50, 100, priority)
            await anyio.sleep(0.001)  # arrive in this order
        await anyio.sleep(0.01)
        assert (engine.num_running, engine.num_waiting) == (1, 4)
    assert finishes.order == ["first", "high", "high2", "mid", "low"]


async def test_max_num_seqs_bounds_the_batch() -> None:
    latency = LATENCY.model_copy(update={"max_num_seqs": 2})
    engine = BatchingEngine(latency)
    finishes = Finishes(engine)
    async with anyio.create_task_group() as group:
        for name in "abcd":
            group.start_soon(finishes.run, name, 10, 20)
        await anyio.sleep(0.05)
        assert (engine.num_running, engine.num_waiting) == (2, 2)
    pair = 10 * 0.001 + decode_time(latency, 10, 20, batch=2)
    assert sorted(finishes.at.values()) == pytest.approx([pair, pair, 2 * pair, 2 * pair])


async def test_a_late_request_joins_at_the_next_step_after_its_prefill() -> None:
    engine = BatchingEngine(CONSTANT)
    finishes = Finishes(engine)
    async with anyio.create_task_group() as group:
        group.start_soon(finishes.run, "long", 0, 100)  # steps start at 0, 0.01, 0.02, ...
        await anyio.sleep(0.105)
        group.start_soon(finishes.run, "late", 20, 10)  # prefill ends at 0.125
    assert finishes.at["late"] == pytest.approx(0.13 + 10 * 0.01)
    assert finishes.at["long"] == pytest.approx(100 * 0.01)


async def test_a_short_prefill_does_not_wait_for_a_long_one() -> None:
    engine = BatchingEngine(LATENCY)
    finishes = Finishes(engine)
    async with anyio.create_task_group() as group:
        group.start_soon(finishes.run, "long_prompt", 1000, 5)  # prefill until 1.0
        await anyio.sleep(0.1)
        group.start_soon(finishes.run, "short_prompt", 10, 5)  # prefill until 0.11
    assert finishes.at["short_prompt"] == pytest.approx(0.11 + decode_time(LATENCY, 10, 5))


async def test_cancelling_the_driving_request_hands_the_loop_over() -> None:
    engine = BatchingEngine(CONSTANT)  # a step every 0.01 s from t = 0, no prefill
    finishes = Finishes(engine)
    driver_scope = anyio.CancelScope()

    async def drive() -> None:
        with driver_scope:
            await engine.generate(0, 1000)  # first in: this request drives the loop

    async with anyio.create_task_group() as group:
        group.start_soon(drive)
        await anyio.sleep(0.001)
        group.start_soon(finishes.run, "other", 0, 50)  # joins the step at 0.01
        await anyio.sleep(0.1)
        driver_scope.cancel()  # mid-step: "other" takes over and finishes that very step
    assert finishes.at["other"] == pytest.approx(0.01 + 50 * 0.01)
    assert (engine.num_running, engine.num_waiting, engine.kv_used_tokens) == (0, 0, 0)


async def test_cancelling_a_riding_request_leaves_the_others_on_time() -> None:
    engine = BatchingEngine(CONSTANT)
    finishes = Finishes(engine)
    async with anyio.create_task_group() as group:
        group.start_soon(finishes.run, "driver", 0, 30)
        await anyio.sleep(0.001)
        with anyio.move_on_after(0.1):
            await engine.generate(0, 200)
        assert engine.num_running == 1
    assert finishes.at["driver"] == pytest.approx(30 * 0.01)
    assert (engine.num_running, engine.kv_used_tokens) == (0, 0)


async def test_cancelling_a_waiting_request_frees_its_place() -> None:
    latency = LATENCY.model_copy(update={"kv_capacity_tokens": 150})
    engine = BatchingEngine(latency)
    finishes = Finishes(engine)
    async with anyio.create_task_group() as group:
        group.start_soon(finishes.run, "running", 50, 100)
        await anyio.sleep(0.001)
        with anyio.move_on_after(0.1):
            await engine.generate(50, 100)  # waits behind "running", then gives up
        assert engine.num_waiting == 0
        group.start_soon(finishes.run, "next", 50, 100)
    assert finishes.order == ["running", "next"]
    assert engine.kv_used_tokens == 0


async def test_many_requests_of_mixed_sizes_all_finish_and_leave_nothing_behind() -> None:
    latency = LATENCY.model_copy(update={"max_num_seqs": 16, "kv_capacity_tokens": 20_000})
    engine = BatchingEngine(latency)
    finishes = Finishes(engine)
    rng = random.Random(0)
    async with anyio.create_task_group() as group:
        for index in range(300):
            prompt, tokens = rng.randint(1, 2000), int(rng.paretovariate(1.2) * 20)
            group.start_soon(finishes.run, str(index), prompt, tokens, rng.randint(0, 3))
            await anyio.sleep(rng.expovariate(50.0))
    assert len(finishes.at) == 300
    assert (engine.num_running, engine.num_waiting, engine.kv_used_tokens) == (0, 0, 0)


async def test_on_demand_allocation_admits_by_context_and_preempts_the_lowest_priority() -> None:
    # vLLM's allocation: both fit at first (their prompts), then outgrow the cache
    # together; the lower-priority one is preempted, and recomputes its context later.
    latency = CONSTANT.model_copy(update={"kv_capacity_tokens": 300, "kv_allocation": "on_demand"})
    for low_priority, preempted in ((5, "low"), (1, "late")):
        engine = BatchingEngine(latency)
        finishes = Finishes(engine)
        async with anyio.create_task_group() as group:
            group.start_soon(finishes.run, "low", 50, 200, low_priority)
            await anyio.sleep(0.001)
            group.start_soon(finishes.run, "late", 50, 200, 1)
            await anyio.sleep(0.1)
            assert (engine.num_running, engine.num_waiting) == (2, 0)
        kept = "late" if preempted == "low" else "low"
        assert finishes.order == [kept, preempted]
        assert engine.num_preemptions == 1
        # Together until 300 tokens are held (100 steps each), then the kept one alone.
        started = 0.001 if kept == "late" else 0.0
        assert finishes.at[kept] == pytest.approx(started + 0.05 + 200 * 0.01, abs=0.011)
        # The preempted one prefills its 150 tokens again, then decodes what is left.
        again = finishes.at[kept] + 150 * 0.001 + 100 * 0.01
        assert finishes.at[preempted] == pytest.approx(again, abs=0.011)
        assert (engine.num_running, engine.num_waiting, engine.kv_used_tokens) == (0, 0, 0)


async def test_reserved_allocation_never_preempts() -> None:
    latency = CONSTANT.model_copy(update={"kv_capacity_tokens": 300})  # the default: reserve
    engine = BatchingEngine(latency)
    finishes = Finishes(engine)
    async with anyio.create_task_group() as group:
        group.start_soon(finishes.run, "low", 50, 200, 5)  # holds 250 of 300 from the start
        await anyio.sleep(0.001)
        group.start_soon(finishes.run, "high", 50, 200, 1)
    assert finishes.order == ["low", "high"] and engine.num_preemptions == 0


async def test_on_demand_allocation_never_outgrows_the_cache() -> None:
    latency = LATENCY.model_copy(
        update={"max_num_seqs": 16, "kv_capacity_tokens": 20_000, "kv_allocation": "on_demand"}
    )
    engine = BatchingEngine(latency)
    overflows: list[int] = []

    def watch(now: float, running: int, waiting: int) -> None:
        if running > 1 and engine.kv_used_tokens > latency.kv_capacity_tokens:
            overflows.append(engine.kv_used_tokens)

    engine.observer = watch
    finishes = Finishes(engine)
    rng = random.Random(0)
    async with anyio.create_task_group() as group:
        for index in range(300):
            prompt, tokens = rng.randint(1, 2000), int(rng.paretovariate(1.2) * 200)
            group.start_soon(finishes.run, str(index), prompt, tokens, rng.randint(0, 3))
            await anyio.sleep(rng.expovariate(50.0))
    assert len(finishes.at) == 300 and overflows == []
    assert engine.num_preemptions > 0
    assert (engine.num_running, engine.num_waiting, engine.kv_used_tokens) == (0, 0, 0)


async def test_oversized_request_runs_alone_instead_of_waiting_forever() -> None:
    engine = BatchingEngine(LATENCY.model_copy(update={"kv_capacity_tokens": 100}))
    await engine.generate(200, 10)
    assert engine.num_running == 0


# ------------------------------------------------------------------------ through the app


async def test_chat_request_through_the_app_takes_virtual_time() -> None:
    app = create_app(EmulatorConfig(latency=LATENCY), ScriptedReplies(["abc"]))
    messages = [{"role": "user", "content": "hi"}]
    prompt = len(render_chat(messages, add_generation_prompt=True))
    body = {"model": "libra-emulated", "messages": messages}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://e") as c:
        start = anyio.current_time()
        async with anyio.create_task_group() as group:

            async def ask() -> None:
                response = await c.post("/v1/chat/completions", json=body)
                assert msgspec.json.decode(response.content, type=ChatCompletion).usage
                group.cancel_scope.cancel()

            group.start_soon(ask)
            await anyio.sleep(prompt * 0.001 + 0.005)  # prefill done, first step under way
            metrics = (await c.get("/metrics")).text
            await anyio.sleep_forever()
        elapsed = anyio.current_time() - start
    assert elapsed == pytest.approx(prompt * 0.001 + decode_time(LATENCY, prompt, 4))
    assert 'vllm:num_requests_running{model_name="libra-emulated"} 1.0' in metrics
    assert 'vllm:num_requests_waiting{model_name="libra-emulated"} 0.0' in metrics


async def test_a_client_that_gives_up_frees_the_engine() -> None:
    app = create_app(EmulatorConfig(latency=LATENCY), ScriptedReplies(["x" * 1000]))
    body = {"model": "libra-emulated", "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://e") as c:
        with anyio.move_on_after(1.0):
            await c.post("/v1/chat/completions", json=body)
        assert app.engine is not None
        assert (app.engine.num_running, app.engine.kv_used_tokens) == (0, 0)
        response = await c.post("/v1/chat/completions", json={**body, "max_tokens": 3})
    assert response.status_code == 200


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_engine_runs_on_asyncio_in_real_time() -> None:
    latency = LATENCY.model_copy(update={"step_base_s": 0.001, "prefill_s_per_token": 0.0})
    engine = BatchingEngine(latency)
    with anyio.fail_after(5):
        async with anyio.create_task_group() as group:
            for tokens in (5, 10, 20):
                group.start_soon(engine.generate, 10, tokens)
    assert engine.num_running == 0


# ------------------------------------------------ decode runs planned ahead, busy time


def stepped(latency: LatencyModel, batch: list[tuple[int, int]]) -> list[float]:
    """Finish times of sequences (prompt, tokens) decoded together, token by token."""
    produced = [0] * len(batch)
    now, finished = 0.0, [0.0] * len(batch)
    while any(p < tokens for p, (_, tokens) in zip(produced, batch, strict=True)):
        live = [i for i, (_, tokens) in enumerate(batch) if produced[i] < tokens]
        context = sum(batch[i][0] + produced[i] for i in live)
        now += latency.step_time(len(live), context)
        for i in live:
            produced[i] += 1
            if produced[i] == batch[i][1]:
                finished[i] = now
    return finished


async def test_a_run_of_steps_ends_exactly_where_token_by_token_steps_would() -> None:
    engine = BatchingEngine(GROWING)
    batch = [(100, 40), (300, 250), (50, 7)]
    finished: dict[int, float] = {}

    async def run(index: int) -> None:
        await engine.generate(*batch[index])
        finished[index] = anyio.current_time()

    async with anyio.create_task_group() as group:
        for index in range(3):
            group.start_soon(run, index)
        await anyio.sleep(0.05)  # mid-run: what has been decoded so far is visible
        produced = engine.kv_used_tokens - sum(prompt for prompt, _ in batch)
        assert 0 < produced < sum(tokens for _, tokens in batch)
    assert [finished[i] for i in range(3)] == pytest.approx(stepped(GROWING, batch))


async def test_busy_time_and_occupancy_are_recorded() -> None:
    changes: list[tuple[float, int, int]] = []
    engine = BatchingEngine(GROWING, observer=lambda *change: changes.append(change))
    await anyio.sleep(1.0)
    await engine.generate(10, 20)
    await anyio.sleep(1.0)
    alone = sum(GROWING.step_time(1, 10 + k) for k in range(20))
    assert engine.busy_s == pytest.approx(alone)
    assert changes[0][1:] == (1, 0) and changes[-1][1:] == (0, 0)
    assert changes[-1][0] == pytest.approx(1.0 + alone)


async def test_prefill_interference_slows_the_decode_steps_it_shares() -> None:
    async def finish_of_a(latency: LatencyModel) -> float:
        engine = BatchingEngine(latency)
        finishes = Finishes(engine)
        async with anyio.create_task_group() as group:
            group.start_soon(finishes.run, "a", 50, 200)
            await anyio.sleep(0.05)  # a mid-decode, then b's long prefill shares its steps
            group.start_soon(finishes.run, "b", 2000, 10)
        return finishes.at["a"]

    plain = await finish_of_a(LATENCY)
    slowed = await finish_of_a(LATENCY.model_copy(update={"prefill_interference": 0.5}))
    assert slowed > plain * 1.05


async def test_jitter_is_seeded() -> None:
    jittery = LATENCY.model_copy(update={"jitter": 0.2})

    async def elapsed(seed: int) -> float:
        engine = BatchingEngine(jittery, seed=seed)
        start = anyio.current_time()
        await engine.generate(50, 100)
        return anyio.current_time() - start

    first, again, other = await elapsed(1), await elapsed(1), await elapsed(2)
    assert first == again and first != other
    assert first != pytest.approx(50 * 0.001 + decode_time(LATENCY, 50, 100))
