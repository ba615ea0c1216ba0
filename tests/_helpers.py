"""Test helpers: an engine wired to the in-process emulated server, record checks, and
checks that every sandbox must pass."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, Literal, NoReturn

import httpx
import pytest

from libra.emulation import (
    ByteTokenizer,
    EmulatorConfig,
    LatencyModel,
    ScriptedReplies,
    create_app,
    render_chat_text,
)
from libra.engine import Engine, EngineConfig, TrajectoryRecord, http_transport
from libra.envs import Sandbox
from libra.fleet import Endpoint, FleetSpec, InstanceSpec
from libra.sched import Router, Scheduler
from libra.sched.policies import LeastLoadedScheduler, RoundRobin, Track

MODEL = "libra-emulated"
EMULATED_URL = "http://emulated"
tokenizer = ByteTokenizer()


@asynccontextmanager
async def emulated_engine(
    replies: Sequence[str] | None = None,
    *,
    api: Literal["auto", "tokens", "chat"] = "auto",
    config: EngineConfig | None = None,
    scheduler: Scheduler | None = None,
    **emulator: Any,
) -> AsyncIterator[tuple[Engine, list[TrajectoryRecord]]]:
    """An engine whose one endpoint is the emulator, in-process, with zero latency
    (``scheduler``, if given, routes over ``EMULATED_URL``)."""
    emulator.setdefault("latency", LatencyModel.zero())
    app = create_app(EmulatorConfig(**emulator), ScriptedReplies(replies) if replies else None)
    records: list[TrajectoryRecord] = []
    async with http_transport(httpx.ASGITransport(app=app)) as http:
        endpoint = Endpoint(EMULATED_URL, model=MODEL, api=api)
        engine = Engine(
            http,
            scheduler or LeastLoadedScheduler([endpoint]),
            config=config or EngineConfig(),
            on_record=records.append,
        )
        yield engine, records


class PathRecorder(RoundRobin):
    """A real policy over the emulated endpoint that keeps, for each trajectory it saw
    finish, its path of tool-return states: what the scheduler was told."""

    def __init__(self) -> None:
        instance = InstanceSpec(name="emulated", url=EMULATED_URL, model=MODEL)
        super().__init__(Router(FleetSpec(instances=[instance])))
        self.paths: dict[str, list[str]] = {}

    def learn(self, track: Track, output_tokens: int) -> None:
        self.paths[track.trajectory_id] = list(track.path)


def assert_tokens_consistent(record: TrajectoryRecord, tools: list[dict[str, Any]]) -> None:
    """Aligned lists, a logprob for every sampled token, and ids that decode to the chat."""
    assert len(record.token_ids) == len(record.loss_mask) == len(record.logprobs)
    for mask, logprob in zip(record.loss_mask, record.logprobs, strict=True):
        assert (logprob is not None) == (mask == 1)
    if record.tokens != "exact" or not record.token_ids:
        return
    # The ids are the conversation as the template renders it, up to at least the end of
    # the last model turn (messages after it are rendered only when another turn follows).
    decoded = tokenizer.decode(record.token_ids)
    everything = render_chat_text(record.messages, tools, add_generation_prompt=True)
    assert everything.startswith(decoded)
    last = max(i for i, m in enumerate(record.messages) if m.role == "assistant")
    through_last_turn = render_chat_text(record.messages[: last + 1], tools)
    assert len(decoded) >= len(through_last_turn.removesuffix("<|im_end|>\n"))


def sampled_spans(record: TrajectoryRecord) -> list[list[int]]:
    return [record.token_ids[span.start : span.end] for span in record.weight_versions]


def unavailable(reason: str) -> NoReturn:
    """Skip a test whose real dependency (Docker, vLLM...) is missing; in CI, fail it:
    CI installs and starts everything, so a missing part there is a broken set-up."""
    if os.environ.get("CI"):
        pytest.fail(f"required in CI: {reason}")
    pytest.skip(reason)


async def assert_hidden_file_is_unreadable(box: Sandbox) -> None:
    """A 0600 file the env writes (as root) is neither readable nor removable by the
    sandboxed user, yet the env still reads it: how hidden unit tests stay hidden."""
    await box.write_file("tests/test_hidden.py", b"assert solve() == 42\n", mode=0o600)
    script = "cat tests/test_hidden.py; rm -f tests/test_hidden.py; mv tests/test_hidden.py x"
    attempt = await box.exec(["sh", "-c", script], timeout_s=10)
    assert "assert" not in attempt.stdout
    refusals = attempt.stderr.count("Permission denied")
    refusals += attempt.stderr.count("Operation not permitted")
    assert refusals == 3
    assert await box.read_file("tests/test_hidden.py") == b"assert solve() == 42\n"


# Every process a command can see, one "user cmdline" line each.
LIST_PROCESSES = [
    "sh",
    "-c",
    "for p in /proc/[0-9]*; do echo $(stat -c %U $p) $(cat $p/cmdline | tr '\\0' ' '); done",
]


async def assert_exec_round_trip(box: Sandbox) -> None:
    """stdin, env, stdout, stderr and the exit code make the round trip; commands run as uid
    65534 in the work dir on host "sandbox"; files go both ways, relative to the work dir."""
    result = await box.exec(
        [
            "python3",
            "-c",
            "import json, os, sys; print(json.dumps([sys.stdin.read(), os.environ['X']]))",
        ],
        timeout_s=10,
        stdin=b"from stdin",
        env={"X": "from env"},
    )
    assert result.ok, result
    assert result.stdout == '["from stdin", "from env"]\n'
    who = await box.exec(["sh", "-c", "id -u; pwd; hostname"], timeout_s=10)
    assert who.stdout.split() == ["65534", "/work", "sandbox"]
    await box.write_file("pkg/data.txt", b"payload", mode=0o666)
    assert await box.read_file("/work/pkg/data.txt") == b"payload"
    edited = await box.exec(
        ["sh", "-c", "echo more >> pkg/data.txt && echo new > pkg/new.txt && cat pkg/data.txt"],
        timeout_s=10,
    )
    assert edited.ok, edited
    assert edited.stdout == "payloadmore\n"
    assert await box.read_file("/work/pkg/data.txt") == b"payloadmore\n"
    assert await box.read_file("pkg/new.txt") == b"new\n"
    failed = await box.exec(["sh", "-c", "echo oops >&2; exit 3"], timeout_s=10)
    assert (failed.exit_code, failed.stderr, failed.ok) == (3, "oops\n", False)
    with pytest.raises(FileNotFoundError):
        await box.read_file("missing.txt")


def processes_of(uid: int) -> list[int]:
    """The pids of the host's processes owned by ``uid``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    pids.append(int(entry.name))
            except FileNotFoundError:
                continue
    return pids
