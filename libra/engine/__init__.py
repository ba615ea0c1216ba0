"""The rollout engine: every trajectory is one coroutine (see ``_trajectory.py``), run
by a long-lived :class:`RolloutSession` (``_session.py``) that streams their records.
One model turn's mechanics (``_turn.py``: routing, retries, continuations) serve the
gateway's sessions too."""

from libra.engine._asgi import ASGITransport
from libra.engine._client import (
    CallTimedOut,
    Generation,
    GenerationError,
    OpenAIClient,
    RequestRejected,
    ServerUnavailable,
)
from libra.engine._config import EngineConfig, SamplingConfig
from libra.engine._engine import Engine
from libra.engine._http import (
    AiohttpTransport,
    BaseTransport,
    HTTPTransport,
    HttpxTransport,
    TransportError,
    TransportTimeout,
)
from libra.engine._httptools import HttptoolsTransport
from libra.engine._job import TrajectoryJob
from libra.engine._records import (
    SamplingRecord,
    Status,
    Timings,
    TokenSource,
    ToolReturnRecord,
    TrajectoryRecord,
    WeightSpan,
    join_pieces,
)
from libra.engine._rollout import jobs_for, jobs_of, rollout
from libra.engine._session import Group, RolloutSession, TrajectoryRunner
from libra.engine._stats import RolloutStats
from libra.engine._tokens import ChatTemplate, TemplateRenderer, TokenLog
from libra.engine._trajectory import run_trajectory, score_reply
from libra.engine._transports import TransportName, http_transport
from libra.engine._turn import (
    ContextFull,
    Dialogue,
    NoCapacity,
    Piece,
    Recorded,
    ServerTrouble,
    Turn,
    generate_turn,
    record_of,
    with_tools_described,
)

__all__ = [
    "ASGITransport",
    "AiohttpTransport",
    "BaseTransport",
    "CallTimedOut",
    "ChatTemplate",
    "ContextFull",
    "Dialogue",
    "Engine",
    "EngineConfig",
    "Generation",
    "GenerationError",
    "Group",
    "HTTPTransport",
    "HttptoolsTransport",
    "HttpxTransport",
    "NoCapacity",
    "OpenAIClient",
    "Piece",
    "Recorded",
    "RequestRejected",
    "RolloutSession",
    "RolloutStats",
    "SamplingConfig",
    "SamplingRecord",
    "ServerTrouble",
    "ServerUnavailable",
    "Status",
    "TemplateRenderer",
    "Timings",
    "TokenLog",
    "TokenSource",
    "ToolReturnRecord",
    "TrajectoryJob",
    "TrajectoryRecord",
    "TrajectoryRunner",
    "TransportError",
    "TransportName",
    "TransportTimeout",
    "Turn",
    "WeightSpan",
    "generate_turn",
    "http_transport",
    "jobs_for",
    "jobs_of",
    "join_pieces",
    "record_of",
    "rollout",
    "run_trajectory",
    "score_reply",
    "with_tools_described",
]
