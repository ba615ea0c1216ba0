"""The LM head in chunks: the same logprobs and gradients as in one pass, in one process
(FSDP's two ranks: ``test_fsdp.py``)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from libra.trainer import sequence_logprobs
from libra.trainer._head import _head_alone, forward_logprobs
from tests._helpers import tiny_llama


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    folder = tiny_llama(tmp_path_factory.mktemp("tiny") / "model")
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def _logprobs_and_grads(
    model: torch.nn.Module, ids: torch.Tensor, chunk_tokens: int | None
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    targets = ids.roll(-1, dims=1)
    logprobs = forward_logprobs(
        model, targets, temperature=0.7, chunk_tokens=chunk_tokens, input_ids=ids
    )
    weights = torch.linspace(0.1, 1.0, logprobs.numel()).reshape(logprobs.shape)
    (logprobs * weights).sum().backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), grads


@pytest.mark.parametrize("chunk_tokens", [1, 16, 73])
def test_chunks_give_the_logprobs_and_gradients_of_one_pass(
    model: torch.nn.Module, chunk_tokens: int
) -> None:
    """Two rows of 37 positions, through the head 1, 16 or 73 at a time (the last chunk
    short, or the whole but one)."""
    ids = torch.randint(0, 320, (2, 37), generator=torch.Generator().manual_seed(3))
    whole, whole_grads = _logprobs_and_grads(model, ids, None)
    rows: list[int] = []  # the positions each call of the head takes
    hook = model.get_output_embeddings().register_forward_hook(
        lambda module, args, out: rows.append(args[0].shape[:-1].numel())
    )
    try:
        chunked, chunked_grads = _logprobs_and_grads(model, ids, chunk_tokens)
    finally:
        hook.remove()
    # One position per row for the model's own call; then each chunk, again in backward.
    chunks = [min(chunk_tokens, 74 - start) for start in range(0, 74, chunk_tokens)]
    assert rows == [2, *chunks, *reversed(chunks)]
    assert chunked.shape == whole.shape == (2, 37)
    torch.testing.assert_close(chunked, whole, rtol=0, atol=1e-5)
    assert chunked_grads.keys() == whole_grads.keys() and whole_grads
    for name, grad in whole_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_the_probe_s_logprobs_are_the_same_in_chunks(model: torch.nn.Module) -> None:
    ids = torch.randint(0, 320, (1, 50), generator=torch.Generator().manual_seed(5))
    whole = sequence_logprobs(model, ids, temperature=1.0)
    assert whole.shape == (1, 49)
    torch.testing.assert_close(sequence_logprobs(model, ids, 1.0, chunk_tokens=8), whole)
    # The probe's own way, by hand: the log-softmax at each next token.
    logits = model(input_ids=ids).logits[:, :-1].detach()
    by_hand = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    torch.testing.assert_close(whole, by_hand, rtol=0, atol=1e-5)


def test_logits_that_are_more_than_the_head_s_output_run_whole(model: torch.nn.Module) -> None:
    assert _head_alone(model)
    model.config.final_logit_softcapping = 30.0  # as Gemma 2's
    try:
        assert not _head_alone(model)
    finally:
        model.config.final_logit_softcapping = None
    assert not _head_alone(torch.nn.Linear(2, 2))  # no base model, no head
