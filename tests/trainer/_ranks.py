"""What the trainer tests share: a micro-batch, its loss, and small Llama folders.

Module level, so that ranks spawned by ``libra.trainer.spawn`` can import what they run.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from libra.trainer import Batch, GRPOConfig, Sample, TrainConfig, build_batch
from libra.trainer._head import forward_logprobs


@dataclass(frozen=True)
class MicroBatch:
    """Token ids ``[B, T]`` and a 0/1 mask over the predicted tokens ``[B, T - 1]``."""

    ids: torch.Tensor
    mask: torch.Tensor


def masked_token_nll(
    model: nn.Module, batch: MicroBatch, scale: float, chunk_tokens: int | None = None
) -> torch.Tensor:
    """Sum of the masked next-token negative log-likelihoods, times ``scale``; with
    ``chunk_tokens``, through the trainer's head in chunks (``libra.trainer._head``)."""
    if chunk_tokens is not None:
        targets = torch.cat([batch.ids[:, 1:], batch.ids[:, :1]], dim=1)  # the last: unused
        chosen = forward_logprobs(model, targets, chunk_tokens=chunk_tokens, input_ids=batch.ids)
        return -(chosen[:, :-1] * batch.mask).sum() * scale
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


def save_tiny_llama(folder: Path, vocab: int = 64) -> Path:
    """A two-layer Llama with tied embeddings, saved as a Hugging Face folder."""
    return save_llama(folder, hidden=32, layers=2, vocab=vocab)


def write_pid_and_sleep(pid_file: Path) -> None:
    """A rank that says who it is and never ends by itself."""
    import os
    import time

    pid_file.write_text(str(os.getpid()))
    time.sleep(600)


def abort_on_rank_one() -> int:
    """Rank 1 aborts, as torch's C++ does on a fatal error; rank 0 joins the group and
    returns (then waits at the barrier every finished rank passes)."""
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        os.abort()
    return 0


class _WritesWhenFreed:
    """In a reference cycle with itself; freed, it writes whether the process group was
    still up to ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.itself = self

    def __del__(self) -> None:
        import torch.distributed as dist

        self.path.write_text(str(dist.is_initialized()))


def cycle_left_behind(folder: Path) -> int:
    """Joins the group and returns, leaving an object only a collection frees (as an FSDP
    model is): ``folder/rank<r>`` says whether the group was up when it was freed."""
    import gc

    import torch.distributed as dist

    dist.init_process_group("gloo")
    gc.disable()  # no collection on its own: only one that the rank's exit makes
    _WritesWhenFreed(folder / f"rank{dist.get_rank()}")
    return 0


# ------------------------------------------------- commands for the trainer's processes


@dataclass(frozen=True)
class RankPids:
    """Every rank's process id, rank 0 first."""

    def run(self, trainer: object) -> list[int]:
        import os

        import torch.distributed as dist

        pids: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(pids, os.getpid())
        return [int(str(pid)) for pid in pids]


@dataclass(frozen=True)
class RankNodes:
    """The Ray node every rank runs on (its hex id), rank 0 first: for ranks that are
    Ray actors."""

    def run(self, trainer: object) -> list[str]:
        import ray
        import torch.distributed as dist

        nodes: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(nodes, ray.get_runtime_context().get_node_id())
        return [str(node) for node in nodes]


@dataclass(frozen=True)
class SleepThenMeet:
    """Each rank sleeps, writes ``started`` (rank 0) first, then all meet in a barrier."""

    seconds: float
    started: Path

    def run(self, trainer: object) -> None:
        import time

        import torch.distributed as dist

        if dist.get_rank() == 0:
            self.started.write_text("")
        time.sleep(self.seconds)
        dist.barrier()


@dataclass(frozen=True)
class Fail:
    """A command whose code is wrong: every rank raises."""

    def run(self, trainer: object) -> None:
        raise ValueError("a bug in the command")


@dataclass(frozen=True)
class FullParameters:
    """Every parameter's whole value, on CPU (collective), from rank 0."""

    def run(self, trainer: object) -> dict[str, torch.Tensor]:
        from libra.trainer import FSDPTrainer

        assert isinstance(trainer, FSDPTrainer)
        return trainer.full_parameters()


# ------------------------------------------------- a GRPO batch and its comparisons


def samples(seed: int) -> list[Sample]:
    """Two groups of four samples of varied lengths and rewards, prompts masked out."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for index in range(8):
        prompt, response = 5 + index % 3, 4 + 3 * index
        ids = torch.randint(0, 320, (prompt + response,), generator=generator).tolist()
        out.append(
            Sample(
                id=f"s{seed}-{index}",
                group=f"g{seed}-{index % 2}",
                status="completed",
                tokens="exact",
                reward=float(index),
                token_ids=tuple(ids),
                loss_mask=(0,) * prompt + (1,) * response,
                logprobs=(0.0,) * prompt + (-5.0,) * response,
                weight_version=0,
            )
        )
    return out


def batch(seed: int, ranks: int) -> Batch:
    train = TrainConfig(micro_batch_tokens=40)
    return build_batch(
        samples(seed), current_version=0, grpo=GRPOConfig(), train=train, ranks=ranks
    )


def assert_close(
    left: dict[str, torch.Tensor], right: dict[str, torch.Tensor], atol: float = 1e-6
) -> None:
    """Equal up to the order of floating-point sums (``atol``: where Adam's step, lr over
    a gradient's square root, magnifies it)."""
    assert left.keys() == right.keys()
    for name in left:
        torch.testing.assert_close(left[name], right[name], rtol=1e-5, atol=atol)


def assert_equal(left: dict[str, torch.Tensor], right: dict[str, torch.Tensor]) -> None:
    assert left.keys() == right.keys()
    for name in left:
        assert torch.equal(left[name], right[name]), name
