"""The cost models: datasheet priors, the roofline makespan, the memory check, and the fit
converging to a hidden truth from a prior off by tens of percent."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from libra.alloc import A100, A800, H100, H200, PRESETS, RolloutCost, TrainCost
from libra.alloc._cost import train_tokens
from libra.alloc._protocol import CallTiming, Demand, StepTiming, decode_context
from libra.fleet import Gpu, Model, Roofline

QWEN3_14B = Model(name="qwen3-14b", parameters=14.8e9, layers=40, kv_heads=8, head_dim=128)


def _hidden_truth() -> Roofline:
    """The 'real' machine: bandwidth 30% under the datasheet's, MFU 30% over the prior's,
    an all-reduce eight times dearer. The models never read it."""
    gpu = A100.model_copy(
        update={"bandwidth_utilization": 0.6, "prefill_mfu": 0.72, "decode_mfu": 0.72,
                "allreduce_s": 40e-6}
    )  # fmt: skip
    return Roofline(gpu, QWEN3_14B)


def _true_call_seconds(truth: Roofline, call: CallTiming) -> float:
    """Step by step (the context grows each step), unlike the models' mid-decode average."""
    cost = truth.step_cost(call.tp)
    prefill = cost.prefill_time(call.prompt_tokens - call.cached_tokens)
    batch = call.concurrent
    decode = sum(
        cost.step_time(batch, batch * (call.prompt_tokens + i)) for i in range(call.new_tokens)
    )
    return prefill + decode


def _calls(rng: random.Random, tp: int, count: int) -> list[CallTiming]:
    calls = []
    for _ in range(count):
        prompt = rng.randint(500, 12000)
        call = CallTiming(
            instance=f"tp{tp}", tp=tp, prompt_tokens=prompt, cached_tokens=rng.randint(0, prompt),
            new_tokens=rng.randint(20, 1500), seconds=0.0, concurrent=rng.randint(1, 96),
        )  # fmt: skip
        calls.append(call)
    return calls


def _relative_errors(model: RolloutCost, truth: Roofline, calls: list[CallTiming]) -> list[float]:
    return [abs(model.predict_call(call) / _true_call_seconds(truth, call) - 1) for call in calls]


def test_presets_carry_the_datasheet_figures() -> None:
    assert set(PRESETS) == {"A100", "A800", "H100", "H200"}
    assert A100.hbm_bytes_per_s == A800.hbm_bytes_per_s == 2.0e12
    assert H100.dense_bf16_flops == H200.dense_bf16_flops == 990e12
    assert H200.hbm_bytes_per_s > H100.hbm_bytes_per_s > A100.hbm_bytes_per_s


def test_the_rollout_fit_converges_from_a_prior_off_by_tens_of_percent() -> None:
    truth, rng = _hidden_truth(), random.Random(0)
    model = RolloutCost(Roofline(A100, QWEN3_14B))
    held_out = _calls(rng, 1, 20) + _calls(rng, 2, 20)
    assert max(_relative_errors(model, truth, held_out)) > 0.2  # the prior is well off
    for call in _calls(rng, 1, 8) + _calls(rng, 2, 8):
        seconds = _true_call_seconds(truth, call)
        model.observe(replace(call, seconds=seconds))
    errors = _relative_errors(model, truth, held_out)
    assert sum(errors) / len(errors) < 0.03
    assert max(errors) < 0.1  # overhead and all-reduce ride the bytes term: a structural gap


def test_a_tp_without_observations_borrows_the_pooled_fit() -> None:
    truth, rng = _hidden_truth(), random.Random(1)
    model = RolloutCost(Roofline(A100, QWEN3_14B))
    for call in _calls(rng, 1, 8):
        model.observe(replace(call, seconds=_true_call_seconds(truth, call)))
    assert model.corrections(4) is model.corrections(2)  # both pooled
    assert model.corrections(4).observations == 8
    assert model.corrections(1).values != (1.0,) * 3


def test_the_makespan_falls_with_more_instances_and_is_bounded_by_the_longest() -> None:
    model = RolloutCost(Roofline(A100, QWEN3_14B))
    workload = Demand(
        64, output_tokens=(200, 400, 800, 8000), context_tokens=(1200, 1400, 1800, 9000)
    )
    one, four = model.makespan((1,), workload), model.makespan((1, 1, 1, 1), workload)
    assert four < one
    longest_alone = model.makespan((1,), Demand(1, (8000,), (9000,)))
    assert four >= longest_alone


def test_kv_capacity_bounds_the_batch() -> None:
    model = RolloutCost(Roofline(A100, QWEN3_14B), max_num_seqs=256)
    long = Demand(8, output_tokens=(30000,), context_tokens=(60000,))
    assert model.batch_cap(1, long) < model.batch_cap(4, long) <= 256
    assert model.batch_cap(1, Demand(8, (10,), (20,))) == 256


def _true_train_seconds(gpu: Gpu, tokens: int, workers: int) -> float:
    compute = tokens * 6 * QWEN3_14B.parameters / (workers * gpu.dense_bf16_flops * 0.28)
    comm = 3 * 2 * QWEN3_14B.parameters * (workers - 1) / workers / 280e9
    return compute + comm + 3.5


def test_the_training_fit_converges_from_a_prior_off_by_tens_of_percent() -> None:
    model, rng = TrainCost(A100, QWEN3_14B.parameters), random.Random(2)
    cases = [(rng.randint(200_000, 2_000_000), rng.choice([2, 4, 8, 16, 32])) for _ in range(30)]

    def error(tokens: int, workers: int) -> float:
        return abs(model.seconds(tokens, workers) / _true_train_seconds(A100, tokens, workers) - 1)

    assert max(error(*case) for case in cases) > 0.2
    for step, (tokens, workers) in enumerate(cases[:6]):
        truth = _true_train_seconds(A100, tokens, workers)
        model.observe(StepTiming(step, rollout_s=1.0, train_s=truth, train_tokens=tokens,
                                 train_workers=workers, rollout_workers=1))  # fmt: skip
    assert max(error(*case) for case in cases[6:]) < 0.03


def test_a_training_fit_at_one_worker_count_carries_to_another() -> None:
    """Two steps at 6 workers cannot tell the compute from the per-step constants apart:
    the fit corrects the term that dominates them, so the step on 4 workers, whose
    compute is half as long again, is predicted from it (not a constant inflated to
    explain what the compute missed)."""
    model = TrainCost(A100, QWEN3_14B.parameters)
    for step, tokens in enumerate((4_200_000, 4_900_000)):
        truth = _true_train_seconds(A100, tokens, 6)
        model.observe(StepTiming(step, rollout_s=1.0, train_s=truth, train_tokens=tokens,
                                 train_workers=6, rollout_workers=10))  # fmt: skip
    predicted = model.seconds(4_500_000, 4)
    assert predicted == pytest.approx(_true_train_seconds(A100, 4_500_000, 4), rel=0.02)


def test_training_state_must_fit_in_memory() -> None:
    model = TrainCost(A100, QWEN3_14B.parameters)
    assert not model.fits(1) and not model.fits(2)  # 237 GB of state
    assert model.fits(4) and model.fits(32)
    assert model.memory_per_worker(8) < model.memory_per_worker(4)


def test_the_longest_trajectorys_tools_are_on_the_critical_path() -> None:
    """Tool time the instances fill with other work costs nothing; the longest
    trajectory's waits for its tools bound the rollout from below."""
    model = RolloutCost(Roofline(A100, QWEN3_14B))
    outputs, contexts = (20_000, *[500] * 63), (40_000, *[4_000] * 63)
    bare = Demand(64, outputs, contexts)
    short_tools = Demand(64, outputs, contexts, tool_s=(0.0, *[5.0] * 63))
    long_tools = Demand(64, outputs, contexts, tool_s=(300.0, *[0.0] * 63))
    seconds = model.makespan((2, 1, 1), bare)
    assert model.makespan((2, 1, 1), short_tools) == seconds  # hidden behind the long one
    assert model.makespan((2, 1, 1), long_tools) >= 300.0 + model.longest_alone(2, bare)
    assert model.makespan((2, 1, 1), long_tools) > seconds


def test_a_longest_trajectory_sharing_every_batch_takes_longer_than_alone() -> None:
    """Under least-loaded routing the longest trajectory decodes in full batches: its
    chain, with its tools, is priced at the instance's mean batch, not alone."""
    outputs, contexts = (20_000, *[2_000] * 255), (40_000, *[6_000] * 255)
    workload = Demand(256, outputs, contexts, tool_s=(120.0, *[0.0] * 255))
    alone = RolloutCost(Roofline(A100, QWEN3_14B))
    in_batch = RolloutCost(Roofline(A100, QWEN3_14B), longest_decodes="in_batch")
    assert in_batch.makespan((1, 1), workload) > alone.makespan((1, 1), workload)
    # Its tools wait on top of its decode steps: the batched bound alone misses them.
    bare = replace(workload, tool_s=())
    assert in_batch.makespan((1, 1), workload) > in_batch.makespan((1, 1), bare)


def test_least_loaded_spreads_the_longest_trajectory_over_a_mixed_layout() -> None:
    """Least-loaded sends each turn wherever a call slot frees first, so a small instance
    beside a large one takes its share of the longest trajectory's turns: adding it helps
    the batched work, but the longest trajectory's chain, with its tools, slows."""
    outputs, contexts = (20_000, *[1_000] * 31), (40_000, *[3_000] * 31)
    workload = Demand(32, outputs, contexts, tool_s=(120.0, *[0.0] * 31))
    alone = RolloutCost(Roofline(A100, QWEN3_14B))
    in_batch = RolloutCost(Roofline(A100, QWEN3_14B), longest_decodes="in_batch")
    # With a lane of its own, the longest stays on the TP4: a TP1 beside it only helps.
    assert alone.makespan((4, 1), workload) <= alone.makespan((4,), workload)
    # Spread, its turns on the TP1 decode several times slower than on the TP4.
    assert in_batch.makespan((4, 1), workload) > in_batch.makespan((4,), workload)
    # Between its chain alone on the TP4 and its chain alone on the TP1.
    assert in_batch.makespan((4, 1), workload) < in_batch.makespan((1,), workload)


def test_a_multi_turn_trajectory_is_decoded_on_the_contexts_its_turns_saw() -> None:
    """Each turn's tokens are decoded on the context before that turn: a trajectory whose
    tools return long outputs between its turns reads less KV cache per sampled token
    than its end context says, and is priced so."""
    mask = [0] * 1_000 + [1] * 100 + [0] * 10_000 + [1] * 100
    assert decode_context(mask) == (1_049.5 + 11_149.5) / 2
    assert decode_context([0, 0, 0]) == 0.0
    model = RolloutCost(Roofline(A100, QWEN3_14B))
    outputs, contexts = (200,) * 64, (len(mask),) * 64
    at_end = Demand(64, outputs, contexts)
    per_turn = replace(at_end, decode_context_tokens=(decode_context(mask),) * 64)
    assert model.makespan((1,), per_turn) < model.makespan((1,), at_end)
    # Unknown, a trajectory's tokens are priced on its end context less half its output.
    at_end_known = replace(at_end, decode_context_tokens=(len(mask) - 100.0,) * 64)
    assert model.makespan((1,), at_end_known) == model.makespan((1,), at_end)


def test_recent_steps_pooled_all_count() -> None:
    """A workload of two steps pooled (twice a step's samples) is priced on both: the
    newer step's longer trajectories are not left out because the older one came first."""
    older, newer = [1_000] * 32, [4_000] * 32
    outputs = (*older, *newer)
    contexts = tuple(out + 2_000 for out in outputs)
    pooled = Demand(32, outputs, contexts)
    assert train_tokens(pooled) == 32 * (3_000 + 6_000) // 2
    model = RolloutCost(Roofline(A100, QWEN3_14B))
    assert model.longest_alone(1, pooled) == model.longest_alone(
        1, Demand(32, outputs[32:], contexts[32:])
    )
    only_older = Demand(32, outputs[:32], contexts[:32])
    assert model.makespan((1, 1), only_older) < model.makespan((1, 1), pooled)


def _exact(model: RolloutCost, timing: CallTiming) -> CallTiming:
    """``timing`` taking just what the prior says: observing it leaves the fit at 1."""
    return replace(timing, seconds=model.predict_call(timing))


def test_least_loaded_queues_on_a_small_instance_what_its_cache_cannot_hold() -> None:
    """Least-loaded keeps as many calls in flight on a TP1 as on a TP4: with many in
    flight the TP1 runs what its KV cache holds and the rest wait, the longest
    trajectory's turns there too. The calls in flight are what the run measured."""
    outputs, contexts = (20_000, *[1_000] * 63), (40_000, *[12_000] * 63)
    workload = Demand(64, outputs, contexts)
    crowded = RolloutCost(Roofline(A100, QWEN3_14B), longest_decodes="in_batch")
    quiet = RolloutCost(Roofline(A100, QWEN3_14B), longest_decodes="in_batch")
    for model, in_flight in ((crowded, 32), (quiet, 2)):
        for name, tp in (("a", 4), ("b", 1)):
            call = CallTiming(name, tp, 8_000, 0, 500, 0.0, in_flight)
            model.observe(_exact(model, call))
    assert crowded.in_flight(workload) == 64 and quiet.in_flight(workload) == 4
    assert crowded.corrections(1).values == pytest.approx((1.0, 1.0, 1.0))
    assert crowded.makespan((4, 1), workload) > quiet.makespan((4, 1), workload)
    # Before any call, every trajectory counts as in flight.
    fresh = RolloutCost(Roofline(A100, QWEN3_14B), longest_decodes="in_batch")
    assert fresh.in_flight(workload) == 64
