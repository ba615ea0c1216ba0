"""What several test modules share (no test module imports another): an engine wired to
the in-process emulated server and record checks; requests to the emulator; checks that
every sandbox must pass; a reference fleet and a trajectory driven through a policy;
workload files; real vLLM settings."""

from __future__ import annotations

import importlib.util
import os
import signal
import struct
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, NoReturn

import anyio
import anyio.abc
import httpx
import msgspec
import pytest

from libra.alloc import A100, Layout, PoolConfig
from libra.emulation import (
    AgentScript,
    ByteTokenizer,
    ClusterTruth,
    EmulatedCluster,
    EmulatedTrainer,
    EmulatorConfig,
    LatencyModel,
    Script,
    ScriptedReplies,
    TrainTruth,
    create_app,
    render_chat_text,
)
from libra.engine import (
    Engine,
    EngineConfig,
    SamplingRecord,
    Status,
    Timings,
    TokenSource,
    TrajectoryRecord,
    WeightSpan,
    http_transport,
)
from libra.envs import Env, Sandbox, Task
from libra.events import EventBus
from libra.fleet import BucketSpec, Endpoint, FleetSpec, InstanceSpec, Model
from libra.openai import ChatCompletion, Completion, FunctionCall, Message, ToolCall, tool_schema
from libra.sched import Route, Router, RouteRequest, Scheduler
from libra.sched.policies import LeastLoadedScheduler, RoundRobin, Track
from libra.serving import EMBEDDED_MODEL_NAME, VLLMServerConfig
from libra.signals import ToolSignal

if TYPE_CHECKING:
    from libra.launch import TrainRunConfig

MODEL = "libra-emulated"
EMULATED_URL = "http://emulated"
tokenizer = ByteTokenizer()
DEMO = Path(__file__).parents[1] / "examples" / "rollout.toml"


@asynccontextmanager
async def hung_server() -> AsyncIterator[str]:
    """A server on loopback that lists its model at ``/v1/models`` and then never answers
    anything else (a vLLM whose engine hung): its base URL."""
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    models = msgspec.json.encode({"object": "list", "data": [{"id": MODEL, "object": "model"}]})
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
    listing = head + b"content-length: %d\r\n\r\n" % len(models) + models

    async def serve(stream: anyio.abc.ByteStream) -> None:
        async with stream:
            if (await stream.receive()).startswith(b"GET /v1/models"):
                await stream.send(listing)
                return
            await anyio.sleep_forever()

    async with listener, anyio.create_task_group() as group:
        group.start_soon(listener.serve, serve)
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            group.cancel_scope.cancel()


@asynccontextmanager
async def emulated_engine(
    replies: Sequence[str] | None = None,
    *,
    api: Literal["auto", "tokens", "chat"] = "auto",
    config: EngineConfig | None = None,
    scheduler: Scheduler | None = None,
    events: EventBus | None = None,
    **emulator: Any,
) -> AsyncIterator[tuple[Engine, list[TrajectoryRecord]]]:
    """An engine whose one endpoint is the emulator, in-process, with zero latency
    (``scheduler``, if given, routes over ``EMULATED_URL``), publishing to ``events``."""
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
            events=events,
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


def children_of(pid: int) -> list[int]:
    """The pids of ``pid``'s live children, oldest first (read from ``/proc``)."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except (FileNotFoundError, ProcessLookupError):
                continue
            # "pid (comm) state ppid ...": comm may hold spaces, so split after its ")".
            state, parent = stat.rsplit(")", 1)[1].split()[:2]
            if int(parent) == pid and state != "Z":
                children.append(int(entry.name))
    return sorted(children)


def is_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, ended but not yet reaped, does not)."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def cmdline_of(pid: int) -> str:
    return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()


# --------------------------------------------------------- requests to the in-process emulator

CALCULATOR = tool_schema(
    "calculator",
    "Evaluate an arithmetic expression.",
    {
        "type": "object",
        "properties": {"expression": {"type": "string"}},
        "required": ["expression"],
    },
)
LOOKUP = tool_schema(
    "lookup",
    "Look up a record.",
    {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 1000},
            "scale": {"type": "number"},
            "verbose": {"type": "boolean"},
            "unit": {"type": "string", "enum": ["m", "km"]},
        },
        "required": ["id", "scale", "verbose", "unit"],
    },
)
QUESTION = [{"role": "user", "content": "What is 12 times 7 plus 3?"}]


@asynccontextmanager
async def emulator(
    behaviour: Script | None = None, **config: Any
) -> AsyncIterator[httpx.AsyncClient]:
    """A client of an in-process emulator (zero latency unless given) with ``behaviour``."""
    config.setdefault("latency", LatencyModel.zero())
    app = create_app(EmulatorConfig(**config), behaviour)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://emulated") as client:
        yield client


async def chat(client: httpx.AsyncClient, **body: Any) -> ChatCompletion:
    """A chat completion (of QUESTION unless ``body`` says otherwise) that must succeed."""
    body = {"model": MODEL, "messages": QUESTION, **body}
    response = await client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return msgspec.json.decode(response.content, type=ChatCompletion)


async def complete(client: httpx.AsyncClient, **body: Any) -> Completion:
    """A completion that must succeed."""
    response = await client.post("/v1/completions", json={"model": MODEL, **body})
    assert response.status_code == 200, response.text
    return msgspec.json.decode(response.content, type=Completion)


def conversation() -> list[Message]:
    """A system prompt, non-ASCII text, a tool call and its result, and a next question."""
    call = ToolCall(id="call_1", function=FunctionCall("calculator", '{"expression": "6 * 7"}'))
    return [
        Message(role="system", content="You are careful."),
        Message(role="user", content="What is 6 times 7? Ünïcödé ✓"),
        Message(role="assistant", content="Let me compute.", tool_calls=[call]),
        Message(role="tool", content="42", tool_call_id="call_1", name="calculator"),
        Message(role="assistant", content="The answer is 42."),
        Message(role="user", content="Thanks"),
    ]


# ---------------------------------------------------------------------- the emulator's latency

# Steps that grow with the batch and its context, and no prefill unless asked.
GROWING = LatencyModel(
    prefill_s_per_token=0.0,
    step_base_s=0.01,
    step_per_seq_s=0.002,
    step_per_ctx_token_s=1e-5,
    max_num_seqs=8,
    kv_capacity_tokens=100_000,
)


# ------------------------------------------------------------------------------ workload files

# Written from libra/emulation/workloads/README.md alone: a data-analysis agent that inspects
# tables, then runs a query whose result it checks; a wrong query returns an error.
USER_WORKLOAD = """
name = "data-agent"
description = "inspect tables, run SQL until the answer checks out"
sources = ["made up for a test"]

[rollout]
prompts = 24
samples_per_prompt = 4
history_steps = 1
drift_per_step = 0.05

[limits]
max_turns = 10
max_context_tokens = 16384
tool_timeout_s = 30

[prompt_tokens]
median = 600
sigma = 0.3
max = 2000

[solve_rate]
alpha = 1.0
beta = 1.5
give_up = 0.1

[turn]
tokens = { median = 500, sigma = 0.6, min = 96, max = 3000 }
final_tokens = { median = 200, sigma = 0.4, min = 20 }
growth_after_failure = 1.2

[[explore]]
name = "describe_table"
description = "Show a table's columns and a few rows."
calls_first_attempt = [1, 2]
calls_later_attempts = [0, 1]
latency_s = { median = 0.2, sigma = 0.3 }
output = { status = "success", chars = { median = 1500, sigma = 0.5 } }

[check]
name = "run_sql"
description = "Run a SQL query and return its result."
latency_s = { median = 2.0, sigma = 0.8 }
timeout_probability = 0.02
on_pass = { status = "success", chars = { median = 400, sigma = 0.5 } }
on_fail = { status = "failure", chars = { median = 1200, sigma = 0.4 } }
"""


def write(tmp_path: Path, text: str, name: str = "workload.toml") -> Path:
    """A workload (or fleet) file of ``text`` in ``tmp_path``."""
    path = tmp_path / name
    path.write_text(text)
    return path


TINY = (
    USER_WORKLOAD.replace("prompts = 24", "prompts = 6")
    .replace("samples_per_prompt = 4", "samples_per_prompt = 3")
    .replace("max_turns = 10", "max_turns = 5")
)


# ------------------- the scheduler: a reference fleet and a trajectory driven through a policy


def fleet(**overrides: Any) -> FleetSpec:
    """Two TP1 instances (short), one TP2 (medium), one TP4 (long)."""
    instances = [
        InstanceSpec(name="a1", url="http://a1", tp=1, max_num_seqs=4, kv_capacity_tokens=40_000),
        InstanceSpec(name="a2", url="http://a2", tp=1, max_num_seqs=4, kv_capacity_tokens=40_000),
        InstanceSpec(name="b", url="http://b", tp=2, max_num_seqs=8, kv_capacity_tokens=100_000),
        InstanceSpec(name="c", url="http://c", tp=4, max_num_seqs=8, kv_capacity_tokens=250_000),
    ]
    buckets = [
        BucketSpec(name="long", max_tokens=30_000, instances=["c"]),
        BucketSpec(name="short", max_tokens=4_000, instances=["a1", "a2"]),
        BucketSpec(name="medium", max_tokens=12_000, instances=["b"]),
    ]
    return FleetSpec(instances=instances, buckets=buckets, **overrides)


FAIL = ToolSignal("run_tests", "large", "failure")
PASS = ToolSignal("run_tests", "small", "success")


class Trajectory:
    """Drives one trajectory through a policy as the engine would."""

    def __init__(self, policy: Scheduler, tid: str) -> None:
        self.policy, self.tid, self.prompt = policy, tid, tid.split("#")[0]
        self.turn = self.generated = 0
        self.context = 500
        self.last: Route | None = None

    def call(self, tokens: int, exclude: frozenset[str] = frozenset()) -> Route:
        previous = self.last.endpoint if self.last is not None else None
        request = RouteRequest(
            self.tid, self.prompt, self.turn, self.context, previous, self.generated, env="t"
        )
        route = self.policy.route(request, exclude)
        self.policy.release(route, outcome="ok", new_tokens=tokens)
        self.turn += 1
        self.generated += tokens
        self.context += tokens
        self.last = route
        return route

    def tool(self, signal: ToolSignal) -> None:
        self.policy.on_tool_return(self.tid, signal)
        self.context += 2000

    def finish(self) -> None:
        self.policy.on_finish(self.tid, self.prompt, output_tokens=self.generated)

    def play(self, turns: Sequence[tuple[int, ToolSignal | None]]) -> list[Route]:
        routes = []
        for tokens, tool_signal in turns:
            routes.append(self.call(tokens))
            if tool_signal is not None:
                self.tool(tool_signal)
        self.finish()
        return routes


# ------------------------------------------------------ real vLLM on the embedded model (slow)

REAL_MODEL_NAME = EMBEDDED_MODEL_NAME  # served as `libra vllm` serves it


def require_vllm() -> None:
    # find_spec, not importorskip: importing vllm here would cost seconds and memory, and
    # the server runs in its own process anyway.
    for module in ("vllm", "transformers"):
        if importlib.util.find_spec(module) is None:
            unavailable(f"{module} is not installed (make setup-serving)")


def real_config(**overrides: Any) -> VLLMServerConfig:
    settings: dict[str, Any] = {"startup_timeout_s": 400.0, "max_model_len": 2048}
    return VLLMServerConfig(**(settings | overrides))


def record_of(
    ids: list[int], mask: list[int], logprobs: list[float | None], tokens: str = "exact"
) -> TrajectoryRecord:
    """A finished trajectory holding these tokens, as the rollout engine records it."""
    return TrajectoryRecord(
        id="calc/t@0#0",
        env="calc",
        task_id="calc/t",
        group_id="calc/t@0",
        step=0,
        sample=0,
        status="completed",
        stop_reason="model_stop",
        reward=1.0,
        turns=1,
        messages=[],
        token_ids=ids,
        loss_mask=mask,
        logprobs=logprobs,
        tokens=tokens,  # type: ignore[arg-type]
        weight_versions=[],
        tool_returns=[],
        endpoints=[],
        sampling=SamplingRecord(temperature=1.0, top_p=1.0, max_tokens_per_turn=64, seed=None),
        weight_version=0,
        timings=Timings(),
    )


# ------------------------------------------------------------------ training loop


class Brevity(Env):
    """Rewards short answers, continuously: the samples of a group (almost) never tie,
    so every group carries a policy signal, on the emulator as on a real model."""

    def reset(self, seed: int) -> str:
        return f"Say something short about the number {seed % 100}."

    def reward(self, answer: str) -> float:
        return 1.0 / (1.0 + len(answer) / 100.0)


BREVITY = "tests._helpers:Brevity"


class Quiz(Env):
    """Asks a task file's question (its payload); rewards short answers, as Brevity."""

    def reset(self, task: Task) -> str:
        return f"In a few words: {(task.payload or {})['question']}"

    def reward(self, answer: str) -> float:
        return 1.0 / (1.0 + len(answer) / 50.0)


QUIZ = "tests._helpers:Quiz"


def tiny_llama(folder: Path, vocab_size: int = 320) -> Path:
    """A random 2-layer Llama with tied embeddings, covering the emulator's byte tokens."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


# Qwen2.5's chat template, in the structure that matters here: the tools listed in the
# system turn, each assistant tool call a <tool_call> block (Hermes), each tool result a
# <tool_response> in a user turn.
QWEN_CHAT_TEMPLATE = Path(__file__).with_name("qwen_chat_template.jinja")


def tiny_qwen(folder: Path, tokenizer_from: Path) -> Path:
    """A random 2-layer Qwen2 with tied embeddings (as Qwen2.5-0.5B's are) and Qwen2.5's
    chat template, on ``tokenizer_from``'s tokenizer (ChatML tokens): a second
    architecture, built here, so nothing is downloaded."""
    import shutil

    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,  # head size 64: one vLLM's CPU attention takes
        num_key_value_heads=1,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    shutil.copy(QWEN_CHAT_TEMPLATE, folder / "chat_template.jinja")
    shutil.copy(tokenizer_from / "generation_config.json", folder / "generation_config.json")
    return folder


# ------------------------------------------- an [alloc] run on the embedded model

NEVER = 1e9  # a re-plan trigger or ratio that never fires


def hybrid_alloc_section(cores: list[int]) -> dict[str, Any]:
    """Three workers on the machine's cores (one core may be in two sets): 0 trains,
    1 serves for good, 2 serves until the loop lends it to training."""
    return {
        "enabled": True,
        "workers": [[cores[0]], [cores[-1]], [cores[-1]]],
        "training": [0],
        "rollout": [[1]],
        "hybrid": [[2]],
        "loop": {
            # Borrow as soon as training (with its export and sync) outlasts the
            # rollout; never release (a restart of vLLM would outlast the test).
            "borrow_ratio": 1.0001,
            "release_ratio": 1e-9,
            "max_pressure": NEVER,
            "trigger": {
                "every_steps": 1_000_000,
                "ratio_high": NEVER,
                "ratio_low": 1e-9,
                "queue_pressure": NEVER,
                "length_drift": NEVER,
            },
        },
        "pool": {"fetch_timeout_s": 600, "drain_timeout_s": 60},
    }


def embedded_alloc_run(
    run_dir: Path, alloc: dict[str, Any], *, steps: int, **loop: Any
) -> TrainRunConfig:
    """A run of ``steps`` steps on the embedded model with the ``[alloc]`` section
    ``alloc``; ``loop`` overrides the loop's fields (group sizes, sections)."""
    # Imported here: the launcher (and torch with it) is for the few tests that run one.
    from libra.launch import TrainRunConfig

    return TrainRunConfig.model_validate(
        {
            "rollout": {
                "env": BREVITY,
                "server": "embedded",
                "engine": {"sampling": {"max_tokens_per_turn": 8, "temperature": 0.7}},
            },
            "steps": steps,
            "prompts_per_step": 2,
            "samples_per_prompt": 2,
            "run_dir": str(run_dir),
            "checkpoint_every": 0,
            "trainer": {"lr": 1e-4},
            "train": {"micro_batch_tokens": 1024},
            "vllm": {"max_model_len": 1024, "startup_timeout_s": 400, "kv_cache_gib": 1},
            "alloc": alloc,
        }
        | loop
    )


# ------------------------------------------- the allocation pool on an emulated cluster

#: Turns of 40-120 tokens at ~10 ms a step: calls stay in flight long enough to act on.
POOL_LATENCY = LatencyModel(prefill_s_per_token=1e-6, step_base_s=0.01, step_per_seq_s=1e-5)
#: A model whose training state fits on one A100 (the emulated trainer's and the planner's).
SMALL_MODEL = Model(name="small", parameters=1.5e9, layers=28, kv_heads=2, head_dim=128)
#: Worker 0 trains, worker 1 serves for good, workers 2 and 3 are hybrid (TP1 each).
POOL_LAYOUT = Layout(training=(0,), rollout=((1,),), hybrid=((2,), (3,)))
POOL_CONFIG = PoolConfig(model=MODEL, api="tokens")


def emulated_cluster(workers: int = 4, *, start_s: float = 20.0) -> EmulatedCluster:
    """``workers`` emulated A100s training :data:`SMALL_MODEL` without jitter and serving
    the agent script at :data:`POOL_LATENCY` (whatever the TP)."""
    trainer = EmulatedTrainer(A100, SMALL_MODEL, TrainTruth(jitter=0.0))
    server = EmulatorConfig(model_name=MODEL, agent=AgentScript(think_tokens=(40, 120)))
    return EmulatedCluster(
        workers,
        trainer,
        lambda tp: POOL_LATENCY,
        server=server,
        truth=ClusterTruth(start_s=start_s),
    )


ROOT = Path(__file__).resolve().parents[1]  # `libra serve` subprocesses import this checkout

#: Emulator settings for ``libra serve``: no simulated latency.
ZERO_LATENCY = [
    f"emulator.latency.{field}=0"
    for field in ("prefill_s_per_token", "step_base_s", "step_per_seq_s", "step_per_ctx_token_s")
]
#: The keys :func:`libra_serve` starts ``libra serve`` with.
SERVE_USER_KEY, SERVE_ADMIN_KEY = "serve-user-key", "serve-admin-key"


@contextmanager
def libra_serve(
    *flags: str,
    settings: Sequence[str] = ZERO_LATENCY,
    server: str = "emulated",
    home: Path | None = None,
    started: list[int] | None = None,
) -> Iterator[str]:
    """``libra serve --server emulated`` (or ``server``) on a free loopback port, as a
    user runs it (a subprocess with :data:`SERVE_USER_KEY` and :data:`SERVE_ADMIN_KEY`);
    yields its base URL (and appends its pid to ``started``). Stopped with SIGTERM (as a
    service manager stops it) and checked to exit cleanly."""
    command = [sys.executable, "-m", "libra", "serve", "--server", server, "--port", "0"]
    command += ["--no-console", *flags, *(f"--set={s}" for s in settings)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env |= {"LIBRA_API_KEY": SERVE_USER_KEY, "LIBRA_ADMIN_KEY": SERVE_ADMIN_KEY}
    if home is not None:
        env["LIBRA_HOME"] = str(home)
    with subprocess.Popen(command, env=env, stdout=subprocess.PIPE, text=True) as process:
        try:
            if started is not None:
                started.append(process.pid)
            assert process.stdout is not None
            line = process.stdout.readline()  # "libra serve: http://127.0.0.1:PORT/v1 (...)"
            assert line.startswith("libra serve: http://"), line
            yield line.split()[2].removesuffix("/v1")
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0
        finally:
            if process.poll() is None:
                process.kill()


def scripted_record(
    id: str,
    reward: float | None,
    mask: Sequence[int],
    *,
    group: str = "g",
    ids: Sequence[int] | None = None,
    logprobs: Sequence[float] | None = None,
    status: Status = "completed",
    tokens: TokenSource = "exact",
    version: int = 0,
) -> TrajectoryRecord:
    """A record as the engine writes one, of ``mask``'s tokens (ids 3, 4, ... unless
    given); its sampled runs become weight spans of ``version``."""
    ids = list(ids) if ids is not None else [3 + i for i in range(len(mask))]
    logprobs = list(logprobs) if logprobs is not None else [-0.5] * len(mask)
    spans = [
        WeightSpan(start, start + run, version) for start, run in _runs(mask) if mask[start] == 1
    ]
    return TrajectoryRecord(
        id=id,
        env="test",
        task_id=group,
        group_id=group,
        step=0,
        sample=0,
        status=status,
        stop_reason="model_stop" if status != "failed" else "server_error",
        reward=reward,
        turns=1,
        messages=[],
        token_ids=ids,
        loss_mask=list(mask),
        logprobs=[p if m else None for p, m in zip(logprobs, mask, strict=True)],
        tokens=tokens,
        weight_versions=spans,
        tool_returns=[],
        endpoints=[],
        sampling=SamplingRecord(temperature=1.0, top_p=1.0, max_tokens_per_turn=1024, seed=None),
        weight_version=version,
        timings=Timings(),
    )


def _runs(mask: Sequence[int]) -> list[tuple[int, int]]:
    runs: list[tuple[int, int]] = []
    for i, value in enumerate(mask):
        if i and value == mask[i - 1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


def wandb_records(run_folder: Path) -> list[Any]:
    """The records of a W&B offline run (``offline-run-*/run-*.wandb``), parsed with
    wandb's own protobuf definitions. wandb ships no reader of its own since its core
    moved to Go, so this walks the file's framing: a 7-byte header (``:W&B``, magic,
    version), then 32 KiB blocks of chunks, each a 7-byte header (CRC, length, kind:
    1 whole, 2 first, 3 middle, 4 last) and its bytes; a block's tail shorter than a
    header is padding."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_folder.glob("run-*.wandb")
    data = path.read_bytes()
    ident, _magic, _version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B", ident
    block, position, pending, records = 32 * 1024, 7, b"", []
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:
            position += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0 and length == 0:
            break
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(run_folder: Path) -> list[dict[str, Any]]:
    """The rows a W&B offline run logged, their values decoded from JSON."""
    import json

    return [
        {
            item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for item in r.history.item
        }
        for r in wandb_records(run_folder)
        if r.WhichOneof("record_type") == "history"
    ]
