"""What the trainer tests run on each rank (module-level, so that spawned processes can
import it), and the plain losses they train with."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from libra.engine import Timings, TrajectoryRecord
from libra.train import FSDPTrainer, TrainerConfig, export_weights


@dataclass(frozen=True)
class MicroBatch:
    """Token ids ``[B, T]`` and a 0/1 mask over the predicted tokens ``[B, T - 1]``."""

    ids: torch.Tensor
    mask: torch.Tensor


def masked_token_nll(model: nn.Module, batch: MicroBatch, scale: float) -> torch.Tensor:
    """Sum of the masked next-token negative log-likelihoods, times ``scale``."""
    logits = model(input_ids=batch.ids).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(-1, batch.ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return -(chosen * batch.mask).sum() * scale


def fixed_batch(vocab: int, sequences: int, length: int, seed: int = 0) -> MicroBatch:
    """Random ids and a mask that hides a different prefix of each sequence."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (sequences, length), generator=generator)
    mask = torch.ones(sequences, length - 1)
    for row in range(sequences):
        mask[row, : 3 * row + 1] = 0  # as if the first tokens were the prompt
    return MicroBatch(ids, mask)


def rank_gradients(
    model_dir: Path, batch: MicroBatch, config: TrainerConfig, run_dir: Path
) -> tuple[dict[str, torch.Tensor], float, Path]:
    """This rank's share of ``batch``, one sequence per micro-batch: full gradients, loss,
    and the weights exported (unchanged: no step is taken) from the sharded model.

    The loss is scaled so that FSDP's mean over ranks and the trainer's mean over
    micro-batches give the masked token mean over the whole batch.
    """
    trainer = FSDPTrainer(model_dir, config)
    rank, world = trainer.dist.rank, trainer.dist.world_size
    mine = range(rank, len(batch.ids), world)
    micro = [MicroBatch(batch.ids[i : i + 1], batch.mask[i : i + 1]) for i in mine]
    scale = world * len(micro) / float(batch.mask.sum())
    loss = trainer.accumulate(micro, lambda model, mb: masked_token_nll(model, mb, scale))
    grads = trainer.full_gradients()
    return grads, loss, export_weights(trainer, run_dir, version=0)


def reference_gradients(
    model_dir: Path, batch: MicroBatch
) -> tuple[dict[str, torch.Tensor], float]:
    """The same loss on one process, without FSDP, the whole batch at once."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    loss = masked_token_nll(model, batch, 1.0 / float(batch.mask.sum()))
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return grads, float(loss.detach())


def train_and_export(
    model_dir: Path,
    run_dir: Path,
    batch: MicroBatch,
    config: TrainerConfig,
    probe: list[int],
    sampled: Sequence[TrajectoryRecord] = (),
    sampling_temperature: float = 1.0,
    export_dtype: str | None = None,
) -> dict[str, Any]:
    """One step that pushes ``batch`` up, export as version 1; logprobs of ``probe`` before
    and after (at temperatures 1 and 0.7), the gap to the server's ``sampled`` records
    (processed logprobs) before the step, the step's metrics and the exported parameters."""
    trainer = FSDPTrainer(model_dir, config)
    probe_ids = torch.tensor([probe])
    before = {t: trainer.logprobs(probe_ids, t)[0] for t in (1.0, 0.7)}
    gap = trainer.compare_logprobs(sampled, "processed_logprobs", sampling_temperature)
    scale = 1.0 / float(batch.mask.sum())
    metrics = trainer.step([batch], lambda model, mb: masked_token_nll(model, mb, scale))
    after = {t: trainer.logprobs(probe_ids, t)[0] for t in (1.0, 0.7)}
    folder = export_weights(trainer, run_dir, version=1, dtype=export_dtype)
    return {
        "before": before,
        "after": after,
        "metrics": metrics,
        "sampled_gap": gap,
        "folder": folder,
        "parameters": trainer.full_parameters(),
    }


def make_record(
    ids: list[int], mask: list[int], logprobs: list[float | None], tokens: str = "exact"
) -> TrajectoryRecord:
    """A finished trajectory holding these tokens, as the rollout engine records it."""
    return TrajectoryRecord(
        id="t#0",
        env="calc",
        task_id="t",
        sample=0,
        status="completed",
        stop_reason="model_stop",
        reward=1.0,
        turns=1,
        messages=[],
        token_ids=ids,
        loss_mask=mask,
        logprobs=logprobs,
        tokens=tokens,  # type: ignore[arg-type]
        weight_versions=[],
        tool_returns=[],
        endpoints=[],
        timings=Timings(),
    )


def save_tiny_llama(folder: Path, vocab: int = 64) -> Path:
    """A two-layer Llama with tied embeddings, saved as a Hugging Face folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def checkpointing_and_steps(model_dir: Path, batch: MicroBatch) -> dict[str, Any]:
    """Gradients with and without activation checkpointing, then three warmup steps."""
    scale = 1.0 / float(batch.mask.sum())
    loss_fn = lambda model, mb: masked_token_nll(model, mb, scale)  # noqa: E731
    grads = {}
    for checkpointing in (False, True):
        config = TrainerConfig(activation_checkpointing=checkpointing, lr=1e-2, warmup_steps=2)
        trainer = FSDPTrainer(model_dir, config)
        trainer.accumulate([batch], loss_fn)
        grads[checkpointing] = trainer.full_gradients()
        trainer.optimizer.zero_grad(set_to_none=True)
    steps = [trainer.step([batch], loss_fn) for _ in range(3)]
    return {"grads": grads, "steps": steps}


# ------------------------------------------------------------------- checkpoints


def save_llama(folder: Path, hidden: int, layers: int, vocab: int = 64) -> Path:
    """A Llama of the given size with tied embeddings, saved as a Hugging Face folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def noisy_nll(model: nn.Module, batch: MicroBatch) -> torch.Tensor:
    """The masked token mean NLL over a random half of the tokens, times a random scale:
    a step's result depends on the torch and python random states."""
    import random

    keep = (torch.rand(batch.mask.shape) < 0.5).float() * batch.mask
    scale = 0.5 + random.random()
    return masked_token_nll(model, MicroBatch(batch.ids, keep), scale / float(keep.sum() + 1))


def steps_then_checkpoint(
    model_dir: Path,
    batch: MicroBatch,
    config: TrainerConfig,
    steps: int,
    load_from: Path | None,
    save_to: Path | None,
) -> dict[str, Any]:
    """Seed this rank, restore ``load_from`` if given, take ``steps`` steps on this rank's
    rows of ``batch``, save to ``save_to`` if given: the losses, lrs, final parameters."""
    import random

    trainer = FSDPTrainer(model_dir, config)
    rank, world = trainer.dist.rank, trainer.dist.world_size
    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    if load_from is not None:
        trainer.load_checkpoint(load_from)
    mine = [
        MicroBatch(batch.ids[i : i + 1], batch.mask[i : i + 1])
        for i in range(rank, len(batch.ids), world)
    ]
    metrics = [trainer.step(mine, noisy_nll) for _ in range(steps)]
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return {
        "losses": [m.loss for m in metrics],
        "lrs": [m.lr for m in metrics],
        "steps_done": trainer.steps_done,
        "parameters": trainer.full_parameters(),
    }


def task_seed(index: int, seed: int = 7) -> int:
    """The task stream of the run: task ``index``'s seed (the order a sampler hands out)."""
    import zlib

    return zlib.crc32(f"{seed}/{index}".encode())


def task_batch(seeds: Sequence[int], vocab: int, length: int) -> MicroBatch:
    """One sequence of ids per task, drawn from its seed: the rollout's stand-in."""
    rows = [fixed_batch(vocab, 1, length, seed=s) for s in seeds]
    return MicroBatch(torch.cat([r.ids for r in rows]), torch.cat([r.mask for r in rows]))


def checkpointed_run(model_dir: Path, run_dir: Path, steps: int, resume_run: bool) -> None:
    """A training loop with the checkpoint hooks a run makes: resume, then per step take
    the next two tasks, train, log a metrics line, observe the prefix forest, and
    checkpoint every second step. One rank, in this process."""
    import json
    import random

    from libra.sched.policies import PrefixForest
    from libra.train import RestoreCheckpoint, RunState, WriteCheckpoint, find_latest

    trainer = FSDPTrainer(model_dir, TrainerConfig(lr=1e-2, cpu_threads=1, backend="gloo"))
    torch.manual_seed(0)  # the run's seed; a resumed run continues from the saved states
    random.seed(0)
    state = RestoreCheckpoint(run_dir).run(trainer) if resume_run else None
    step, next_task = (state.step, state.next_task) if state else (0, 0)
    latest = find_latest(run_dir) if state else None
    forest_path = latest.forest_path if latest else None
    forest = PrefixForest.load(forest_path) if forest_path else PrefixForest()
    metrics = run_dir / "metrics.jsonl"
    while step < steps:
        seeds = [task_seed(next_task + i) for i in range(2)]
        result = trainer.step([task_batch(seeds, 64, 24)], noisy_nll)
        forest.observe(f"p{step}", ["write", "run"], [30 - step, 10, 5])
        with metrics.open("a") as file:
            file.write(json.dumps({"step": step, "tasks": seeds, "loss": result.loss}) + "\n")
        step, next_task = step + 1, next_task + len(seeds)
        if step % 2 == 0:
            run = RunState(step, next_task, step, metrics.stat().st_size)
            WriteCheckpoint(run_dir, run, forest, keep_last=2).run(trainer)


def checkpoint_forever(model_dir: Path, run_dir: Path) -> None:
    """Step and checkpoint until killed: the victim of the atomicity test."""
    from libra.train import Checkpoint, RunState

    trainer = FSDPTrainer(model_dir, TrainerConfig(lr=1e-3, cpu_threads=1, backend="gloo"))
    batch = fixed_batch(64, sequences=2, length=16)
    step = 0
    while True:
        trainer.step([batch], noisy_nll)
        step += 1
        Checkpoint.write(run_dir, trainer, RunState(step, 2 * step, step), keep_last=2)
