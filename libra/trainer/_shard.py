"""How the trainer shards a causal LM with FSDP2, apart from its config (pydantic).

Each decoder layer, then the root, is ``fully_shard``-ed on a one-dimensional mesh, with
parameters gathered in the compute dtype and gradients reduced in fp32. The root group
holds the embeddings and the LM head, so tied weights stay one parameter. Pydantic-free,
so the GPU check (``scripts/gpu-check.sh``) shards the model the trainer's way in a stock
CUDA image.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["decoder_layers", "shard_model"]


def shard_model(
    model: nn.Module, mesh: Any, dtype: torch.dtype, *, activation_checkpointing: bool = False
) -> nn.Module:
    """``model`` (fp32: the master weights; on CPU or its device) sharded over ``mesh``:
    its decoder layers, then the root; it computes in ``dtype``."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    config = getattr(model, "config", None)
    if config is not None:
        config.use_cache = False
    if activation_checkpointing:
        enable: Any = model.gradient_checkpointing_enable
        enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks: the units FSDP gathers one at a time."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise TypeError(f"{type(model).__name__} has no model.layers to shard")
    return list(layers)
