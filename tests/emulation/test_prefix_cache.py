"""The emulator's prefix cache: whole leading blocks matched, old ones evicted, and the
prefill it saves."""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest
from trio.testing import MockClock

from libra.emulation import (
    EmulatorConfig,
    PrefixCache,
    ScriptedReplies,
    create_app,
)
from tests._helpers import GROWING

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return "trio", {"clock": MockClock(autojump_threshold=0)}


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


def test_clearing_forgets_every_block_and_keeps_the_counters() -> None:
    cache = PrefixCache(capacity_tokens=64, block_tokens=4)
    cache.insert(list(range(12)))
    assert cache.match([*list(range(12)), 99]) == 12
    hits = cache.hits
    cache.clear()
    assert cache.match([*list(range(12)), 99]) == 0
    assert cache.hits == hits
