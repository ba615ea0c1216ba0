"""What a policy's step comes to: its run summed up from the records and the servers
(:class:`PolicyRun`), and compared with the bound, the oracle and C-MLFQ
(:class:`PolicyResult`)."""

from __future__ import annotations

import math
from statistics import fmean, median

from libra.bench._sched_fleet import FleetFile
from libra.bench._sched_report import (
    Call,
    Guess,
    LowerBound,
    PolicyResult,
    PolicyRun,
    Straggler,
    Timeline,
)
from libra.emulation import EmulatorApp
from libra.engine import TrajectoryRecord
from libra.sched import Scheduler
from libra.sched.policies import CMLFQ, RoutedPolicy, Truth


def summarise(
    name: str,
    policy: Scheduler,
    fleet: FleetFile,
    apps: dict[str, EmulatorApp],
    timelines: dict[str, Timeline],
    records: list[TrajectoryRecord],
    makespan: float,
    truth: Truth | None = None,
) -> PolicyRun:
    plans = fleet.instances
    busy = 0.0
    preemptions = 0
    for plan in plans:
        engine = apps[plan.name].engine
        busy += plan.tp * (engine.busy_s if engine is not None else 0.0)
        preemptions += engine.num_preemptions if engine is not None else 0
    bucket_of = {plan.name: plan.bucket for plan in plans}
    migrations = bucket_moves = 0
    for record in records:
        for before, after in zip(record.endpoints, record.endpoints[1:], strict=False):
            if before != after:
                migrations += 1
                bucket_moves += bucket_of[before] != bucket_of[after]
    occupancy = _bucket_occupancy(timelines, bucket_of, [b.name for b in fleet.bucket])
    reasons = dict(policy.reasons) if isinstance(policy, RoutedPolicy) else {}
    fitted = {}
    if isinstance(policy, CMLFQ) and policy.fit is not None:
        fitted = {i.name: policy.fit.cost(i) for i in policy.router.instances}
    return PolicyRun(
        policy=name,
        makespan_s=makespan,
        trajectories=len(records),
        failed=sum(record.status == "failed" for record in records),
        output_tokens=sum(sum(record.loss_mask) for record in records),
        latencies_s=sorted(record.timings.total_s for record in records),
        migrations=migrations,
        bucket_moves=bucket_moves,
        gpu_busy_s=busy,
        gpus=fleet.gpus,
        occupancy=occupancy,
        reasons=reasons,
        preemptions=preemptions,
        fitted=fitted,
        guess=guess_of(policy, truth) if truth is not None else None,
        straggler=straggler_of(policy, records, truth) if truth is not None else None,
    )


def straggler_of(
    policy: Scheduler, records: list[TrajectoryRecord], truth: Truth
) -> Straggler | None:
    """The trajectory that finished last, and the policy's decisions on its calls."""
    last = max(records, key=lambda record: record.timings.total_s, default=None)
    if last is None or last.id not in truth.turns:
        return None
    total = truth.output_tokens(last.id)
    decisions = policy.decisions if isinstance(policy, RoutedPolicy) else ()
    calls = [
        Call(
            d.time,
            d.turn,
            d.to_instance,
            d.reason,
            d.expected,
            total - d.generated,
            d.expected_upper,
        )
        for d in decisions
        if d.trajectory_id == last.id
    ]
    timings = last.timings
    return Straggler(last.id, timings.total_s, timings.generation_s, timings.tool_s, total, calls)


def guess_of(policy: Scheduler, truth: Truth) -> Guess | None:
    """``policy``'s remaining-output estimates at its logged decisions against
    ``truth``; None for a policy that does not estimate, or knows (an oracle)."""
    if not isinstance(policy, RoutedPolicy) or policy.needs_truth:
        return None
    ratios, unseen = [], []
    for decision in policy.decisions:
        if decision.expected is None or decision.trajectory_id not in truth.turns:
            continue
        left = truth.output_tokens(decision.trajectory_id) - decision.generated
        if left <= 0:
            continue
        ratios.append(max(decision.expected, 1.0) / left)
        unseen.append(truth.tool_s_left(decision.trajectory_id, decision.generated))
    if not ratios:
        return None
    off = sum(not 0.5 <= ratio <= 2.0 for ratio in ratios) / len(ratios)
    return Guess(len(ratios), median(ratios), off, fmean(unseen))


def _bucket_occupancy(
    timelines: dict[str, Timeline], bucket_of: dict[str, str], buckets: list[str]
) -> dict[str, Timeline]:
    """Sequences running in each bucket over time (sum of its instances' timelines)."""
    result: dict[str, Timeline] = {}
    for bucket in buckets:
        changes: list[tuple[float, int]] = []
        for name, timeline in timelines.items():
            if bucket_of[name] != bucket:
                continue
            level = 0
            for moment, running in timeline:
                changes.append((moment, running - level))
                level = running
        changes.sort()
        total, merged = 0, [(0.0, 0)]
        for moment, delta in changes:
            total += delta
            if moment == merged[-1][0]:
                merged[-1] = (moment, total)
            else:
                merged.append((moment, total))
        result[bucket] = merged
    return result


def quantile(ordered: list[float], q: float) -> float:
    if not ordered:
        return 0.0
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def result_of(
    run: PolicyRun, bound: LowerBound, oracle: float | None, cmlfq: float | None
) -> PolicyResult:
    makespan = run.makespan_s
    p50 = quantile(run.latencies_s, 0.5)
    p99 = quantile(run.latencies_s, 0.99)
    idle = 1.0 - run.gpu_busy_s / (run.gpus * makespan) if makespan > 0 else 0.0
    return PolicyResult(
        policy=run.policy,
        throughput_traj_s=run.trajectories / makespan if makespan else 0.0,
        throughput_tok_s=run.output_tokens / makespan if makespan else 0.0,
        makespan_s=makespan,
        idle_frac=idle,
        p50_latency_s=p50,
        p99_latency_s=p99,
        tail_ratio=p99 / p50 if p50 else 0.0,
        migrations=run.migrations,
        bucket_moves=run.bucket_moves,
        vs_oracle=makespan / oracle if oracle else None,
        vs_bound=makespan / bound.seconds if bound.seconds else 0.0,
        vs_cmlfq=makespan / cmlfq if cmlfq else None,
        trajectories=run.trajectories,
        failed=run.failed,
        preemptions=run.preemptions,
        guess_ratio_median=run.guess.tokens_ratio_median if run.guess else None,
        guess_off_2x=run.guess.tokens_off_2x if run.guess else None,
        tool_s_unseen=run.guess.tool_s_unseen if run.guess else None,
    )
