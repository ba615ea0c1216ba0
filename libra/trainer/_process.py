"""The trainer's processes, and the channel the loop drives them through.

The rollout's event loop never trains: :class:`TrainerProcess` spawns the FSDP ranks
(``world_size`` processes, set up as torchrun would: gloo on CPU, NCCL on CUDA with one
GPU per rank, so a GPU run is the same code with ``world_size`` = the GPUs given to
training) and sends them commands through a pipe. Rank 0 reads each command, broadcasts
it to the other ranks, every rank runs it (the commands are collective), and rank 0
answers. Commands and answers are small picklable objects: a :class:`Batch` to train on,
a version to export, token ids to score (the logprob probe), a checkpoint to write.

**Loss scaling.** ``MicroBatch.loss`` is a weighted sum whose sum over *all* of a batch's
micro-batches is the batch's loss; :meth:`FSDPTrainer.accumulate` divides each
micro-batch's loss by this rank's micro-batch count, and FSDP's gradient reduction
averages over ranks. So each micro-batch's loss is multiplied by ``count * world_size``:
the gradient is then that of the batch's loss, however it is split.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, Self, TypeVar

import anyio

from libra.trainer._batch import Batch, MicroBatch
from libra.trainer._config import GRPOConfig
from libra.trainer._fsdp import FSDPTrainer, StepMetrics, TrainerConfig
from libra.trainer._head import forward_logprobs
from libra.trainer._loss import LossMetrics
from libra.trainer._spawn import die_with_parent, spawn
from libra.trainer._weights import export_weights

if TYPE_CHECKING:
    import torch
    from torch import nn


class TrainerError(RuntimeError):
    """The trainer's processes failed; the message holds rank 0's traceback."""


@dataclass(frozen=True, slots=True)
class TrainResult:
    """One optimizer step: the trainer's metrics and the GRPO loss's, over the batch."""

    step: StepMetrics
    loss: dict[str, float] = field(default_factory=dict)


# ------------------------------------------------------------------------ commands


@dataclass(frozen=True, slots=True)
class Train:
    batch: Batch
    grpo: GRPOConfig
    temperature: float

    def run(self, trainer: FSDPTrainer) -> TrainResult:
        import torch.distributed as dist

        device, world = trainer.dist.device, trainer.dist.world_size
        micro = [m.to(device) for m in self.batch.for_rank(trainer.dist.rank)]
        collected: list[LossMetrics] = []
        loss_fn = partial(
            grpo_micro_batch_loss,
            grpo=self.grpo,
            temperature=self.temperature,
            scale=float(len(micro) * world),
            out=collected,
            chunk_tokens=trainer.config.logprob_chunk_tokens,
        )
        step = trainer.step(micro, loss_fn)
        gathered: list[list[dict[str, float]]] = [[] for _ in range(world)]
        dist.all_gather_object(gathered, [m.as_floats() for m in collected])
        return TrainResult(step, combine_loss_metrics([m for rank in gathered for m in rank]))


@dataclass(frozen=True, slots=True)
class Export:
    run_dir: Path
    version: int
    dtype: str | None
    adapter: bool = False  # a LoRA trainer's adapters alone (else merged into the weights)

    def run(self, trainer: FSDPTrainer) -> Path:
        return export_weights(
            trainer, self.run_dir, self.version, dtype=self.dtype, adapter=self.adapter
        )


@dataclass(frozen=True, slots=True)
class Logprobs:
    """The trainer's logprob of each of ``token_ids`` after the first, at temperature 1."""

    token_ids: tuple[int, ...]

    def run(self, trainer: FSDPTrainer) -> list[float]:
        import torch

        ids = torch.tensor([self.token_ids], dtype=torch.long)
        values: list[float] = trainer.logprobs(ids)[0].tolist()
        return values


R_co = TypeVar("R_co", covariant=True)
T = TypeVar("T")


class TrainerCommand(Protocol[R_co]):
    """What the trainer's processes run: picklable, collective (every rank runs it with
    its own trainer), rank 0's result is the answer. ``Train``, ``Export`` and
    ``Logprobs`` are the loop's; others (a checkpoint's write or restore) plug in the same way."""

    def run(self, trainer: FSDPTrainer) -> R_co: ...


class TrainerWorld(Protocol):
    """One world of FSDP ranks as the loop drives it, whatever runs them: processes
    here (:class:`TrainerProcess`) or Ray actors (``libra.workers._ray_trainer.RayTrainer``)."""

    @property
    def world_size(self) -> int: ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None: ...

    async def ready(self) -> None: ...

    async def call(self, command: TrainerCommand[T]) -> T: ...

    async def call_sized(self, make: Callable[[int], TrainerCommand[T] | None]) -> T | None: ...

    async def watch(self) -> None: ...


def grpo_micro_batch_loss(
    model: nn.Module,
    micro: MicroBatch,
    *,
    grpo: GRPOConfig,
    temperature: float,
    scale: float,
    out: list[LossMetrics],
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """``micro``'s share of the batch's GRPO loss, times ``scale`` (see the module)."""
    logprobs = micro_batch_logprobs(model, micro, temperature, chunk_tokens)
    loss, metrics = micro.loss(logprobs, grpo)
    out.append(metrics)
    return loss * scale


def micro_batch_logprobs(
    model: nn.Module, micro: MicroBatch, temperature: float = 1.0, chunk_tokens: int | None = None
) -> torch.Tensor:
    """The model's forward pass over ``micro`` (packed or padded, as its ids and masks
    say): the logprobs of its targets at ``temperature``, through the LM head
    ``chunk_tokens`` positions at a time (``libra.trainer._head``)."""
    return forward_logprobs(
        model,
        micro.targets,
        temperature=temperature,
        chunk_tokens=chunk_tokens,
        input_ids=micro.input_ids,
        position_ids=micro.position_ids,
        attention_mask=micro.attention_mask,
        use_cache=False,
    )


_SUMMED = ("policy_loss", "kl_loss", "tokens", "gap_tokens")
_LOWEST, _HIGHEST = ("ratio_min",), ("ratio_max", "gap_max")
# The count each mean is over: the gap's is over the current tokens only.
_MEAN_OVER = {"gap_mean": "gap_tokens"}


def combine_loss_metrics(parts: Sequence[dict[str, float]]) -> dict[str, float]:
    """Micro-batches' loss metrics as the whole batch's: losses and counts add up,
    extremes are extremes, the rest are means weighted by the tokens they are over."""
    combined: dict[str, float] = {}
    for name in parts[0] if parts else ():
        count = _MEAN_OVER.get(name, "tokens")
        counted = [part for part in parts if part[count] > 0]
        if name in _SUMMED:
            combined[name] = sum(part[name] for part in parts)
        elif not counted:
            combined[name] = 0.0
        elif name in _LOWEST:
            combined[name] = min(part[name] for part in counted)
        elif name in _HIGHEST:
            combined[name] = max(part[name] for part in counted)
        else:
            total = sum(part[count] for part in counted)
            combined[name] = sum(part[name] * part[count] for part in counted) / total
    return combined


# ------------------------------------------------------------------- the processes


def _trainer_main(
    parent: int,
    world_size: int,
    conn: Connection,
    reports: Connection,
    model_dir: Path,
    config: TrainerConfig,
    cores: tuple[tuple[int, ...], ...] | None = None,
) -> None:
    """The trainer's process: it dies with the loop, and its ranks die with it. When a
    rank ends abnormally it stops the others, and says which on ``reports``."""
    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    die_with_parent(parent)
    try:
        # Forked: this process was spawned for them, runs one thread and never touched a
        # device (CUDA included), and its ranks skip importing torch again (~2.5 s each
        # trainer start and stop on 2 cores).
        spawn(world_size, _serve_rank, conn, model_dir, config, cores, start_method="fork")
    except ProcessExitedException as exited:
        how = exited.signal_name or f"exit code {exited.exit_code}"
        reports.send(RankExit(exited.error_index, f"died ({how})", died=True))
        raise SystemExit(1) from None
    except ProcessRaisedException as raised:
        last = str(raised).strip().splitlines()[-1:] or ["?"]
        reports.send(RankExit(raised.error_index, f"failed: {last[0]}", died=False))
        raise SystemExit(1) from None


@dataclass(frozen=True, slots=True)
class RankExit:
    """What the trainer's process reports when a rank ends before it is told to:
    ``died``, killed or exited without a Python exception (the command it ran never
    answered); else it raised, and rank 0's answer holds the traceback."""

    rank: int
    how: str
    died: bool

    def __str__(self) -> str:
        return f"trainer rank {self.rank} {self.how}"


def _serve_rank(
    conn: Connection,
    model_dir: Path,
    config: TrainerConfig,
    cores: tuple[tuple[int, ...], ...] | None = None,
) -> None:
    """One rank: load the model, then run commands until told to stop (None) or the
    loop's end of the pipe closes. With ``cores`` (one set per rank) the rank runs on its
    own set only, with as many torch threads."""
    import torch.distributed as dist

    if cores is not None:
        mine = cores[int(os.environ["RANK"])]
        os.sched_setaffinity(0, mine)
        config = config.model_copy(update={"cpu_threads": len(mine)})
    trainer = FSDPTrainer(model_dir, config)
    main = trainer.dist.is_main
    if main:
        conn.send(("ready", None))
    while True:
        box: list[TrainerCommand[Any] | None] = [_receive(conn) if main else None]
        dist.broadcast_object_list(box, src=0)
        command = box[0]
        if command is None:
            return
        try:
            result = command.run(trainer)
        except Exception:
            if main:
                conn.send(("error", traceback.format_exc()))
            raise
        if main:
            conn.send(("ok", result))


def _receive(conn: Connection) -> TrainerCommand[Any] | None:
    try:
        command: TrainerCommand[Any] | None = conn.recv()
    except EOFError:  # the loop is gone
        return None
    return command


# How long a failed command's answer waits for the trainer's process to say why it ended.
_REPORT_WAIT_S = 30.0


class TrainerProcess:
    """The FSDP ranks, in processes of their own, driven from the event loop::

    async with TrainerProcess(model_dir, config, world_size=1) as trainer:
        await trainer.ready()  # optional: the first call waits for it too
        result = await trainer.call(Train(batch, grpo, temperature))

    A rank that dies (killed, or out of memory) takes the others down with it (the
    trainer's process stops them) and every waiter learns it at once: :meth:`call`, and
    :meth:`watch`, which a loop runs beside its work so that a death between two calls
    stops the run too. Both raise :class:`TrainerError` with ``trainer rank N died ...``.
    """

    def __init__(
        self,
        model_dir: Path,
        config: TrainerConfig,
        *,
        world_size: int = 1,
        cores: Sequence[tuple[int, ...]] | None = None,
    ):
        """``cores``: each rank's CPU cores (one set per rank), or None: not pinned."""
        if cores is not None and len(cores) != world_size:
            raise ValueError(f"{len(cores)} core sets for {world_size} ranks")
        self.model_dir, self.config, self.world_size = model_dir, config, world_size
        pinned = tuple(tuple(ranks) for ranks in cores) if cores is not None else None
        context = multiprocessing.get_context("spawn")
        self._conn, child = context.Pipe()
        self._reports, reporter = context.Pipe(duplex=False)
        # Not a daemon: the ranks are its children. It ends when rank 0 does, which ends
        # when this end of the pipe says stop or closes.
        self._process = context.Process(
            target=_trainer_main,
            args=(os.getpid(), world_size, child, reporter, model_dir, config, pinned),
            name="libra-trainer",
        )
        self._child, self._reporter = child, reporter
        self._ready = False
        self._exit: RankExit | None = None
        # One command at a time on the pipe: a restarted server's export (the weights a
        # broadcast sent) may be asked for while a step trains.
        self._calling = anyio.Lock()

    async def __aenter__(self) -> TrainerProcess:
        self._process.start()
        self._child.close()
        self._reporter.close()
        return self

    async def ready(self) -> None:
        """Wait until every rank has loaded and sharded the model."""
        if not self._ready:
            await self._answer()
            self._ready = True

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # Left on a TrainerError the ranks are not asked to stop (a hung one never
        # would): the trainer's process is ended, and its ranks die with it.
        with anyio.CancelScope(shield=True):
            asked = exc_type is None or not issubclass(exc_type, TrainerError)
            if asked:
                with contextlib.suppress(BrokenPipeError, OSError):
                    self._conn.send(None)
            self._conn.close()
            if asked:
                await anyio.to_thread.run_sync(self._process.join, 60.0)
            for end in (self._process.terminate, self._process.kill):
                if self._process.is_alive():
                    end()
                    await anyio.to_thread.run_sync(self._process.join, 10.0)
            self._reports.close()

    async def call(self, command: TrainerCommand[T]) -> T:
        """Run ``command`` on every rank; rank 0's result. Calls made at once run one after
        the other."""
        await self.ready()
        async with self._calling:
            try:
                await anyio.to_thread.run_sync(self._conn.send, command)
            except (BrokenPipeError, OSError):
                raise await self._ended() from None
            result: T = await self._answer()
        return result

    async def call_sized(self, make: Callable[[int], TrainerCommand[T] | None]) -> T | None:
        """Run the command ``make`` builds for this world's size (None: nothing)."""
        command = make(self.world_size)
        return None if command is None else await self.call(command)

    async def watch(self) -> None:
        """Return never while the ranks live; raise :class:`TrainerError` as soon as
        one dies. (A rank that raised is :meth:`call`'s to report, with its traceback.)"""
        await anyio.wait_readable(self._reports.fileno())
        error = await self._ended()
        if self._exit is None or self._exit.died:
            raise error
        await anyio.sleep_forever()

    async def _answer(self) -> Any:
        try:
            kind, value = await anyio.to_thread.run_sync(self._conn.recv, abandon_on_cancel=True)
        except (EOFError, OSError):  # closed, or reset by rank 0's death
            raise await self._ended() from None
        if kind == "error":
            # A rank that died mid-collective makes rank 0's command fail too: the death
            # is the cause to report, and the trainer's process reports it as it ends.
            ended = await self._ended()
            if self._exit is not None and self._exit.died:
                raise TrainerError(f"{ended}; rank 0 then failed:\n{value}")
            raise TrainerError(f"the trainer failed:\n{value}")
        return value

    async def _ended(self) -> TrainerError:
        """The error that says how the trainer's processes ended (they are ending: the
        report is sent before the trainer's process exits)."""
        if self._exit is None:
            await anyio.to_thread.run_sync(
                self._process.join, _REPORT_WAIT_S, abandon_on_cancel=True
            )
            self._exit = self._exit or self._read_report()
        if self._exit is not None:
            return TrainerError(str(self._exit))
        return TrainerError(f"the trainer's processes ended (exit code {self._process.exitcode})")

    def _read_report(self) -> RankExit | None:
        try:
            if self._reports.poll():
                report: RankExit = self._reports.recv()
                return report
        except (EOFError, OSError):
            pass
        return None
