"""An emulated vLLM OpenAI-compatible server: scripted replies, continuous-batching timing.

It answers like vLLM's OpenAI server (chat and token-in completions, ``/tokenize``,
``/metrics``...) with a byte-level tokenizer and ChatML template, replies from a
:class:`Script`, and latency from a :class:`LatencyModel` played by a continuous-batching
:class:`BatchingEngine`. Use it in-process (``httpx.ASGITransport(create_app(...))``,
on asyncio or trio, under a virtual clock for benchmarks) or on a real port
(:func:`serve`, :func:`running_emulator`, ``python -m libra.emulation``). Runtime code
never imports it: a fleet, emulated or real, is handed to the engine as endpoints or an
HTTP transport.
"""

from libra.emulation._app import EmulatorApp, create_app
from libra.emulation._batching import BatchingEngine
from libra.emulation._cluster import ClusterTruth, EmulatedCluster, InstanceStartFailed
from libra.emulation._config import EmulatorConfig
from libra.emulation._faults import EmulatedServerDied
from libra.emulation._fleet_app import FleetApp
from libra.emulation._latency import KVAllocation, LatencyModel
from libra.emulation._prefix_cache import PrefixCache
from libra.emulation._scripts import (
    AgentScript,
    Conversation,
    EchoScript,
    Reply,
    Script,
    ScriptedReplies,
    builtin_script,
    parse_chatml,
)
from libra.emulation._serve import (
    EmulatorProcess,
    EmulatorServer,
    emulator_process,
    running_emulator,
    serve,
)
from libra.emulation._tokenizer import (
    ENDOFTEXT_ID,
    EOS_ID,
    IM_END_ID,
    IM_START_ID,
    VOCAB_SIZE,
    ByteTokenizer,
    render_chat,
    render_chat_text,
)
from libra.emulation._training import EmulatedTrainer, TrainJoinFailed, TrainTruth
from libra.emulation._truth import ServingTruth

__all__ = [
    "ENDOFTEXT_ID",
    "EOS_ID",
    "IM_END_ID",
    "IM_START_ID",
    "VOCAB_SIZE",
    "AgentScript",
    "BatchingEngine",
    "ByteTokenizer",
    "ClusterTruth",
    "Conversation",
    "EchoScript",
    "EmulatedCluster",
    "EmulatedServerDied",
    "EmulatedTrainer",
    "EmulatorApp",
    "EmulatorConfig",
    "EmulatorProcess",
    "EmulatorServer",
    "FleetApp",
    "InstanceStartFailed",
    "KVAllocation",
    "LatencyModel",
    "PrefixCache",
    "Reply",
    "Script",
    "ScriptedReplies",
    "ServingTruth",
    "TrainJoinFailed",
    "TrainTruth",
    "builtin_script",
    "create_app",
    "emulator_process",
    "parse_chatml",
    "render_chat",
    "render_chat_text",
    "running_emulator",
    "serve",
]
