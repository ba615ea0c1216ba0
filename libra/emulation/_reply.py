"""What the emulated model replies, as tokens: a script's text cut by stop strings and the
token budget, the seeds that make replies repeat, synthetic logprobs, and vLLM's Hermes
tool-call parsing of the text."""

from __future__ import annotations

import hashlib
import json
import random
import re
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from libra.emulation._tokenizer import EOS_ID, IM_END_ID, IM_START_ID, ByteTokenizer, pack_ids
from libra.openai import FunctionCall, Message, ToolCall

# vLLM's Hermes tool parser: closed blocks, or one unterminated block at the end.
_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.S)

# Continuations of aborted seedless requests whose seed keys are remembered (oldest dropped).
_MAX_ABORTED_KEYS = 65536


@dataclass(frozen=True, slots=True)
class Generation:
    """The tokens a request generates, why they end, and the stop string that ended them."""

    tokens: list[int]
    finish_reason: Literal["stop", "length", "abort"]
    stop_string: str | None = None

    def cut_to(self, produced: int) -> Generation:
        """What a request stopped by a pause returns: the tokens produced so far."""
        if produced >= len(self.tokens):
            return self
        return Generation(self.tokens[:produced], "abort")


class ReplySeeds:
    """The random seed of each reply, from the server seed, the request seed and the prompt.

    Seedless requests draw their request seeds from a seeded RNG, so that samples of one
    prompt differ (as a GRPO group needs) and the draws repeat from one server run to the
    next. A seedless request that ended early leaves its key for its continuation.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self._unseeded = random.Random(f"unseeded:{seed}")
        self._aborted_keys: dict[bytes, int] = {}

    def key(self, prompt: list[int], request_seed: int | None, packed: bytes | None = None) -> int:
        """The reply's random seed: server seed, request seed and the prompt's ids."""
        if request_seed is None:
            request_seed = self._unseeded.getrandbits(63)
        digest = hashlib.blake2b(f"{self.seed}:{request_seed}:".encode(), digest_size=8)
        digest.update(packed if packed is not None else array("H", prompt).tobytes())
        return int.from_bytes(digest.digest(), "little")

    def continuation_key(self, packed: bytes) -> int | None:
        """The key an aborted seedless request left for this prompt (taken once), if any."""
        return self._aborted_keys.pop(packed, None)

    def remember_if_aborted(
        self, prompt: list[int], reply: Generation, key: int, request_seed: int | None
    ) -> None:
        """Keep the seed key of a seedless request that ended early, so that its
        continuation (the prompt plus what it produced) goes on with the same reply."""
        if request_seed is not None or reply.finish_reason != "abort":
            return
        continuation = pack_ids([*prompt, *reply.tokens])
        if continuation is None:
            return
        if len(self._aborted_keys) >= _MAX_ABORTED_KEYS:
            del self._aborted_keys[next(iter(self._aborted_keys))]
        self._aborted_keys[continuation] = key


def reply_tokens(
    tokenizer: ByteTokenizer,
    text: str,
    stop: list[str] | None,
    max_new_tokens: int,
    partial: Sequence[int] = (),
) -> Generation:
    """The tokens the model emits for ``text`` after the ``partial`` turn it already
    wrote (as many tokens of the reply are skipped), and why it stopped.

    Ends with EOS unless a stop string ended the text (its tokens are kept, as vLLM
    keeps them) or ``max_new_tokens`` truncated it (finish reason ``"length"``).
    """
    matches = [(i, s) for s in stop or () if (i := text.find(s)) >= 0]
    if matches:
        cut, stop_string = min(matches)
        tokens = tokenizer.encode(text[: cut + len(stop_string)])
    else:
        stop_string, tokens = None, [*tokenizer.encode(text), EOS_ID]
    if partial:
        tokens = tokens[len(partial) :] or [EOS_ID]
    if len(tokens) > max_new_tokens:
        return Generation(tokens[:max_new_tokens], "length")
    return Generation(tokens, "stop", stop_string)


def reply_text(
    tokenizer: ByteTokenizer, reply: Generation, include_stop: bool | None, skip_special: bool
) -> str:
    """What vLLM returns as text: the stop string left out unless asked for."""
    text = tokenizer.decode(reply.tokens, skip_special=skip_special)
    if reply.stop_string is not None and not include_stop:
        return text.removesuffix(reply.stop_string)
    return text


def partial_turn(prompt: list[int], assistant_header: list[int]) -> list[int]:
    """The tokens of the assistant turn that ``prompt`` ends inside, if any (none
    when it ends with a bare generation prompt or outside an assistant turn)."""
    for index in range(len(prompt) - 1, -1, -1):
        token = prompt[index]
        if token == IM_END_ID:
            return []
        if token == IM_START_ID:
            body = index + 1 + len(assistant_header)
            if prompt[index + 1 : body] != assistant_header:
                return []
            return prompt[body:]
    return []


def parse_hermes_tool_calls(text: str, rng: random.Random) -> Message | None:
    """The assistant message vLLM's Hermes parser makes of ``text``, or None.

    None when there is no ``<tool_call>`` or any block fails to parse; then vLLM returns
    the whole text as content. Otherwise the content is the text before the first block.
    """
    start = text.find("<tool_call>")
    if start < 0:
        return None
    calls: list[ToolCall] = []
    for closed, unclosed in _TOOL_CALL.findall(text):
        try:
            payload = json.loads(closed or unclosed)
        except json.JSONDecodeError:
            return None
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            return None
        if "arguments" not in payload:
            return None
        arguments = json.dumps(payload["arguments"], ensure_ascii=False)
        call_id = f"call_{rng.getrandbits(96):024x}"
        calls.append(ToolCall(id=call_id, function=FunctionCall(payload["name"], arguments)))
    return Message(role="assistant", content=text[:start] or None, tool_calls=calls)


def _make_logprob_table(size: int) -> list[float]:
    rng = random.Random(0x6C6F6770726F6273)
    return [-(rng.expovariate(4.0) + 1e-4) for _ in range(size)]


# Sampled-token logprobs are read off this table from a per-request offset: deterministic,
# plausible (negative, mostly near zero) and cheap, since a reply may have thousands.
_LOGPROB_TABLE = _make_logprob_table(8191)


def logprobs(key: int, count: int) -> list[float]:
    """``count`` logprobs for the request whose seed key is ``key``."""
    table = _LOGPROB_TABLE
    offset = key % len(table)
    values = table[offset : offset + count]
    while len(values) < count:
        values += table[: count - len(values)]
    return values
