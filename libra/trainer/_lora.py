"""LoRA: low-rank adapters on the trainer's model, through ``peft`` (``libra[lora]``).

``[trainer.lora] rank = 8`` injects adapters into the linear layers it names
(``peft.inject_adapter_in_model``: the model stays the Hugging Face one, so FSDP shards it
as before) and freezes everything else: only the adapters train, only they are in the
optimizer, and the checkpoints hold them with their optimizer state.

Each step's sync sends one of two things (``libra.trainer.export_weights``):

- ``adapter``: the adapters alone, as a ``peft`` folder (``adapter_config.json`` and
  ``adapter_model.safetensors``), which vLLM loads at runtime under the name the rollouts
  call (``/v1/load_lora_adapter`` with ``load_inplace``, ``libra.serving.WeightSync``).
  The servers start on the base model with a zero adapter (:func:`write_zero_adapter`),
  so version 0 is the base model under the adapter's name.
- ``merged``: full weights with each adapter folded into its layer,
  ``W + (alpha / rank) * B @ A``, for servers that cannot load adapters.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import Field

from libra.config import Section, UsageError
from libra.trainer._atomic import write_folder_atomically

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_FILE",
    "LoRAConfig",
    "add_adapters",
    "is_adapter_folder",
    "merge_adapters",
    "write_adapter_folder",
    "write_zero_adapter",
]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILE = "adapter_model.safetensors"
# peft's name of the one adapter; its state dict keys carry it (``lora_A.default.weight``).
_ADAPTER = "default"
# peft writes (and vLLM reads) an adapter's keys under its wrapper's prefix.
_SAVED_PREFIX = "base_model.model."


class LoRAConfig(Section):
    """``[trainer.lora]``: low-rank adapters in place of full fine-tuning."""

    rank: int = Field(
        0, ge=0, description="the adapters' rank; 0: no adapters, every weight trains"
    )
    alpha: float | None = Field(
        None, gt=0, description="the adapters' scale is alpha / rank; None: 2 x rank"
    )
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input")
    target_modules: str | tuple[str, ...] = Field(
        "all-linear",
        description="the layers that get adapters: names (q_proj, v_proj, ...) or "
        "all-linear (every linear layer but the LM head)",
    )

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.lora_alpha / self.rank

    @property
    def lora_alpha(self) -> float:
        return self.alpha if self.alpha is not None else 2.0 * self.rank

    def peft_config(self) -> Any:
        """The same settings as ``peft.LoraConfig``."""
        LoraConfig = _peft().LoraConfig
        targets = self.target_modules
        return LoraConfig(
            r=self.rank,
            lora_alpha=self.lora_alpha,
            lora_dropout=self.dropout,
            target_modules=targets if isinstance(targets, str) else list(targets),
        )


def add_adapters(model: nn.Module, config: LoRAConfig) -> nn.Module:
    """``model`` with adapters injected and every other parameter frozen."""
    return _peft().inject_adapter_in_model(config.peft_config(), model, adapter_name=_ADAPTER)


def adapter_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapters of a LoRA model's state dict, under the names peft saves them by."""
    return {
        _SAVED_PREFIX + key.replace(f".{_ADAPTER}.", "."): value
        for key, value in state.items()
        if ".lora_A." in key or ".lora_B." in key
    }


def write_adapter_folder(
    adapters: dict[str, torch.Tensor], config: LoRAConfig, base: Path, target: Path
) -> None:
    """``adapters`` (:func:`adapter_keys`) as a peft folder at ``target``, atomically."""
    from safetensors.torch import save_file

    tensors = {key: value.detach().float().contiguous() for key, value in adapters.items()}
    settings = config.peft_config()
    settings.base_model_name_or_path = str(base)

    def write(staging: Path) -> None:
        settings.save_pretrained(str(staging))
        save_file(tensors, str(staging / ADAPTER_FILE), metadata={"format": "pt"})

    write_folder_atomically(target, write)


def write_zero_adapter(model_dir: Path, config: LoRAConfig, target: Path) -> Path:
    """An adapter whose ``B`` is zero (as a fresh one's is), so it serves ``model_dir``
    unchanged: what the servers start on. The shapes come from the model built on the meta
    device, so no weight is read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if (target / ADAPTER_FILE).is_file():
        return target
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    shapes = adapter_keys(add_adapters(model, config).state_dict())
    zeros = {key: torch.zeros(meta.shape) for key, meta in shapes.items()}
    write_adapter_folder(zeros, config, model_dir, target)
    return target


def merge_adapters(state: dict[str, torch.Tensor], config: LoRAConfig) -> dict[str, torch.Tensor]:
    """A LoRA model's full state dict as the plain model's: each adapted layer's weight
    is ``W + scale * B @ A``, under its plain name."""
    merged: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".lora_A." in key or ".lora_B." in key:
            continue
        if key.endswith(".base_layer.weight"):
            layer = key.removesuffix(".base_layer.weight")
            a = state[f"{layer}.lora_A.{_ADAPTER}.weight"].float()
            b = state[f"{layer}.lora_B.{_ADAPTER}.weight"].float()
            merged[f"{layer}.weight"] = (value.float() + config.scale * (b @ a)).to(value.dtype)
        else:
            merged[key.replace(".base_layer.", ".")] = value
    return merged


def is_adapter_folder(folder: Path) -> bool:
    return (folder / ADAPTER_CONFIG).is_file()


def _peft() -> Any:
    try:
        import peft
    except ImportError:
        raise UsageError(
            "[trainer.lora] needs peft: pip install 'libra[lora]' (make setup installs it)"
        ) from None
    return peft
