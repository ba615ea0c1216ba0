"""What the scheduling benchmark added to the emulator: decode runs planned ahead (same
times as stepping token by token), prefix caching, busy time and occupancy."""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest
from trio.testing import MockClock

from libra.emulation import (
    BatchingEngine,
    EmulatorConfig,
    LatencyModel,
    PrefixCache,
    ScriptedReplies,
    create_app,
)

pytestmark = pytest.mark.anyio

GROWING = LatencyModel(
    prefill_s_per_token=0.0,
    step_base_s=0.01,
    step_per_seq_s=0.002,
    step_per_ctx_token_s=1e-5,
    max_num_seqs=8,
    kv_capacity_tokens=100_000,
)


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return "trio", {"clock": MockClock(autojump_threshold=0)}


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


async def test_prefix_caching_skips_the_prefill_of_what_was_seen_before() -> None:
    latency = GROWING.model_copy(update={"prefill_s_per_token": 0.001})
    prompt = [{"role": "user", "content": "x" * 3000}]
    times = {}
    for caching in (False, True):
        config = EmulatorConfig(latency=latency, prefix_caching=caching, prefix_block_tokens=16)
        app = create_app(config, ScriptedReplies(["ok"]))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://e") as client:
            body = {"model": "libra-emulated", "messages": prompt, "max_tokens": 4}
            await client.post("/v1/chat/completions", json=body)
            started = anyio.current_time()
            await client.post("/v1/chat/completions", json=body)
            times[caching] = anyio.current_time() - started
            metrics = (await client.get("/metrics")).text
    assert times[False] > 3.0 > times[True]  # ~3,000 prompt tokens at 1 ms each, or none
    assert "vllm:prefix_cache_hits_total" in metrics


def test_the_prefix_cache_matches_whole_leading_blocks_and_evicts_old_ones() -> None:
    cache = PrefixCache(capacity_tokens=8 * 4, block_tokens=4)
    cache.insert(list(range(12)))
    assert cache.match([*list(range(12)), 99]) == 12
    assert cache.match(list(range(12))) == 8  # at least one token is always computed
    assert cache.match([0, 1, 2, 3, 9, 9, 9, 9, 10]) == 4
    cache.insert(list(range(100, 124)))  # 6 more: 9 blocks, the least recently used goes
    assert cache.match([*list(range(12)), 7]) == 8  # its third block, not used since
    cache.insert(list(range(200, 232)))  # 8 more: nothing of the first prompt is left
    assert cache.match([*list(range(12)), 7]) == 0
    assert cache.hits > 0 and cache.queries > cache.hits


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
