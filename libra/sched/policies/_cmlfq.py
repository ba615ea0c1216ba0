"""C-MLFQ: route each generation call by what the trajectory's tool returns predict.

Every trajectory starts at the top level (the shortest bucket). After each tool return
the causal prefix forest gives the residual distribution of its remaining output, and
one of three rules picks the instance of its next call:

``simple`` (the reference's rule)
    Target the smallest bucket whose token ceiling covers the residual mean; move only
    when the mean and the upper quantile (p90) name the same bucket, else stay. Inside
    the bucket, least-loaded with stickiness; fallback when the bucket is full or down.
``cost`` (the reference's cost form)
    For every ready instance, the expected decode seconds of the residual on that
    instance's TP, plus the cost of moving (re-prefilling the context elsewhere);
    instances with a full queue are skipped; ties prefer staying, then the least loaded.
``finish`` (Libra's, beyond the reference)
    The cost form ignores load, so every predicted straggler piles onto the fastest
    instances and they stop being fast. ``finish`` estimates, for every ready instance,
    when it would be done with everything that lives there plus this trajectory: the
    larger of draining their expected work at the batch's throughput, and the longest
    upper-quantile residual among them at the batch's per-token latency (a straggler is
    slowed by everyone it shares a batch with). It picks the instance that finishes
    first, plus the cost of moving. Likely stragglers thus get the fastest, least
    crowded instances and short trajectories fill the rest: bucket sizing follows from
    the load instead of being fixed. ``TreeConfig.demote_quantile`` prices a move down
    to a shorter bucket by a higher quantile of the residual, since the two mistakes are
    not alike (a straggler moved down in error runs its tail on a slow instance and sets
    the makespan, a short trajectory kept up in error costs a share of a fast instance);
    it is off by default: on the shipped workloads it traded one run for another
    (docs/benchmarks/scheduling.md).

A call samples at most ``quantum_tokens`` (on the token path), and a turn that is not
done by then is routed again with the tokens it has, so that the cost rules can move a
turn that runs long (turn lengths are heavy-tailed, and no tool return announces one) to
a faster instance; the simple rule, seeing no new signal, keeps it where it is. Mid-turn
it may stay or go to a longer bucket, never a shorter one: it has outrun most estimates
already. Moving costs the context's prefill, which the ``finish`` rule prices; staying
costs next to nothing (the server has the prefix cached).

Any rule can add vLLM's per-request priority inside an instance. ``shortest_first``
(the default) admits the calls of trajectories expected to finish soon before those of
likely stragglers when a server's queue forms, and makes a likely straggler the one
preempted when its KV cache runs short; ``longest_first`` does the opposite. It acts
only where a server queues or preempts, which the ``finish`` rule mostly avoids: on the
shipped workloads (``libra bench sched --ablate``) ``cmlfq-no-priority`` ran exactly as
``cmlfq`` in most runs, and faster or slower by chance in the others (the ablations in
docs/scheduling/cmlfq.md). New trajectories are placed by the same rule from the tree's root
estimate; ``start_in_shortest`` restores the reference's "every trajectory starts in the shortest
bucket", which leaves the larger buckets idle during the first turn. Every decision is
logged with its reason (see :class:`~libra.sched.policies.RouteDecision`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from pydantic import Field, PositiveInt

from libra.config import Section
from libra.fleet import StepCost
from libra.sched._buckets import Router
from libra.sched._instance import Bucket, Instance
from libra.sched._protocol import CallOutcome, Route, RouteRequest
from libra.sched._signals import SignalMap
from libra.sched.policies._base import Choice, PolicyOptions, RoutedPolicy, Track
from libra.sched.policies._fit import CostFit
from libra.sched.policies._predict import Predictor, PromptHistoryPredictor, TreePredictor
from libra.sched.policies._prefix_tree import PrefixForest, Residual, TreeConfig
from libra.signals import ToolSignal

Rule = Literal["simple", "cost", "finish"]
PriorityOrder = Literal["none", "longest_first", "shortest_first"]


class CMLFQConfig(Section):
    rule: Rule = Field(
        "finish",
        description="what picks a call's instance: simple (the bucket that covers the "
        "residual estimate), cost (expected decode seconds plus moving), finish (the "
        "instance that would finish first, its load included)",
    )
    priority: PriorityOrder = Field(
        "shortest_first",
        description="vLLM priority inside an instance (the servers need "
        "--scheduling-policy priority; 'none' sends no priority)",
    )
    priority_tokens: PositiveInt = Field(256, description="expected tokens per priority level")
    start_in_shortest: bool = Field(
        False,
        description="first calls go to the shortest bucket (the reference's rule); else "
        "the rule places them too, from the tree's root estimate",
    )
    tie_tolerance: float = Field(0.02, ge=0, description="relative cost difference that ties")
    quantum_tokens: PositiveInt | None = Field(
        1024,
        description="a call samples at most this many tokens, then the turn is routed "
        "again (on the token path), so a turn that runs long can move to a longer bucket; "
        "none: whole turns",
    )
    fit_costs: bool = Field(
        False,
        description="decide with each instance's step cost fitted online from the calls "
        "it observes (starting from the fleet's prior); else with the prior",
    )
    tree: TreeConfig = TreeConfig()
    signals: SignalMap = SignalMap()


class CMLFQ(RoutedPolicy):
    """C-MLFQ under any :class:`CMLFQConfig`; the registered variants below fix one."""

    isolates_long_decodes: ClassVar[bool] = True

    def __init__(
        self,
        router: Router,
        config: CMLFQConfig | None = None,
        *,
        predictor: Predictor | None = None,
    ) -> None:
        self.config = config or CMLFQConfig()
        super().__init__(router, signals=self.config.signals)
        self.predictor: Predictor = predictor or TreePredictor(PrefixForest(self.config.tree))
        self.fit: CostFit | None = CostFit() if self.config.fit_costs else None

    # --------------------------------------------------------- observing the costs

    def route(self, request: RouteRequest, exclude: frozenset[str] = frozenset()) -> Route:
        route = super().route(request, exclude)
        if self.fit is not None:
            self.fit.sent(request, route)
        return route

    def release(self, route: Route, *, outcome: CallOutcome, new_tokens: int) -> None:
        if self.fit is not None and route.instance is not None:
            prior = route.instance.cost
            self.fit.released(route, outcome=outcome, new_tokens=new_tokens, prior=prior)
        super().release(route, outcome=outcome, new_tokens=new_tokens)

    def on_finish(
        self, trajectory_id: str, prompt_id: str, *, output_tokens: int, failed: bool = False
    ) -> None:
        if self.fit is not None:
            self.fit.forget(trajectory_id)
        super().on_finish(trajectory_id, prompt_id, output_tokens=output_tokens, failed=failed)

    def cost(self, instance: Instance) -> StepCost:
        """The step cost decisions use: fitted when fitting, else the prior."""
        return self.fit.cost(instance) if self.fit is not None else instance.cost

    @property
    def forest(self) -> PrefixForest | None:
        """The prefix forest (to save with the run), when the predictor is one."""
        return self.predictor.forest if isinstance(self.predictor, TreePredictor) else None

    # ------------------------------------------------------------------- deciding

    def choose(self, request: RouteRequest, track: Track, exclude: frozenset[str]) -> Choice:
        estimate = self._estimate(track)
        if self.config.rule == "simple":
            instance, reason = self._simple(request, track, estimate, exclude)
        else:
            instance, reason = self._by_cost(request, track, estimate, exclude)
        return Choice(instance, self._priority(estimate), reason, self.config.quantum_tokens)

    def learn(self, track: Track, output_tokens: int) -> None:
        self.predictor.learn(track, output_tokens)

    def _estimate(self, track: Track) -> Residual:
        """The residual, with a floor for trajectories the history cannot place: new ones
        fit the top level; ones longer than anything seen are taken to be stragglers."""
        estimate = self.predictor.residual(track)
        track.estimated_at = track.generated
        if estimate.samples == 0:
            buckets = self.router.buckets
            guess = buckets[0].max_tokens if track.generated == 0 else buckets[-1].max_tokens
            estimate = Residual(float(guess), float(guess), 0, estimate.depth, "none")
        track.estimate = estimate
        return estimate

    def _priority(self, estimate: Residual) -> int | None:
        order = self.config.priority
        if order == "none":
            return None
        if order == "longest_first":
            return -int(estimate.upper // self.config.priority_tokens)
        return int(estimate.mean // self.config.priority_tokens)

    # ------------------------------------------------------------- the simple rule

    def _simple(
        self, request: RouteRequest, track: Track, estimate: Residual, exclude: frozenset[str]
    ) -> tuple[Instance, str]:
        router = self.router
        current = router.bucket_of.get(track.bucket) if track.bucket is not None else None
        if current is None:
            target = router.shortest if self.config.start_in_shortest else None
            reason = "start"
            if target is None:
                target = router.bucket_for_tokens(estimate.mean)
        elif track.decided_path == len(track.path):
            target, reason = current, "no_new_signal"
        else:
            target, reason = self._bucket_rule(current, estimate)
        track.decided_path = len(track.path)
        instance, how = router.pick(target, request, exclude)
        return instance, reason if how == "ok" else f"{reason}+{how}"

    def _bucket_rule(self, current: Bucket, estimate: Residual) -> tuple[Bucket, str]:
        if estimate.samples == 0:
            return current, "no_history"
        by_mean = self.router.bucket_for_tokens(estimate.mean)
        by_upper = self.router.bucket_for_tokens(estimate.upper)
        if by_mean is not by_upper:
            return current, "mean_p90_disagree"
        if by_mean.index > current.index:
            return by_mean, "to_longer"
        if by_mean.index < current.index:
            return by_mean, "to_shorter"
        return current, "stay"

    # ------------------------------------------------------------ the cost forms

    def _by_cost(
        self, request: RouteRequest, track: Track, estimate: Residual, exclude: frozenset[str]
    ) -> tuple[Instance, str]:
        router = self.router
        previous = self.previous_instance(request, track)
        candidates, reason = self._candidates(track, exclude, previous)
        if self.config.rule == "cost":
            costs = [self._decode_cost(i, track, estimate, previous) for i in candidates]
        else:
            loads = self._loads(track)
            costs = [
                self._finish_cost(i, loads.get(i, _Load()), track, estimate, previous)
                for i in candidates
            ]
        best = min(costs)
        tolerance = self.config.tie_tolerance * max(best, 1e-9)
        tied = [i for i, c in zip(candidates, costs, strict=True) if c <= best + tolerance]
        if previous is not None and previous in tied:
            chosen = previous
        else:
            chosen = router.least_loaded(tied)
        track.decided_path = len(track.path)
        if reason == "start":
            return chosen, reason
        if previous is None or chosen is previous:
            return chosen, reason or "stay"
        moved = _bucket_index(router, chosen) - _bucket_index(router, previous)
        direction = "to_longer" if moved > 0 else "to_shorter" if moved < 0 else "rebalance"
        return chosen, f"{direction}+{reason}" if reason else direction

    def _candidates(
        self, track: Track, exclude: frozenset[str], previous: Instance | None
    ) -> tuple[list[Instance], str]:
        """Ready instances to compare: not down, not full (unless all are); on the first
        call only those of the shortest bucket, when configured. A turn that outran its
        quantum has outrun most estimates too: it may go on in a longer bucket or its
        own, never in a shorter one."""
        router = self.router
        available = router.usable(exclude)
        with_room = [i for i in available if not router.is_full(i)]
        if track.bucket is None and self.config.start_in_shortest:  # its first call
            top = [i for i in with_room if i.bucket == router.shortest.name]
            if top:
                return top, "start"
        if track.continues_turn and previous is not None:
            floor = _bucket_index(router, previous)
            longer = [i for i in with_room if _bucket_index(router, i) >= floor]
            if longer:
                return longer, ""
        if with_room:
            return with_room, ""
        return available, "all_full"

    def _move_cost(self, instance: Instance, track: Track, previous: Instance | None) -> float:
        """Re-prefilling the context on another instance (its prefix is cached only where
        its last call ran)."""
        if previous is None or instance is previous:
            return 0.0
        return self.cost(instance).prefill_time(track.context)

    def _decode_cost(
        self, instance: Instance, track: Track, estimate: Residual, previous: Instance | None
    ) -> float:
        """The reference's cost: decode seconds of the residual on this TP, alone."""
        tokens = estimate.mean
        per_token = self.cost(instance).step_time(1, track.context + tokens / 2)
        return tokens * per_token + self._move_cost(instance, track, previous)

    def _loads(self, track: Track) -> dict[Instance, _Load]:
        """What lives on each instance, this trajectory aside (one pass over them all):
        estimates are aged by what each trajectory generated since it was made."""
        loads: dict[Instance, _Load] = {}
        for other in self.tracks.values():
            if other.instance is None or other is track:
                continue
            load = loads.get(other.instance)
            if load is None:
                load = loads[other.instance] = _Load()
            since = other.generated - other.estimated_at
            estimate = other.estimate
            if estimate is not None:
                load.work += max(0.0, estimate.mean - since)
                if estimate.tool_s:
                    load.with_tools.append((estimate.upper - since, estimate.tool_s))
                else:
                    load.longest = max(load.longest, estimate.upper - since)
            load.context += other.context + since
            load.count += 1
        return loads

    def _finish_cost(
        self,
        instance: Instance,
        load: _Load,
        track: Track,
        estimate: Residual,
        previous: Instance | None,
    ) -> float:
        """When ``instance`` would be done with its residents plus this trajectory."""
        work = load.work + estimate.mean
        context = load.context + track.context
        size = load.count + 1
        fits = _batch_that_fits(instance, size, context)
        step = self.cost(instance).step_time(fits, context * fits / size)
        drain = work * step / fits
        per_token = step * size / fits  # a resident's, while the batch holds them all
        upper = self._upper(instance, estimate, previous)
        chains = [(load.longest, 0.0), (upper, estimate.tool_s), *load.with_tools]
        chain = max(tokens * per_token + tool_s for tokens, tool_s in chains)
        return max(drain, chain) + self._move_cost(instance, track, previous)

    def _upper(self, instance: Instance, estimate: Residual, previous: Instance | None) -> float:
        """The residual this trajectory's chain is priced by on ``instance``: the upper
        quantile, or the demotion quantile where ``instance`` is in a shorter bucket
        than the one it leaves."""
        tail = estimate.demote_upper
        if tail is None or tail <= estimate.upper or previous is None:
            return estimate.upper
        moves_down = _bucket_index(self.router, instance) < _bucket_index(self.router, previous)
        return tail if moves_down else estimate.upper


@dataclass(slots=True)
class _Load:
    """The trajectories living on an instance: how many, their expected remaining output,
    the longest upper residual among them, and their context tokens; the residuals that
    come with tool seconds still to come (only an oracle's) are kept with them."""

    count: int = 0
    work: float = 0.0
    longest: float = 0.0
    context: float = 0.0
    with_tools: list[tuple[float, float]] = field(default_factory=list)


def _bucket_index(router: Router, instance: Instance) -> int:
    bucket = router.bucket_of.get(instance.bucket)
    return bucket.index if bucket is not None else -1


def _batch_that_fits(instance: Instance, size: int, context: float) -> int:
    """How many of ``size`` sequences holding ``context`` tokens run at once."""
    per_sequence = max(1.0, context / size)
    fits = int(instance.spec.kv_capacity_tokens // per_sequence)
    return max(1, min(size, instance.spec.max_num_seqs, fits))


def reference_simple() -> CMLFQConfig:
    """The reference implementation's rule: start in the shortest bucket, then bucket by
    mean and p90; no priority."""
    return CMLFQConfig(rule="simple", priority="none", start_in_shortest=True, quantum_tokens=None)


def reference_cost() -> CMLFQConfig:
    """The reference implementation's cost form: start in the shortest bucket; no
    priority."""
    return CMLFQConfig(rule="cost", priority="none", start_in_shortest=True, quantum_tokens=None)


# ------------------------------------------------------- the registered variants


class ReferenceCMLFQ(CMLFQ):
    """The reference implementation's simple rule (:func:`reference_simple`)."""

    name: ClassVar[str] = "cmlfq-ref"

    @classmethod
    def create(cls, router: Router, options: PolicyOptions) -> RoutedPolicy:
        return cls(router, reference_simple())


class ReferenceCostCMLFQ(CMLFQ):
    """The reference implementation's cost form (:func:`reference_cost`)."""

    name: ClassVar[str] = "cmlfq-cost"

    @classmethod
    def create(cls, router: Router, options: PolicyOptions) -> RoutedPolicy:
        return cls(router, reference_cost())


class LibraCMLFQ(CMLFQ):
    """Libra's C-MLFQ: the ``finish`` rule by default, or the :class:`CMLFQConfig` given."""

    name: ClassVar[str] = "cmlfq"

    @classmethod
    def create(cls, router: Router, options: PolicyOptions) -> RoutedPolicy:
        config = options.config
        if config is not None and not isinstance(config, CMLFQConfig):
            raise TypeError(f"cmlfq takes a CMLFQConfig, not {type(config).__name__}")
        return cls(router, config)


class FittedCMLFQ(CMLFQ):
    """Libra's C-MLFQ deciding with step costs fitted online (``fit_costs``): how much the
    fit buys when the servers are not what the fleet's prior says."""

    name: ClassVar[str] = "cmlfq-fit"

    @classmethod
    def create(cls, router: Router, options: PolicyOptions) -> RoutedPolicy:
        config = options.config if isinstance(options.config, CMLFQConfig) else CMLFQConfig()
        return cls(router, config.model_copy(update={"fit_costs": True}))


class _Ablation(CMLFQ):
    """Libra's C-MLFQ (its default settings, or the :class:`CMLFQConfig` given) with one
    mechanism taken out: ``--ablate`` runs these beside it to show what each part buys."""

    benchmarked_by_default: ClassVar[bool] = False
    ablates: ClassVar[str] = ""

    @classmethod
    def create(cls, router: Router, options: PolicyOptions) -> RoutedPolicy:
        config = options.config if isinstance(options.config, CMLFQConfig) else CMLFQConfig()
        return cls(router, cls.ablated(config))

    @classmethod
    def ablated(cls, config: CMLFQConfig) -> CMLFQConfig:
        return config


class NoSignalCMLFQ(_Ablation):
    """Tool returns are ignored: the prefix forest sees only each prompt's root, so the
    estimate is the prompt's remaining output given what it generated so far."""

    name: ClassVar[str] = "cmlfq-no-signal"
    ablates: ClassVar[str] = "tool-return signals"

    def on_tool_return(self, trajectory_id: str, signal: ToolSignal) -> None:
        pass  # the ablation: no signal reaches the tracks


class NoPriorityCMLFQ(_Ablation):
    """No vLLM priority: the servers serve their queues first come, first served."""

    name: ClassVar[str] = "cmlfq-no-priority"
    ablates: ClassVar[str] = "in-server priority"

    @classmethod
    def ablated(cls, config: CMLFQConfig) -> CMLFQConfig:
        return config.model_copy(update={"priority": "none"})


class NoQuantumCMLFQ(_Ablation):
    """Whole turns: a call samples until its turn ends, so a turn that runs long stays
    where it started."""

    name: ClassVar[str] = "cmlfq-no-quantum"
    ablates: ClassVar[str] = "the quantum (whole turns instead)"

    @classmethod
    def ablated(cls, config: CMLFQConfig) -> CMLFQConfig:
        return config.model_copy(update={"quantum_tokens": None})


class HistoryCMLFQ(_Ablation):
    """The prompt-history predictor (each prompt's mean total, shrunk to the global mean)
    in place of the prefix forest: what the tree's paths buy over a per-prompt average."""

    name: ClassVar[str] = "cmlfq-history"
    ablates: ClassVar[str] = "the prefix tree (a prompt-history predictor instead)"

    def __init__(self, router: Router, config: CMLFQConfig | None = None) -> None:
        super().__init__(router, config, predictor=PromptHistoryPredictor())
