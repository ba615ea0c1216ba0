"""One rank of the GPU check (``scripts/gpu-check.sh`` starts them with torchrun).

On a GPU machine: a model of Qwen2.5-0.5B's shape (random weights, nothing downloaded),
sharded the trainer's way (``libra.trainer._shard``), trained with Libra's GRPO loss
(``libra.trainer._loss``) in bf16 on NCCL, with and without LoRA: tokens/s and MFU; and
the loss and the per-token logprobs of one batch against the same weights on CPU in fp32.
With ``--cpu``: the same steps on a tiny model, gloo ranks on the CPU, in seconds (the
test that keeps this script from rotting runs it so).

Only modules of Libra's trainer core are imported, never the ``libra.trainer`` package:
that re-exports the config sections (pydantic) and the batches and worker (msgspec,
through ``libra.engine``), which a stock CUDA image lacks (see ``_trainer_core``).
"""

from __future__ import annotations

import argparse
import copy
import gc
import math
import os
import sys
import time
import types
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

# Qwen2.5-0.5B's config.json, the fields that shape the compute.
QWEN25_05B: dict[str, Any] = {
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
    "use_sliding_window": False,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
}
# The reduced check's model: the same architecture, small enough for seconds on CPU.
TINY = QWEN25_05B | {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}

# Dense bf16 peak FLOP/s per device, by a substring of its name (first match wins).
PEAKS: tuple[tuple[str, float], ...] = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),
    ("H200", 989e12),
    ("A100", 312e12),
)

LORA_RANK = 16


@dataclass(frozen=True)
class Sizes:
    """How much each part of the check runs."""

    model: dict[str, Any]
    name: str
    rows: int  # sequences per micro-batch
    length: int  # tokens per sequence (the positions the loss sees)
    micro_batches: int  # per rank and step
    warmup: int
    steps: int  # timed
    check_rows: int  # the agreement batch
    check_length: int


GPU = Sizes(QWEN25_05B, "Qwen2.5-0.5B", 4, 2048, 2, 3, 10, 2, 512)
CPU = Sizes(TINY, "Qwen2-tiny", 2, 32, 2, 1, 2, 2, 24)


@dataclass(frozen=True)
class Tokens:
    """One micro-batch as the loss takes it: inputs, targets (shifted by one), the mask
    of trained targets, the rollout's logprobs and the advantages, per position."""

    inputs: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor

    def to(self, device: torch.device) -> Tokens:
        return Tokens(*(getattr(self, name).to(device) for name in self.__dataclass_fields__))


def _trainer_core() -> tuple[types.ModuleType, types.ModuleType]:
    """Libra's loss and sharding modules, without running ``libra.trainer/__init__.py``.

    The package is registered with its path only, so ``libra.trainer._loss`` and
    ``libra.trainer._shard`` import as the modules they are and nothing else of the
    package loads; both are kept free of pydantic and msgspec for this (and
    tests/scripts/test_gpu_check.py runs this script where those cannot be imported).
    """
    import libra

    if "libra.trainer" not in sys.modules:
        package = types.ModuleType("libra.trainer")
        package.__path__ = [str(Path(libra.__file__).parent / "trainer")]
        sys.modules["libra.trainer"] = package
    from libra.trainer import _loss, _shard

    return _loss, _shard


LOSS, SHARD = _trainer_core()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="the reduced check: tiny model, gloo")
    args = parser.parse_args()
    if not args.cpu and not torch.cuda.is_available():
        sys.exit("gpu-check: no CUDA device here; --cpu runs the reduced check")
    sizes = CPU if args.cpu else GPU
    rank, world, device = _join(cpu=args.cpu)
    say = print if rank == 0 else _quiet
    try:
        _check(sizes, rank, world, device, say)
    finally:
        dist.destroy_process_group()


def _check(sizes: Sizes, rank: int, world: int, device: torch.device, say: Any) -> None:
    import transformers
    from transformers import Qwen2Config, Qwen2ForCausalLM

    transformers.logging.set_verbosity_error()
    config = Qwen2Config(**sizes.model)
    torch.manual_seed(0)  # every rank builds the same weights
    started = time.perf_counter()
    base = Qwen2ForCausalLM(config).float()
    params = sum(p.numel() for p in base.parameters())
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = _peak(name)
    say(
        f"gpu-check: {name} x{world}, {dist.get_backend()}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}, peft {_peft_version()}"
    )
    say(
        f"model: {sizes.name} shape, random weights: {params:,} params, "
        f"{config.num_hidden_layers} layers, vocab {config.vocab_size}, "
        f"attention {config._attn_implementation}; built in {time.perf_counter() - started:.1f} s"
    )
    say(
        f"peak: {peak / 1e12:.0f} TFLOP/s dense bf16 per device"
        if peak
        else f"peak: unknown peak for {name!r}: no MFU"
    )
    say(
        f"libra: {LOSS.__name__}, {SHARD.__name__} from {Path(LOSS.__file__ or '?').parent} "
        f"({_loaded('pydantic', 'msgspec', 'vllm')})"
    )

    check = _tokens(sizes.check_rows, sizes.check_length, config.vocab_size, seed=1)
    reference = _forward(base, check) if rank == 0 else None
    mesh = _mesh(device, world)
    lora = _peft()
    if lora is None:
        say("lora: skipped: peft is not installed (pip install peft==0.21.2)")
    runs = [("full", "fp32", False), ("full", "bf16", True)]
    if lora is not None:
        runs.append(("lora", "bf16", True))
    for mode, precision, timed in runs:
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        with _built(base, mesh, dtype, lora if mode == "lora" else None) as model:
            logprobs, loss = _forward(model, check.to(device))
            if reference is not None:
                gap = (logprobs - reference[0]).abs().max().item()
                say(
                    f"agreement mode={mode} precision={precision} vs=cpu-fp32 "
                    f"tokens={check.targets.numel()} logprob_max_abs={gap:.3e} "
                    f"loss_abs={abs(loss - reference[1]):.3e} "
                    f"loss_cpu={reference[1]:.6f} loss_device={loss:.6f}"
                )
            if timed:
                _throughput(model, sizes, mode, precision, rank, world, device, peak, say)
    say(
        "MFU = 6 x params x tokens/s / (peak x ranks): attention's own FLOPs are not "
        "counted, and LoRA's backward skips the frozen weights' gradients (about 4 x "
        "params of work), so its MFU is on full training's scale"
    )


def _throughput(
    model: nn.Module,
    sizes: Sizes,
    mode: str,
    precision: str,
    rank: int,
    world: int,
    device: torch.device,
    peak: float | None,
    say: Any,
) -> None:
    """Train ``model`` ``warmup + steps`` steps on this rank's micro-batches, as
    ``FSDPTrainer.step`` does (gradients reduced on the last micro-batch, clipped at 1,
    one AdamW step), and report the timed steps."""
    vocab = int(model.config.vocab_size)
    micro = [
        _tokens(sizes.rows, sizes.length, vocab, seed=100 + rank * 17 + index).to(device)
        for index in range(sizes.micro_batches)
    ]
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-6, betas=(0.9, 0.999), weight_decay=0.0)
    for _ in range(sizes.warmup):
        _step(model, optimizer, micro)
    _sync(device)
    started = time.perf_counter()
    for _ in range(sizes.steps):
        loss = _step(model, optimizer, micro)
    _sync(device)
    seconds = (time.perf_counter() - started) / sizes.steps
    tokens = world * sizes.micro_batches * sizes.rows * sizes.length
    per_second = tokens / seconds
    params = sum(p.numel() for p in model.parameters())  # a DTensor's numel is its global one
    mfu = f"{6 * params * per_second / (peak * world):.1%}" if peak else "unknown-peak"
    memory = (
        f" max_mem_gib={torch.cuda.max_memory_allocated(device) / 2**30:.1f}"
        if device.type == "cuda"
        else ""
    )
    say(
        f"throughput mode={mode} precision={precision} ranks={world} "
        f"params={params:,} trainable={sum(p.numel() for p in trained):,} "
        f"tokens_per_step={tokens} s_per_step={seconds:.3f} tokens_per_s={per_second:.1f} "
        f"mfu={mfu} loss={loss:.4f}{memory}"
    )
    del optimizer


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, micro: list[Tokens]) -> float:
    model.train()
    total = 0.0
    for index, batch in enumerate(micro):
        model.set_requires_gradient_sync(index == len(micro) - 1)  # one reduce-scatter a step
        logits = model(input_ids=batch.inputs, use_cache=False).logits
        logprobs = LOSS.token_logprobs(logits, batch.targets)
        loss, _ = LOSS.grpo_loss(logprobs, batch.old_logprobs, batch.advantages, batch.mask)
        (loss / len(micro)).backward()
        total += float(loss.detach())
    grads = [p for p in model.parameters() if p.grad is not None]
    torch.nn.utils.clip_grad_norm_(grads, 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total / len(micro)


def _forward(model: nn.Module, batch: Tokens) -> tuple[torch.Tensor, float]:
    """Libra's per-token logprobs (fp32, on CPU) and GRPO loss of ``batch``."""
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=batch.inputs, use_cache=False).logits
        logprobs = LOSS.token_logprobs(logits, batch.targets)
        loss, _ = LOSS.grpo_loss(logprobs, batch.old_logprobs, batch.advantages, batch.mask)
    return logprobs.float().cpu(), float(loss)


@contextmanager
def _built(base: nn.Module, mesh: Any, dtype: torch.dtype, lora: Any) -> Iterator[nn.Module]:
    """A copy of ``base`` (fp32 master weights), with LoRA adapters on every linear
    layer but the head if ``lora`` (peft) is given, sharded the trainer's way."""
    model = copy.deepcopy(base)
    if lora is not None:
        settings = lora.LoraConfig(
            r=LORA_RANK, lora_alpha=2 * LORA_RANK, lora_dropout=0.0, target_modules="all-linear"
        )
        model = lora.inject_adapter_in_model(settings, model, adapter_name="default")
    model = SHARD.shard_model(model, mesh, dtype)
    try:
        yield model
    finally:
        del model
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()


def _tokens(rows: int, length: int, vocab: int, seed: int) -> Tokens:
    """Random ids; the first quarter of each row is prompt (untrained); rollout logprobs
    near a random model's (``-log vocab``) with noise, so some ratios clip; one advantage
    of +-1 per row."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, length + 1), generator=generator)
    mask = torch.ones(rows, length)
    mask[:, : length // 4] = 0
    noise = 0.2 * torch.randn(rows, length, generator=generator)
    signs = torch.randint(0, 2, (rows, 1), generator=generator).float() * 2 - 1
    return Tokens(
        inputs=ids[:, :-1],
        targets=ids[:, 1:],
        mask=mask,
        old_logprobs=noise - math.log(vocab),
        advantages=signs.expand(rows, length).contiguous(),
    )


def _join(*, cpu: bool) -> tuple[int, int, torch.device]:
    """This rank in torchrun's process group: NCCL on its GPU, or gloo on the CPU."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # The CPU's share of this rank: its training on --cpu, the reference forward on GPUs.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    if cpu:
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group("gloo" if cpu else "nccl")
    return rank, world, device


def _mesh(device: torch.device, world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (world,))


def _peak(name: str) -> float | None:
    return next((flops for part, flops in PEAKS if part in name), None)


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        return None
    return peft


def _peft_version() -> str:
    found = _peft()
    return str(found.__version__) if found is not None else "missing"


def _loaded(*names: str) -> str:
    return ", ".join(f"{name} loaded: {'yes' if name in sys.modules else 'no'}" for name in names)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def _quiet(*_: object, **__: object) -> None:
    pass


if __name__ == "__main__":
    main()
