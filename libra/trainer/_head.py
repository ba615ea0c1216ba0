"""A causal LM's token logprobs with the LM head taken in chunks.

The whole ``[positions, vocab]`` logits of a long sample do not fit: 32k positions of a
150k-token vocabulary are 19 GB in fp32, before the softmax's own copy for backward.
:func:`forward_logprobs` runs the model to its last hidden state (its head on one
position only, ``logits_to_keep=1``), then puts the hidden states through the head
``chunk_tokens`` positions at a time. Under autograd each chunk is checkpointed: its
logits are dropped after its logprobs are taken, and made again, one chunk at a time, in
backward. Peak memory then grows with the chunk, not the sample, at the cost of a second
pass through the head in backward.

Each position's logprob is computed as in one pass (the chunks split rows, not sums), so
chunked and whole agree to float rounding (a matmul's kernel may change with its shape).
A model whose logits are more than its head's output (soft-capped or scaled logits:
Gemma 2, Cohere, Granite) or whose forward takes no ``logits_to_keep`` is run whole.
Under FSDP2 the head is in the root's group, which stays gathered from its forward to the
end of its backward, so the head's weight is whole here too.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from libra.trainer._loss import token_logprobs  # (which imports torch as well)

__all__ = ["forward_logprobs"]

# Config fields of logits that are not the head's output alone.
_LOGITS_AFTER_HEAD = ("final_logit_softcapping", "logit_scale", "logits_scaling")


def forward_logprobs(
    model: nn.Module,
    targets: torch.Tensor,
    *,
    temperature: float = 1.0,
    chunk_tokens: int | None = None,
    **inputs: Any,
) -> torch.Tensor:
    """The model's forward over ``inputs``: the logprobs of ``targets`` (shaped like the
    input ids) at ``temperature``, through the head ``chunk_tokens`` positions at a time
    when there are more (None: all at once)."""
    if chunk_tokens is None or targets.numel() <= chunk_tokens or not _head_alone(model):
        return token_logprobs(model(**inputs).logits, targets, temperature)
    hidden = _last_hidden_state(model, inputs)
    head = model.get_output_embeddings()
    rows = hidden.reshape(-1, hidden.shape[-1]).split(chunk_tokens)
    ids = targets.reshape(-1).split(chunk_tokens)
    parts = [_chunk_logprobs(head, r, i, temperature) for r, i in zip(rows, ids, strict=True)]
    return torch.cat(parts).reshape(targets.shape)


def _chunk_logprobs(
    head: nn.Module, rows: torch.Tensor, ids: torch.Tensor, temperature: float
) -> torch.Tensor:
    def logprobs(rows: torch.Tensor) -> torch.Tensor:
        return token_logprobs(head(rows), ids, temperature)

    if not torch.is_grad_enabled():
        return logprobs(rows)
    out: torch.Tensor = checkpoint(logprobs, rows, use_reentrant=False)
    return out


def _last_hidden_state(model: nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
    """The base model's output (after its final norm), from a forward of the whole
    model that puts one position through the head."""
    seen: list[torch.Tensor] = []

    def keep(module: nn.Module, args: Any, output: Any) -> None:
        seen.append(output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0])

    handle = model.model.register_forward_hook(keep)
    try:
        model(**inputs, logits_to_keep=1)
    finally:
        handle.remove()
    return seen[-1]


def _head_alone(model: nn.Module) -> bool:
    """Whether the model's logits are its head's output, and its forward can skip it
    (a Hugging Face causal LM: its base model at ``.model``, its head apart)."""
    config = getattr(model, "config", None)
    if any(getattr(config, name, None) not in (None, 1.0) for name in _LOGITS_AFTER_HEAD):
        return False
    if not isinstance(getattr(model, "model", None), nn.Module):
        return False
    forward = inspect.signature(model.forward).parameters
    return "logits_to_keep" in forward and model.get_output_embeddings() is not None
