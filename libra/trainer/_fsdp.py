"""The FSDP2 trainer: one process per rank, the same code on CPU (gloo) and GPU (NCCL).

Every rank loads the Hugging Face model folder, shards each decoder layer and then the
root with ``fully_shard`` on a one-dimensional device mesh, and steps an AdamW optimizer
over its shards. A rank is started either by ``torchrun`` (which sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT``) or by
``_spawn.spawn``, which sets the same variables for processes it starts itself: tests
and single-machine runs. Either way the trainer lives in its own processes, apart from
the event loop that drives rollouts.

Every call that runs the model (:meth:`FSDPTrainer.step`, :meth:`FSDPTrainer.accumulate`,
:meth:`FSDPTrainer.logprobs`, :meth:`FSDPTrainer.full_gradients`) is collective: all
ranks make it, with the same number of micro-batches.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from pydantic import Field

from libra._net import free_port
from libra.config import Section
from libra.engine import TrajectoryRecord
from libra.trainer._checkpoint import load_trainer_state, save_trainer_state
from libra.trainer._logprobs import (
    LogprobGap,
    LogprobsMode,
    records_logprob_gap,
    sequence_logprobs,
    server_logprob_temperature,
)
from libra.trainer._lora import LoRAConfig, add_adapters
from libra.trainer._shard import shard_model

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "DistContext",
    "FSDPTrainer",
    "GradientExchange",
    "StepMetrics",
    "TrainerConfig",
    "init_distributed",
    "split_by_tokens",
]

log = logging.getLogger("libra.trainer")

B = TypeVar("B")
T = TypeVar("T")

LossFn = Callable[["nn.Module", B], "torch.Tensor"]


class TrainerConfig(Section):
    """How the trainer optimizes (the model comes from its folder)."""

    lr: float = Field(default=1e-6, gt=0, description="AdamW's learning rate (after warmup)")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW's weight decay")
    betas: tuple[float, float] = Field(
        default=(0.9, 0.999),
        description="AdamW's betas: decay rates of the gradient's running averages (mean, square)",
    )
    warmup_steps: int = Field(default=0, ge=0, description="linear warmup, then constant lr")
    grad_clip: float | None = Field(default=1.0, gt=0, description="max grad norm; None: off")
    activation_checkpointing: bool = Field(
        default=False,
        description="recompute each layer's activations in the backward pass: less memory, "
        "more compute",
    )
    mixed_precision: Literal["auto", "bf16", "fp32"] = Field(
        default="auto", description="auto: bf16 compute with fp32 reductions on CUDA, fp32 on CPU"
    )
    backend: Literal["auto", "gloo", "nccl"] = Field(
        default="auto", description="auto: nccl where CUDA is available, else gloo"
    )
    logprob_chunk_tokens: int | None = Field(
        default=4096,
        ge=1,
        description="a micro-batch of more positions goes through the LM head this many at "
        "a time, each chunk recomputed in backward: its logits never exist whole (fp32, 4 "
        "bytes x vocabulary a position); None: all at once",
    )
    cpu_threads: int | None = Field(
        default=None, ge=1, description="torch threads per rank on CPU; None: cores / ranks"
    )
    lora: LoRAConfig = Field(
        default_factory=LoRAConfig,
        description="low-rank adapters (rank > 0): only they train (libra.trainer._lora)",
    )


@dataclass(frozen=True, slots=True)
class DistContext:
    """Where this rank stands in the process group."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


@dataclass(frozen=True, slots=True)
class StepMetrics:
    """One optimizer step, averaged over ranks where that means something."""

    step: int
    loss: float
    grad_norm: float
    lr: float
    micro_batches: int
    seconds: float


class GradientExchange(Protocol):
    """What one optimizer step does over a hybrid gradient group
    (``libra.workers._bridge.BridgedStep``)."""

    @property
    def core(self) -> bool:
        """Whether this rank is the core's: it holds optimizer state and steps."""
        ...

    def reduce_gradients(self, model: nn.Module) -> bool:
        """The group's gradient into this rank's; False: the step is off, on every core rank."""
        ...

    def send_parameters(self, model: nn.Module) -> bool:
        """After the core's step, the replicas take its parameters; False: that failed."""
        ...


def init_distributed(backend: Literal["auto", "gloo", "nccl"] = "auto") -> DistContext:
    """Join (or create) the default process group from torchrun's environment variables.

    Without them this is a group of one, so the same code runs in a plain process.
    """
    import torch
    import torch.distributed as dist

    rank = int(os.environ.setdefault("RANK", "0"))
    world_size = int(os.environ.setdefault("WORLD_SIZE", "1"))
    local_rank = int(os.environ.setdefault("LOCAL_RANK", "0"))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(free_port())
    chosen = _pick_backend(backend)
    if chosen == "nccl":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        dist.init_process_group(chosen, rank=rank, world_size=world_size)
    return DistContext(rank, world_size, local_rank, chosen, device)


def _pick_backend(backend: Literal["auto", "gloo", "nccl"]) -> str:
    import torch

    if backend != "auto":
        return backend
    return "nccl" if torch.cuda.is_available() else "gloo"


class FSDPTrainer:
    """A causal LM sharded with FSDP2, its AdamW optimizer and its LR schedule."""

    def __init__(self, model_dir: str | Path, config: TrainerConfig | None = None) -> None:
        import torch
        from torch.distributed.device_mesh import init_device_mesh

        self.config = config if config is not None else TrainerConfig()
        self.model_dir = Path(model_dir)
        self.dist = init_distributed(self.config.backend)
        if self.dist.device.type == "cpu":
            cores = os.cpu_count() or 1
            torch.set_num_threads(self.config.cpu_threads or max(1, cores // self.dist.world_size))
        mesh = init_device_mesh(self.dist.device.type, (self.dist.world_size,))
        self.model = _load_sharded(self.model_dir, self.config, mesh, self._compute_dtype())
        self.optimizer = torch.optim.AdamW(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=self.config.lr,
            betas=self.config.betas,
            weight_decay=self.config.weight_decay,
        )
        warmup = self.config.warmup_steps
        self.lr_schedule = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
        )
        self.steps_done = 0
        #: Rank 0's process group with the serving workers, for a collective weight
        #: transport (``libra.trainer._send``); None: the weights go by disk.
        self.weight_group: Any = None

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of forward and backward: bf16 under mixed precision, else fp32."""
        return self._compute_dtype()

    def _compute_dtype(self) -> torch.dtype:
        import torch

        wanted = self.config.mixed_precision
        if wanted == "bf16" or (wanted == "auto" and self.dist.device.type == "cuda"):
            return torch.bfloat16
        return torch.float32

    # ------------------------------------------------------------------ training

    def step(self, micro_batches: Sequence[B], loss_fn: LossFn[B]) -> StepMetrics:
        """Accumulate gradients over ``micro_batches``, clip, and take one optimizer step.

        The loss that is minimized is the mean of ``loss_fn`` over this rank's micro-batches,
        averaged over ranks: scale each loss inside ``loss_fn`` for another normalization.
        """
        started = time.perf_counter()
        loss = self.accumulate(micro_batches, loss_fn)
        grad_norm, lr = self.apply_gradients()
        metrics = StepMetrics(
            step=self.steps_done,
            loss=loss,
            grad_norm=grad_norm,
            lr=lr,
            micro_batches=len(micro_batches),
            seconds=time.perf_counter() - started,
        )
        if self.dist.is_main:
            log.info("train step %d: %s", metrics.step, metrics)
        return metrics

    def apply_gradients(self, exchange: GradientExchange | None = None) -> tuple[float, float]:
        """Clip and step the optimizer on the gradients accumulated so far, then clear
        them; the gradient norm (NaN where no step was taken) and the learning rate.

        With ``exchange`` (a hybrid gradient group, ``libra.workers._hybrid``) the gradients
        are first the whole group's; a replica of the group never steps (it takes the
        core's parameters), and a core whose exchange failed does not either.
        """
        reduced = exchange is None or exchange.reduce_gradients(self.model)
        lr = float(self.optimizer.param_groups[0]["lr"])
        grad_norm = float("nan")
        if reduced and (exchange is None or exchange.core):
            grad_norm = self._clip_gradients()
            self.optimizer.step()
            self.lr_schedule.step()
            self.steps_done += 1
        self.optimizer.zero_grad(set_to_none=True)
        if exchange is not None and reduced:
            exchange.send_parameters(self.model)
        return grad_norm, lr

    def backward(self, micro_batch: B, loss_fn: LossFn[B]) -> float:
        """Forward and backward one micro-batch (collective), its gradient reduced at once
        and added to the step's: a step taken in pieces (``libra.workers._hybrid``). Its
        loss on this rank."""
        self.model.train()
        self.model.set_requires_gradient_sync(True)
        loss = loss_fn(self.model, micro_batch)
        loss.backward()
        return float(loss.detach())

    def accumulate(self, micro_batches: Sequence[B], loss_fn: LossFn[B]) -> float:
        """Forward and backward every micro-batch; gradients are reduced once, on the last.

        Returns the loss averaged over micro-batches and ranks.
        """
        import torch

        count = len(micro_batches)
        self._check_same_count(count)
        self.model.train()
        total = torch.zeros((), dtype=torch.float64, device=self.dist.device)
        for index, micro_batch in enumerate(micro_batches):
            # Reduce-scatter once per step instead of once per micro-batch.
            self.model.set_requires_gradient_sync(index == count - 1)
            loss = loss_fn(self.model, micro_batch)
            (loss / count).backward()
            total += loss.detach().double()
        return _mean_over_ranks(total / count)

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """Every parameter's whole gradient, on CPU, on every rank (collective)."""
        return {
            name: full_tensor(param.grad).cpu()
            for name, param in self.model.named_parameters()
            if param.grad is not None
        }

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter's whole value, on CPU, on every rank (collective)."""
        return {
            name: full_tensor(param.detach()).cpu() for name, param in self.model.named_parameters()
        }

    # --------------------------------------------------------------- checkpoints

    def save_checkpoint(self, folder: str | Path) -> None:
        """Write the sharded model and optimizer, the LR schedule, the step count and each
        rank's RNG states under ``folder`` (collective; see ``libra.trainer._checkpoint``)."""
        save_trainer_state(self, folder)

    def load_checkpoint(self, folder: str | Path) -> None:
        """Restore what :meth:`save_checkpoint` wrote (collective), on any world size."""
        load_trainer_state(self, folder)

    # ----------------------------------------------------------------- inference

    def logprobs(self, token_ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
        """``log_softmax(logits / temperature)`` at each next token: shape ``[B, T - 1]``."""
        self.model.eval()
        ids = token_ids.to(self.dist.device)
        return sequence_logprobs(self.model, ids, temperature, self.config.logprob_chunk_tokens)

    def compare_logprobs(
        self,
        records: Sequence[TrajectoryRecord],
        mode: LogprobsMode,
        sampling_temperature: float,
    ) -> LogprobGap:
        """The gap between this model and the logprobs the server recorded (collective:
        every rank passes the same records), logged on rank 0.

        ``mode`` is the servers' ``--logprobs-mode`` and ``sampling_temperature`` the
        rollout's: together they say at which temperature the two sides agree.
        """
        temperature = server_logprob_temperature(mode, sampling_temperature)
        self.model.eval()
        gap = records_logprob_gap(self.model, records, temperature)
        if self.dist.is_main:
            log.info(
                "logprob gap after %d steps: mean %.4f, max %.4f over %d tokens (%s, T=%.2f)",
                self.steps_done,
                gap.mean_abs,
                gap.max_abs,
                gap.tokens,
                mode,
                temperature,
            )
        return gap

    # ----------------------------------------------------------------- internals

    def _clip_gradients(self) -> float:
        import torch

        params = [p for p in self.model.parameters() if p.grad is not None]
        max_norm = self.config.grad_clip if self.config.grad_clip is not None else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return float(full_tensor(norm))

    def _check_same_count(self, count: int) -> None:
        """Unequal micro-batch counts would hang FSDP's collectives: fail on all ranks."""
        import torch
        import torch.distributed as dist

        counts = torch.tensor([count, -count], device=self.dist.device)
        dist.all_reduce(counts, op=dist.ReduceOp.MAX)
        if int(counts[0]) != -int(counts[1]):
            raise ValueError(
                f"ranks passed between {-int(counts[1])} and {int(counts[0])} micro-batches; "
                "every rank must pass the same number"
            )
        if count == 0:
            raise ValueError("a step needs at least one micro-batch")


def _load_sharded(model_dir: Path, config: TrainerConfig, mesh: Any, dtype: Any) -> nn.Module:
    """Load the HF model in fp32 (the master weights), add its LoRA adapters if any, and
    shard it (``libra.trainer._shard``)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # a rank's output is the run's log: no bars
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if config.lora.enabled:
        model = add_adapters(model, config.lora)
    return shard_model(model, mesh, dtype, activation_checkpointing=config.activation_checkpointing)


def full_tensor(tensor: Any) -> torch.Tensor:
    """A DTensor's whole value (collective), or the tensor itself."""
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor


def _mean_over_ranks(value: torch.Tensor) -> float:
    import torch.distributed as dist

    dist.all_reduce(value, op=dist.ReduceOp.SUM)
    world: int = dist.get_world_size()
    return float(value) / world


# ------------------------------------------------------------------ micro-batches


def split_by_tokens(items: Sequence[T], lengths: Sequence[int], max_tokens: int) -> list[list[T]]:
    """Greedy, in order: cut ``items`` into runs whose lengths sum to at most ``max_tokens``.

    An item longer than the budget gets a micro-batch of its own.
    """
    if len(items) != len(lengths):
        raise ValueError(f"{len(items)} items but {len(lengths)} lengths")
    batches: list[list[T]] = []
    used = max_tokens
    for item, length in zip(items, lengths, strict=True):
        if used + length > max_tokens:
            batches.append([])
            used = 0
        batches[-1].append(item)
        used += length
    return batches
