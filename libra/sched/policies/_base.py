"""What every routing policy shares: trajectory tracking and the decision log.

A :class:`RoutedPolicy` implements the engine's :class:`~libra.sched.Scheduler` protocol
on top of a :class:`~libra.sched.Router`. It follows each live trajectory (its path of
tool-return states, the output tokens it has generated, where it runs) and asks the
subclass one question per generation call, :meth:`RoutedPolicy.choose`: which instance,
at which vLLM priority, and why. Every answer is logged as a :class:`RouteDecision` (from
where to where, and the reason), which the metrics and the benchmark read.

A subclass with a ``name`` is registered under it (:data:`REGISTRY`, in the order the
classes are defined: the order the benchmark reports them), so a new policy is one
class; :meth:`RoutedPolicy.create` builds it from :class:`PolicyOptions`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from libra.config import Section
from libra.sched._buckets import Router
from libra.sched._instance import Instance
from libra.sched._protocol import CallOutcome, Route, RouteRequest
from libra.sched._signals import SignalMap
from libra.sched.policies._prefix_tree import Residual
from libra.signals import ToolSignal

# The most recent decisions, for tests and debugging (the counts per reason are kept
# whole in `reasons`): 10,000 are ~2.5 MB; a run of days must not grow with them.
DECISION_LOG_SIZE = 10_000


@dataclass(frozen=True, slots=True)
class Truth:
    """What the oracles are fed, by trajectory id: each turn's true output tokens and the
    seconds its tool call then takes (0 after the final answer)."""

    turns: Mapping[str, Sequence[tuple[int, float]]]

    @classmethod
    def of_totals(cls, totals: Mapping[str, int]) -> Truth:
        """Each trajectory's total output alone: one turn, no tool time."""
        return cls({trajectory: ((tokens, 0.0),) for trajectory, tokens in totals.items()})

    def output_tokens(self, trajectory_id: str) -> int:
        return sum(tokens for tokens, _ in self.turns[trajectory_id])

    def tool_s_left(self, trajectory_id: str, generated: int) -> float:
        """The tool seconds still to come once ``generated`` tokens are out: the tool
        calls of the turns not yet fully generated."""
        left, end = 0.0, 0
        for tokens, tool_s in self.turns[trajectory_id]:
            end += tokens
            if end > generated:
                left += tool_s
        return left


@dataclass(frozen=True, slots=True)
class PolicyOptions:
    """What building a policy by name may take: ``truth`` for the oracles, ``config`` for
    the policies with settings of their own (a :class:`CMLFQConfig` for C-MLFQ)."""

    truth: Truth | None = None
    config: Section | None = None


REGISTRY: dict[str, type[RoutedPolicy]] = {}


@dataclass(slots=True)
class Track:
    """What a policy knows of one live trajectory."""

    trajectory_id: str
    prompt_id: str
    env: str = ""  # its env's name, for per-env signal rules
    path: list[str] = field(default_factory=list)  # tool-return states so far
    marks: list[int] = field(default_factory=list)  # tokens generated when each was reached
    generated: int = 0  # output tokens so far
    context: int = 0  # prompt tokens of its latest call
    prompt_tokens: int = 0  # prompt tokens of its first call (its prompt, templated)
    turn: int = 0
    continues_turn: bool = False  # its next call goes on with its latest call's turn
    instance: Instance | None = None  # where its latest call ran, while it takes calls
    bucket: str | None = None  # the bucket of its latest call (kept when the instance left)
    estimate: Residual | None = None  # what the policy expects is left
    estimated_at: int = 0  # ``generated`` when the estimate was made
    decided_path: int = -1  # path length at the last bucket decision


class Choice(NamedTuple):
    instance: Instance
    priority: int | None
    reason: str
    max_tokens: int | None = None  # the call's quantum (see ``Route.max_tokens``)


class RouteDecision(NamedTuple):
    """One routing decision, for the metrics: where a call went and why."""

    trajectory_id: str
    turn: int
    time: float
    from_bucket: str | None
    to_bucket: str
    from_instance: str | None
    to_instance: str
    reason: str
    expected: float | None = None  # remaining output the policy expected (mean), if any
    expected_upper: float | None = None  # and its upper quantile
    generated: int = 0  # the trajectory's output so far

    @property
    def moved(self) -> bool:
        return self.from_instance is not None and self.from_instance != self.to_instance

    @property
    def changed_bucket(self) -> bool:
        return self.from_bucket is not None and self.from_bucket != self.to_bucket


class RoutedPolicy(ABC):
    """Base of the policies: implements the scheduler protocol, asks :meth:`choose`."""

    name: ClassVar[str] = ""  # registered under it when set
    needs_truth: ClassVar[bool] = False  # an oracle: only the benchmark can build it
    benchmarked_by_default: ClassVar[bool] = True
    ablates: ClassVar[str] = ""  # a variant with this mechanism taken out (``--ablate``)
    # Whether the longest trajectories end up on instances of their own (C-MLFQ demotes
    # them) rather than spread through full batches: how a planner prices their decodes.
    isolates_long_decodes: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("name")
        if name:
            if name in REGISTRY:
                raise TypeError(f"two policies are named {name!r}")
            REGISTRY[name] = cls

    @classmethod
    def create(cls, router: Router, options: PolicyOptions) -> RoutedPolicy:
        """The policy over ``router`` (override to take ``options``)."""
        return cls(router)

    def __init__(self, router: Router, *, signals: SignalMap | None = None) -> None:
        self.router = router
        self.signals = signals or SignalMap()
        self.tracks: dict[str, Track] = {}
        self.decisions: deque[RouteDecision] = deque(maxlen=DECISION_LOG_SIZE)
        self.reasons: Counter[str] = Counter()
        router.listeners.append(self._instance_left)

    # ------------------------------------------------------------ what policies write

    @abstractmethod
    def choose(self, request: RouteRequest, track: Track, exclude: frozenset[str]) -> Choice:
        """Where the trajectory's next call goes (``track`` is up to date)."""

    def learn(self, track: Track, output_tokens: int) -> None:  # noqa: B027 (optional)
        """A trajectory finished with ``output_tokens`` in all; learn from it."""

    # --------------------------------------------------------- the scheduler protocol

    def route(self, request: RouteRequest, exclude: frozenset[str] = frozenset()) -> Route:
        track = self._track(request)
        choice = self.choose(request, track, exclude)
        route = self.router.acquire(choice.instance, request, choice.priority, choice.max_tokens)
        self._log(track, choice)
        track.instance, track.bucket = choice.instance, choice.instance.bucket
        return route

    def release(self, route: Route, *, outcome: CallOutcome, new_tokens: int) -> None:
        self.router.release(route, outcome=outcome)
        track = self.tracks.get(route.trajectory_id)
        if track is not None and outcome in ("ok", "migrated"):  # sampled tokens it keeps
            track.generated += new_tokens

    def on_tool_return(self, trajectory_id: str, signal: ToolSignal) -> None:
        track = self.tracks.get(trajectory_id)
        if track is None:
            return
        state = self.signals.state(track.env, signal)
        if state is not None:
            track.path.append(state)
            track.marks.append(track.generated)

    def on_finish(
        self, trajectory_id: str, prompt_id: str, *, output_tokens: int, failed: bool = False
    ) -> None:
        track = self.tracks.pop(trajectory_id, None)
        self.router.forget(trajectory_id)
        if track is not None and not failed:
            self.learn(track, output_tokens)

    def calls_in_flight(self) -> dict[str, int]:
        return {instance.name: instance.in_flight for instance in self.router.instances}

    # --------------------------------------------------------------------- helpers

    def _track(self, request: RouteRequest) -> Track:
        track = self.tracks.get(request.trajectory_id)
        if track is None:
            track = self.tracks[request.trajectory_id] = Track(
                request.trajectory_id, request.prompt_id, request.env
            )
            track.prompt_tokens = request.context_tokens
        track.continues_turn = track.instance is not None and track.turn == request.turn
        track.turn = request.turn
        track.context = request.context_tokens
        # The engine's count is authoritative (a release may have been missed on a crash).
        track.generated = max(track.generated, request.generated_tokens)
        return track

    def _instance_left(self, instance: Instance) -> None:
        """``instance`` takes no more calls (draining, removed): no track points at it."""
        for track in self.tracks.values():
            if track.instance is instance:
                track.instance = None

    def _log(self, track: Track, choice: Choice) -> None:
        previous, estimate = track.instance, track.estimate
        self.decisions.append(
            RouteDecision(
                trajectory_id=track.trajectory_id,
                turn=track.turn,
                time=self.router.clock(),
                from_bucket=track.bucket,
                to_bucket=choice.instance.bucket,
                from_instance=previous.name if previous is not None else None,
                to_instance=choice.instance.name,
                reason=choice.reason,
                expected=estimate.mean if estimate is not None else None,
                expected_upper=estimate.upper if estimate is not None else None,
                generated=track.generated,
            )
        )
        self.reasons[choice.reason] += 1

    def previous_instance(self, request: RouteRequest, track: Track) -> Instance | None:
        """Where the trajectory's prefix is cached: its last instance, while it takes calls."""
        previous = self.router.instance_of(request.previous) or track.instance
        return previous if previous is not None and previous.state == "active" else None
