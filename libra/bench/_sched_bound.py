"""The scheduling benchmark's lower bound, which no policy can beat: the larger of the
longest trajectory run alone on its fastest instance (decode, prefill of new tokens and
tool time) and the step's decode work at the fleet's full-batch throughput, both priced
with what the servers really play. ``libra bench alloc``'s bound reuses its pieces."""

from __future__ import annotations

from dataclasses import dataclass

from libra.bench._sched_fleet import FleetFile
from libra.bench._sched_history import tool_seconds
from libra.bench._sched_report import LowerBound
from libra.emulation.workloads import TrajectoryScript


def lower_bound(scripts: list[TrajectoryScript], fleet: FleetFile) -> LowerBound:
    """See the module docstring. Template tokens are left out, which only lowers it."""
    tps = sorted({plan.tp for plan in fleet.instances})
    demand = decode_demand(scripts, fleet)
    throughput = sum(full_batch_throughput(fleet, plan.tp, demand) for plan in fleet.instances)
    return LowerBound(
        chain_s=longest_alone_s(scripts, fleet, tps),
        work_s=demand.tokens / throughput,
    )


@dataclass(frozen=True)
class DecodeDemand:
    """A step's decode work: tokens sampled, the mean context they are sampled at, and
    the mean KV a call holds."""

    tokens: float
    mean_context: float
    mean_reservation: float


def decode_demand(scripts: list[TrajectoryScript], fleet: FleetFile) -> DecodeDemand:
    decode_tokens = weighted_context = 0.0
    reservations = 0.0
    # KV a call holds on average: its whole reply when reserved up front, half of it when
    # taken a token at a time (vLLM's on-demand allocation).
    held = 0.5 if fleet.serving.kv_allocation == "on_demand" else 1.0
    calls = 0
    for script in scripts:
        context = float(script.prompt_tokens)
        for turn in script.turns:
            decode_tokens += turn.output_tokens
            weighted_context += turn.output_tokens * (context + turn.output_tokens / 2)
            reservations += context + turn.output_tokens * held
            calls += 1
            context += turn.output_tokens + turn.output_chars
    return DecodeDemand(
        decode_tokens,
        weighted_context / max(decode_tokens, 1.0),
        reservations / max(calls, 1),
    )


def longest_alone_s(scripts: list[TrajectoryScript], fleet: FleetFile, tps: list[int]) -> float:
    """The slowest trajectory, each run alone on its fastest instance size of ``tps``."""
    return max(min(_alone(s, fleet, tp) for tp in tps) for s in scripts)


def _alone(script: TrajectoryScript, fleet: FleetFile, tp: int) -> float:
    cost = fleet.latency(tp)  # what the servers really play
    seconds, context, fresh = 0.0, float(script.prompt_tokens), float(script.prompt_tokens)
    for turn in script.turns:
        n = turn.output_tokens
        seconds += cost.prefill_time(fresh)
        first = cost.step_time(1, context)
        seconds += n * first + cost.step_per_ctx_token_s * n * (n - 1) / 2
        seconds += tool_seconds(turn, script.tool_timeout_s)
        context += n + turn.output_chars
        fresh = turn.output_chars
    return seconds


def full_batch_throughput(fleet: FleetFile, tp: int, demand: DecodeDemand) -> float:
    """Tokens/s of a TP``tp`` instance running as many sequences as fit."""
    cost = fleet.latency(tp)
    fits = int(cost.kv_capacity_tokens // max(demand.mean_reservation, 1.0))
    batch = max(1, min(fleet.serving.max_num_seqs, fits))
    return batch / cost.step_time(batch, batch * demand.mean_context)
