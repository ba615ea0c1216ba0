"""What no split of the workers and no routing can beat on ``libra bench alloc``'s run:
the yardstick its 2x goal is read against (:func:`step_bounds`)."""

from __future__ import annotations

from libra.alloc import TrainCost
from libra.bench._alloc import ConfigRun
from libra.bench._alloc_demand import script_tokens
from libra.bench._alloc_settings import Settings
from libra.bench._alloc_strategies import ALLOWED_TPS
from libra.bench._sched_bound import decode_demand, full_batch_throughput, longest_alone_s
from libra.emulation import EmulatedTrainer
from libra.emulation.workloads import ScriptBook


def step_bounds(settings: Settings, run: ConfigRun) -> list[float]:
    """Per step of ``run``, what no split of the workers and no routing can beat, priced
    with the emulated truth (without its jitter and prefill interference):

    - the longest trajectory alone on its fastest instance size, tools included;
    - training the previous step's tokens on the most workers that help;
    - all the step's work at its best efficiency, spread over every worker with none
      ever idle: decode in full batches on the instance size that spends the fewest
      worker-seconds a token, training on the fewest workers its state fits on.

    The step takes the largest of the three, plus the weight broadcast. Prefill, moves
    and restarts are left out, which only lowers it."""
    fleet = settings.fleet.model_copy(update={"truth": settings.serving})
    tps = [tp for tp in ALLOWED_TPS if fleet.kv_capacity_tokens(tp) > 0]
    trainer = EmulatedTrainer(fleet.gpu, fleet.model, settings.training)
    fits = TrainCost(fleet.gpu, fleet.model.parameters).fits
    sizes = [workers for workers in range(1, settings.gpus) if fits(workers)]
    book = ScriptBook(settings.workload, settings.seed)
    first = settings.workload.rollout.history_steps
    trained = sum(script_tokens(script) for script in book.step(first - 1))
    bounds = []
    for index, step in enumerate(run.steps):
        scripts = book.step(first + index)
        demand = decode_demand(scripts, fleet)
        decode_worker_s = demand.tokens * min(
            tp / full_batch_throughput(fleet, tp, demand) for tp in tps
        )
        train_worker_s = min(w * trainer.formula_s(trained, w) for w in sizes)
        floors = (
            longest_alone_s(scripts, fleet, tps),
            min(trainer.formula_s(trained, w) for w in sizes),
            (decode_worker_s + train_worker_s) / settings.gpus,
        )
        bounds.append(max(floors) + settings.serving.sync_s(fleet.model))
        trained = step.train_tokens
    return bounds
