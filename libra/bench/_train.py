"""What the trainer's machinery costs: :class:`FSDPTrainer` against a plain torch loop.

:func:`bench_train` trains the same model on the same GRPO batch, laid out in the same
micro-batches, three ways, each in processes of its own:

- a plain loop: the Hugging Face model, ``torch.optim.AdamW``, forward/backward per
  micro-batch, clip, step (one process, every core);
- :class:`FSDPTrainer` on 1 rank and on 2 ranks (each rank its share of the micro-batches
  and of the cores), and after each step the weight export a sync into the servers
  starts with (``export_weights``: the shards gathered and written as a model folder);
- the same shares on one core rank and hybrid replicas (``libra.workers._hybrid``: the
  gradients and parameters cross the hybrid gradient group's bridge every step), as the
  :class:`~libra.workers._elastic.ElasticTrainer` runs them once hybrid workers join;
- :class:`FSDPTrainer` on 1 rank with LoRA adapters (``[trainer.lora]``, rank 8 on every
  linear layer), exporting the adapters alone, as a sync into the run's own vLLM does;
- :class:`FSDPTrainer` on 1 rank with the off-policy correction on (``grpo.correction =
  "tis"``): what the correction's logprobs cost (they come from the loss's own pass);
- with ``long``: a sample of each of those lengths (and a short one beside it, so that
  its group has an advantage), on 1 rank, with the LM head in one pass and in chunks
  (``trainer.logprob_chunk_tokens``): what the chunks save in memory and cost in time.
  One step each, not warmed up: a long step is minutes on a few cores.

Each row also says the peak resident memory of its (first) process: the trainer's
memory, model, optimizer state and activations together.

The batch is built by ``build_batch`` from samples of real token ids (the model's
tokenizer on chat-like prompts and answers), in GRPO groups with varied rewards. The
first step of each is a warm-up and is not timed. Tokens per second count every position
through forward and backward.
"""

from __future__ import annotations

import os
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from libra.trainer import (
    Batch,
    Export,
    FSDPTrainer,
    GRPOConfig,
    LoRAConfig,
    MicroBatch,
    Sample,
    Train,
    TrainConfig,
    TrainerConfig,
    build_batch,
    export_weights,
    micro_batch_logprobs,
    spawn,
)
from libra.workers import ElasticTrainer

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["TrainBenchResult", "bench_samples", "bench_train"]

_LR = 1e-6
_WORDS = ("add", "the", "numbers", "then", "call", "python", "and", "answer", "with", "result")


@dataclass(frozen=True, slots=True)
class TrainBenchResult:
    """One way of training: seconds per timed step and what a step trains."""

    name: str
    ranks: int
    steps: int
    tokens_per_step: int
    step_s: float  # median over the timed steps
    export_s: float | None  # median weight export seconds per step; None: not exported
    peak_rss_gb: float | None = None  # the process's peak resident memory; None: unmeasured

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s


def bench_samples(model_dir: Path, groups: int, per_group: int, seed: int = 0) -> list[Sample]:
    """``groups`` x ``per_group`` samples of real token ids: a templated prompt (not
    trained) and an answer of 40 to 160 words (trained), rewards 0 or 1 within each group."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(seed)
    samples = []
    for group in range(groups):
        question = " ".join(rng.choice(_WORDS) for _ in range(20))
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
        )
        prompt_ids = list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        for index in range(per_group):
            words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(40, 160)))
            answer = tokenizer(words, add_special_tokens=False)["input_ids"]
            ids = prompt_ids + list(answer)
            mask = [0] * len(prompt_ids) + [1] * len(answer)
            samples.append(
                Sample(
                    id=f"g{group}#{index}",
                    group=f"g{group}",
                    status="completed",
                    tokens="exact",
                    reward=float(index % 2),
                    token_ids=tuple(ids),
                    loss_mask=tuple(mask),
                    logprobs=tuple(-1.5 * m for m in mask),
                    weight_version=0,
                )
            )
    return samples


def bench_train(
    model_dir: Path,
    *,
    steps: int = 3,
    groups: int = 4,
    per_group: int = 4,
    ranks: Sequence[int] = (1, 2),
    micro_batch_tokens: int = 1024,
    long: Sequence[int] = (),
    chunk_tokens: int = 1024,
) -> list[TrainBenchResult]:
    """The plain loop, then :class:`FSDPTrainer` on each of ``ranks``: ``steps`` timed
    steps each (after one warm-up step) on the same samples; then a sample of each of the
    ``long`` lengths, its LM head in one pass and in chunks of ``chunk_tokens``."""
    samples = bench_samples(model_dir, groups, per_group)
    train = TrainConfig(micro_batch_tokens=micro_batch_tokens)
    # Planned for the most ranks, so that every way runs the very same micro-batches.
    batch = build_batch(samples, current_version=0, train=train, ranks=max(ranks))
    [plain] = spawn(1, _plain_loop, model_dir, batch, steps)
    results = [plain]
    for world in ranks:
        with tempfile.TemporaryDirectory(prefix="libra-bench-train-") as run_dir:
            results.append(spawn(world, _fsdp_rank, model_dir, batch, steps, Path(run_dir))[0])
    if batch.ranks > 1:
        results.append(anyio.run(_hybrid_group, model_dir, batch, steps))
    for variant in (_LORA, _TIS):
        with tempfile.TemporaryDirectory(prefix="libra-bench-train-") as run_dir:
            results.append(spawn(1, _fsdp_rank, model_dir, batch, steps, Path(run_dir), variant)[0])
    for tokens in long:
        batch = _long_batch(model_dir, tokens)
        for chunk in (None, chunk_tokens):
            head = "LM head whole" if chunk is None else f"LM head in chunks of {chunk:,}"
            trainer = TrainerConfig(lr=_LR, backend="gloo", logprob_chunk_tokens=chunk)
            variant = _Variant(f", {tokens:,}-token sample, {head}", trainer, GRPOConfig())
            with tempfile.TemporaryDirectory(prefix="libra-bench-train-") as run_dir:
                row = spawn(1, _fsdp_rank, model_dir, batch, 0, Path(run_dir), variant)[0]
            results.append(row)
    return results


def _long_batch(model_dir: Path, tokens: int) -> Batch:
    """A group of a ``tokens``-token sample (a short prompt, then the answer) and a short
    one, rewarded 1 and 0: the long one in a micro-batch of its own."""
    short = bench_samples(model_dir, groups=1, per_group=2)
    ids = short[0].token_ids * (tokens // len(short[0].token_ids) + 1)
    prompt = short[0].loss_mask.index(1)
    mask = (0,) * prompt + (1,) * (tokens - prompt)
    logprobs = tuple(-1.5 * m for m in mask)
    sample = replace(short[0], token_ids=ids[:tokens], loss_mask=mask, logprobs=logprobs)
    samples = [replace(sample, reward=1.0), replace(short[1], reward=0.0)]
    return build_batch(samples, current_version=0, train=TrainConfig(micro_batch_tokens=tokens))


@dataclass(frozen=True, slots=True)
class _Variant:
    """How a row's trainer differs from the plain FSDP rows."""

    label: str
    trainer: TrainerConfig
    grpo: GRPOConfig


_FULL = _Variant("", TrainerConfig(lr=_LR, backend="gloo"), GRPOConfig())
_LORA = _Variant(
    ", LoRA rank 8",
    TrainerConfig(lr=_LR, backend="gloo", lora=LoRAConfig(rank=8)),
    GRPOConfig(),
)
_TIS = _Variant(", correction tis", _FULL.trainer, GRPOConfig(correction="tis"))


def _loss(
    model: nn.Module,
    micro: MicroBatch,
    scale: float,
    grpo: GRPOConfig | None = None,
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    logprobs = micro_batch_logprobs(model, micro, chunk_tokens=chunk_tokens)
    loss, _ = micro.loss(logprobs, grpo or GRPOConfig())
    return loss * scale


def _peak_rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2  # KiB on Linux


def _plain_loop(model_dir: Path, batch: Batch, steps: int) -> TrainBenchResult:
    """One process, no FSDP: the baseline the trainer's overhead is measured against."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.config.use_cache = False
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=_LR)
    micro_batches = batch.micro_batches
    seconds = []
    for _ in range(steps + 1):
        started = time.perf_counter()
        for micro in micro_batches:
            _loss(model, micro, 1.0).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - started)
    tokens = sum(micro.positions for micro in micro_batches)
    return TrainBenchResult(
        "plain torch loop", 1, steps, tokens, statistics.median(seconds[1:]), None, _peak_rss_gb()
    )


def _fsdp_rank(
    model_dir: Path, batch: Batch, steps: int, run_dir: Path, variant: _Variant = _FULL
) -> TrainBenchResult:
    """One rank of the trainer: its share of the micro-batches, then the export (the
    adapters alone where it has some)."""
    trainer = FSDPTrainer(model_dir, variant.trainer)
    world = trainer.dist.world_size
    mine = [
        micro
        for rank in range(trainer.dist.rank, batch.ranks, world)
        for micro in batch.for_rank(rank)
    ]
    # The trainer averages over micro-batches and ranks: undo it, so the sums add up.
    scale = float(len(mine) * world)
    chunk = variant.trainer.logprob_chunk_tokens
    step_s, export_s = [], []
    for version in range(steps + 1):
        loss = lambda model, mb: _loss(model, mb, scale, variant.grpo, chunk)  # noqa: E731
        step_s.append(trainer.step(mine, loss).seconds)
        started = time.perf_counter()
        export_weights(trainer, run_dir, version, adapter=True)
        export_s.append(time.perf_counter() - started)
    timed = slice(1, None) if steps else slice(None)  # steps=0: one step, not warmed up
    tokens = sum(micro.positions for micro in batch.micro_batches)
    return TrainBenchResult(
        f"FSDPTrainer, {world} rank{'s' if world > 1 else ''}{variant.label}",
        world,
        len(step_s[timed]),
        tokens,
        _slowest_rank_median(step_s[timed]),
        _slowest_rank_median(export_s[timed]),
        _peak_rss_gb(),
    )


async def _hybrid_group(model_dir: Path, batch: Batch, steps: int) -> TrainBenchResult:
    """One core rank and ``batch.ranks - 1`` hybrid replicas, each on its share of the
    cores, joined as the allocation pool joins them; then timed as :func:`_fsdp_rank`."""
    cores = sorted(os.sched_getaffinity(0))
    workers = {w: tuple(cores[w :: batch.ranks]) or (cores[0],) for w in range(batch.ranks)}
    config = TrainerConfig(lr=_LR, backend="gloo")
    step_s, export_s = [], []
    async with ElasticTrainer(model_dir, config, workers, members=(0,)) as trainer:
        for worker in range(1, batch.ranks):
            await trainer.fetch_replica(worker)
            await trainer.sync_replica(worker)
            await trainer.activate_replica(worker)
        with tempfile.TemporaryDirectory(prefix="libra-bench-train-") as run_dir:
            for version in range(steps + 1):
                result = await trainer.call(Train(batch, GRPOConfig(), 1.0))
                step_s.append(result.step.seconds)
                started = time.perf_counter()
                await trainer.call(Export(Path(run_dir), version, None))
                export_s.append(time.perf_counter() - started)
    replicas = batch.ranks - 1
    return TrainBenchResult(
        f"FSDPTrainer, 1 rank + {replicas} hybrid replica{'s' if replicas > 1 else ''}",
        batch.ranks,
        steps,
        sum(micro.positions for micro in batch.micro_batches),
        statistics.median(step_s[1:]),
        statistics.median(export_s[1:]),
    )


def _slowest_rank_median(seconds: list[float]) -> float:
    """The median of this rank's seconds, the largest over ranks (a step ends with all)."""
    import torch
    import torch.distributed as dist

    value = torch.tensor([statistics.median(seconds)], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def as_json(results: Sequence[TrainBenchResult]) -> dict[str, Any]:
    """The results, each with its tokens/s and its ratio to the plain loop's."""
    plain = results[0].tokens_per_s
    return {
        "device": "cpu (gloo)",
        "cores": os.cpu_count(),
        "results": [
            {**asdict(r), "tokens_per_s": r.tokens_per_s, "ratio_to_plain": r.tokens_per_s / plain}
            for r in results
        ],
    }
