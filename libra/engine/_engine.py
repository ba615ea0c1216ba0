"""What every conversation the engine runs shares: the client, the scheduler, sandboxes
and the limits (a rollout's trajectories and a gateway's sessions alike)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import KW_ONLY, dataclass, field

from libra.engine._client import OpenAIClient
from libra.engine._config import EngineConfig
from libra.engine._events import TrajectoryEvents
from libra.engine._http import HTTPTransport
from libra.engine._records import TrajectoryRecord
from libra.engine._tokens import ChatTemplate, TemplateRenderer
from libra.engine._tool_threads import ToolThreads
from libra.engine._watch import GenerationWatch
from libra.envs import EnvBugs, SandboxProvider, TrajectoryId
from libra.events import EventBus
from libra.sched import Scheduler


@dataclass
class Engine:
    """What trajectories share: the client, the scheduler, sandboxes and the limits.

    The engine builds its client over ``http`` itself, so every limit in ``config``
    (the request timeout included) is the one that applies.
    """

    http: HTTPTransport
    scheduler: Scheduler
    _: KW_ONLY
    config: EngineConfig = field(default_factory=EngineConfig)
    sandboxes: SandboxProvider | None = None
    #: Sees every record the engine makes, whichever session ran it (a log, a test);
    #: the consumer of a rollout reads its session's stream instead.
    on_record: Callable[[TrajectoryRecord], None] | None = None
    #: Chat templates that run in-process: one that renders as a server does replaces
    #: that server's ``/tokenize`` round trips (``TemplateRenderer``).
    templates: Sequence[ChatTemplate] = ()
    #: Where it publishes what its trajectories do (``libra.events``): the events log and
    #: the live view read it; None publishes nothing.
    events: EventBus | None = None
    client: OpenAIClient = field(init=False)
    renderer: TemplateRenderer = field(init=False)
    #: Exceptions raised by env code: each place and type's first traceback on stderr.
    env_bugs: EnvBugs = field(init=False, default_factory=EnvBugs)
    #: The trajectories its sessions hold (queued or running): no two alike at once,
    #: whichever session holds them, since the scheduler keys its state by them.
    live_ids: set[TrajectoryId] = field(init=False, default_factory=set)
    #: Every generation call in flight, and when one last returned (a stall's warning).
    generations: GenerationWatch = field(init=False, default_factory=GenerationWatch)
    #: Threads for blocking tools (``config.tool_threads``): busy, abandoned, waiting.
    tool_threads: ToolThreads = field(init=False)
    #: ``events``' publisher of trajectories (None without a bus).
    published: TrajectoryEvents | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.tool_threads = ToolThreads(self.config.tool_threads)
        self.client = OpenAIClient(self.http, timeout_s=self.config.request_timeout_s)
        self.renderer = TemplateRenderer(self.client, self.templates)
        if self.events is not None:
            self.published = TrajectoryEvents(self.events)
