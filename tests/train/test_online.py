"""``libra train --online``: a separate process, written against the plain ``openai``
SDK and the documented session protocol, is the agent; the run trains three steps on the
sessions it ends. One that never reports an end is counted, not trained; one that
rewrites its history trains as one sample of two exact pieces. (The trainer is real,
FSDP2 on gloo; the fleet is emulated.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from libra._net import free_port
from libra.launch import TrainRunConfig, train
from tests._helpers import ROOT

pytestmark = pytest.mark.anyio

AGENT = r"""
import sys, time
import httpx, openai

base = sys.argv[1]
client = openai.OpenAI(base_url=base + "/v1", api_key="-", max_retries=0)


def call(key, messages):
    session = client.with_options(default_headers={"X-Libra-Session": key})
    reply = session.chat.completions.create(
        model="my-agent-model", messages=messages, max_tokens=24
    )
    return reply.choices[0].message.content or ""


def end(key, reward=None):
    body = {"session": key, "done": True} | ({} if reward is None else {"reward": reward})
    httpx.post(base + "/v1/libra/report", json=body).raise_for_status()


while True:  # until the run stops serving
    try:
        httpx.get(base + "/health").raise_for_status()
        break
    except httpx.HTTPError:
        time.sleep(0.2)
# One that never reports an end (the TTL ends it), one that rewrites its history.
call("silent", [{"role": "user", "content": "Nobody will hear back from me."}])
said = call("editor", [{"role": "user", "content": "Count to three."}])
call("editor", [{"role": "user", "content": f"You said {said!r}. Count to three, then stop."}])
end("editor", 1.0)
n = 0
try:
    while True:
        for prompt in ("Count to three.", "Name a colour."):
            n += 1
            text = call(f"s{n}", [{"role": "user", "content": prompt}])
            end(f"s{n}", len(text) % 7 / 7)
except (openai.APIConnectionError, httpx.HTTPError):
    print(n)  # the run is over: the sessions it began (the last may never have reached it)
"""


async def test_an_external_openai_client_is_trained_on_through_the_gateway(
    tiny_model: Path, tmp_path: Path
) -> None:
    port = free_port("127.0.0.1")
    data: dict[str, Any] = {
        "rollout": {"server": "emulated", "emulator": {"agent": {"think_tokens": [0, 12]}}},
        "online": {"port": port, "no_auth": True, "session_ttl_s": 1.5, "group_wait_s": 30},
        "model": str(tiny_model),
        "steps": 3,
        "prompts_per_step": 2,
        "samples_per_prompt": 2,
        "run_dir": str(tmp_path / "run"),
        "trainer": {"lr": 1e-3, "cpu_threads": 1, "backend": "gloo"},
        # The client plays faster than the run trains: groups wait, and those sampled on
        # weights more than a version old leave (counted) rather than train.
        "grpo": {"max_staleness": 1},
    }
    config = TrainRunConfig.model_validate(data)
    (tmp_path / "agent.py").write_text(AGENT)
    agent = [sys.executable, str(tmp_path / "agent.py"), f"http://127.0.0.1:{port}"]
    async with await anyio.open_process(agent) as process:
        with anyio.fail_after(600):
            lines = await train(config)
        with anyio.fail_after(30):
            await process.wait()
            assert process.stdout is not None
            began = int((await process.stdout.receive()).decode())

    assert [line.step for line in lines] == [0, 1, 2]
    dropped: dict[str, int] = {}
    for line in lines:
        assert line.groups == 2 and line.trajectories == 4, line
        for reason, count in line.dropped.items():
            dropped[reason] = dropped.get(reason, 0) + count
        records = (config.run_dir / "rollouts" / f"step-{line.step}.jsonl").read_text()
        trained = [json.loads(r) for r in records.splitlines() if '"done"' in r]
        assert {r["tokens"] for r in trained} == {"exact"} and {r["step"] for r in trained} == {
            line.step
        }
    assert sum(line.samples_trained for line in lines) > 0
    # The session that never ended: counted, untrained.
    assert dropped.get("idle_ttl") == 1 and "history_edited" not in dropped, dropped
    # The editor's two contexts: one sample of two exact pieces, in its first prompt's group.
    first = (config.run_dir / "rollouts" / "step-0.jsonl").read_text().splitlines()
    [edited] = [r for r in map(json.loads, first) if r["piece_starts"]]
    assert (edited["tokens"], edited["reward"], len(edited["piece_starts"])) == ("exact", 1.0, 1)
    assert not lines[0].dropped.get("tokens drift")
    # Every session that ended is on disk once: those no step took under step 3.
    logged = [
        json.loads(line)
        for path in (config.run_dir / "rollouts").glob("step-*.jsonl")
        for line in path.read_text().splitlines()
    ]
    assert len({r["id"] for r in logged}) == len(logged)
    assert began - 1 <= len(logged) - 2 <= began  # besides the editor's and the silent one
    third = (config.run_dir / "rollouts" / "step-2.jsonl").read_text().splitlines()
    assert max(json.loads(r)["weight_version"] or 0 for r in third) >= 1


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_agent_framework_s_own_client_trains_through_the_session_protocol(
    tiny_model: Path, tmp_path: Path
) -> None:
    """examples/online_pydantic_ai.py: pydantic-ai's agent loop, its OpenAI model class,
    and nothing of Libra's but the documented protocol."""
    port = free_port("127.0.0.1")
    data: dict[str, Any] = {
        "rollout": {"server": "emulated"},
        "online": {"port": port, "no_auth": True, "group_wait_s": 30},
        "model": str(tiny_model),
        "steps": 2,
        "prompts_per_step": 2,
        "samples_per_prompt": 2,
        "run_dir": str(tmp_path / "run"),
        "trainer": {"lr": 1e-3, "cpu_threads": 1, "backend": "gloo"},
    }
    config = TrainRunConfig.model_validate(data)
    agent = [sys.executable, str(ROOT / "examples" / "online_pydantic_ai.py")]
    async with await anyio.open_process([*agent, f"http://127.0.0.1:{port}"]) as process:
        with anyio.fail_after(600):
            lines = await train(config)
        with anyio.fail_after(60):
            await process.wait()
    assert [(line.step, line.groups, line.trajectories) for line in lines] == [(0, 2, 4), (1, 2, 4)]
    records = (config.run_dir / "rollouts" / "step-1.jsonl").read_text().splitlines()
    played = [json.loads(r) for r in records if '"done"' in r]
    assert len(played) == 4 and {r["tokens"] for r in played} == {"exact"}
    assert all(r["turns"] >= 1 for r in played)
