"""An emulated cluster: workers whose serving instances are in-process emulated vLLM
servers behind one :class:`FleetApp`, and whose training is an :class:`EmulatedTrainer`.

It is what the allocation pool drives (structurally a ``libra.alloc.Cluster``: the
emulator never imports the allocation layer). Starting an instance costs the seconds a
real server takes to load its weights; training operations cost what the trainer's truth
says. Faults are injected per worker: an instance start that fails, a join that fails
mid-fetch, a join that hangs until whoever drives it gives up. Time passes by
``anyio.sleep``, so a virtual clock runs it all in an instant.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio
from pydantic import Field, NonNegativeFloat

from libra.config import Section
from libra.emulation._app import create_app
from libra.emulation._config import EmulatorConfig
from libra.emulation._fleet_app import FleetApp
from libra.emulation._latency import LatencyModel
from libra.emulation._scripts import Script
from libra.emulation._training import EmulatedTrainer


class ClusterTruth(Section):
    """What the emulated cluster's own operations really cost."""

    start_s: NonNegativeFloat = Field(
        30.0, description="seconds from launching a server to its first answer"
    )
    stop_s: NonNegativeFloat = Field(0.0, description="seconds a server takes to exit")


class InstanceStartFailed(RuntimeError):
    """The emulated cluster was told this start fails (a fault a test injects)."""


class EmulatedCluster:
    """``workers`` emulated accelerators: instances served in-process, training emulated.

    ``latency_for_tp`` gives an instance's timing from its TP; ``server`` is the template
    of every instance's settings (model name, script settings, context length), whose
    latency is replaced by it.
    """

    def __init__(
        self,
        workers: int,
        trainer: EmulatedTrainer,
        latency_for_tp: Callable[[int], LatencyModel],
        *,
        server: EmulatorConfig | None = None,
        script: Script | None = None,
        truth: ClusterTruth | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError("a cluster has at least one worker")
        self._workers = workers
        self.trainer = trainer
        self.latency_for_tp = latency_for_tp
        self.server = server or EmulatorConfig()
        self.script = script
        self.truth = truth or ClusterTruth()
        self.fleet = FleetApp()
        self.placement: dict[str, tuple[int, ...]] = {}  # instance -> its workers
        self.failing_starts: set[int] = set()  # the next start on any of these fails
        self.hanging_joins: set[int] = set()  # the next join of these never ends

    @property
    def workers(self) -> int:
        return self._workers

    # ---------------------------------------------------------------- faults

    def fail_next_start(self, worker: int) -> None:
        self.failing_starts.add(self._checked(worker))

    def fail_next_join(self, worker: int) -> None:
        """Its next join fails half-way through fetching the training state."""
        self.trainer.failing.add(self._checked(worker))

    def hang_next_join(self, worker: int) -> None:
        """Its next join stalls while fetching the state (a peer that never answers)."""
        self.hanging_joins.add(self._checked(worker))

    # ---------------------------------------------------------------- serving

    async def start_instance(self, name: str, workers: tuple[int, ...]) -> str:
        self._check_free(name, workers)
        self.placement[name] = workers  # reserved while it loads
        try:
            await anyio.sleep(self.truth.start_s)
            failing = self.failing_starts.intersection(workers)
            if failing:
                self.failing_starts -= failing
                raise InstanceStartFailed(f"{name} on workers {workers} failed to start")
            config = self.server.model_copy(update={"latency": self.latency_for_tp(len(workers))})
            self.fleet.add(name, create_app(config, self.script))
        except BaseException:
            del self.placement[name]
            raise
        return f"http://{name}"

    async def stop_instance(self, name: str) -> None:
        if name in self.fleet.apps:
            self.fleet.remove(name)
        self.placement.pop(name, None)
        await anyio.sleep(self.truth.stop_s)

    def serving_workers(self) -> set[int]:
        return {worker for workers in self.placement.values() for worker in workers}

    # ---------------------------------------------------------------- training

    async def fetch_state(self, worker: int) -> None:
        if worker in self.hanging_joins:
            self.hanging_joins.discard(worker)
            await anyio.sleep_forever()
        await self.trainer.fetch_state(worker)

    async def zero_sync(self, worker: int) -> None:
        await self.trainer.zero_sync(worker)

    async def activate(self, worker: int) -> None:
        await self.trainer.activate(worker)

    async def leave_training(self, worker: int) -> None:
        await self.trainer.leave(worker)

    # ---------------------------------------------------------------- checks

    def _checked(self, worker: int) -> int:
        if not 0 <= worker < self._workers:
            raise ValueError(f"no worker {worker} in a cluster of {self._workers}")
        return worker

    def _check_free(self, name: str, workers: tuple[int, ...]) -> None:
        if not workers:
            raise ValueError("an instance needs at least one worker")
        for worker in workers:
            self._checked(worker)
        if name in self.placement:
            raise ValueError(f"instance {name!r} is running already")
        busy = (self.serving_workers() | self.trainer.active).intersection(workers)
        if busy:
            raise ValueError(f"workers {sorted(busy)} are busy: {name!r} cannot start on them")
