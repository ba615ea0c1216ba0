"""The OpenAI / vLLM wire format, as msgspec structs.

Both sides of the wire use these: the engine's client encodes requests and decodes
responses, the emulated server decodes requests and encodes responses. Only the fields
Libra reads or writes are declared; unknown fields are ignored on decode, and ``None``
fields are left out on encode so any OpenAI-compatible server accepts the request.
vLLM's extensions used here: ``return_token_ids`` (ids of prompt and completion),
``priority`` (with ``--scheduling-policy priority``), ``/tokenize`` and ``/detokenize``.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

# Libra's own headers on the OpenAI surface (``libra serve``'s, read by its clients too).
#: Names the session (an agent's episode) a call belongs to: the gateway's scheduler
#: sees its turns as one trajectory.
SESSION_HEADER = "X-Libra-Session"
#: Marks the answers of the gateway's admin API.
ADMIN_HEADER = "X-Libra-Admin"


# ``gc=False``: wire documents hold only text, numbers and containers, never a cycle,
# so the cyclic collector need not track them. Decoding a chat response makes one
# struct per sampled token (its logprob): untracked, they neither trigger collections
# nor lengthen them.
class _Wire(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=False, gc=False):
    pass


# ----------------------------------------------------------------------------- messages


class FunctionCall(_Wire):
    name: str
    arguments: str  # a JSON document, as the model wrote it (may be malformed)


class ToolCall(msgspec.Struct, forbid_unknown_fields=False, gc=False):
    # Not omit_defaults: OpenAI and vLLM require "type" on every tool call, default or not.
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class Message(_Wire):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


# ----------------------------------------------------------------------------- requests


class ChatCompletionRequest(_Wire):
    model: str
    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    logprobs: bool | None = None
    return_token_ids: bool | None = None
    priority: int | None = None
    stop: list[str] | None = None
    include_stop_str_in_output: bool | None = None
    stream: bool | None = None


class CompletionRequest(_Wire):
    model: str
    prompt: list[int] | str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    logprobs: int | None = None
    return_token_ids: bool | None = None
    priority: int | None = None
    stop: list[str] | None = None
    include_stop_str_in_output: bool | None = None
    stream: bool | None = None
    skip_special_tokens: bool | None = None


class TokenizeRequest(_Wire):
    model: str
    messages: list[Message] | None = None
    prompt: str | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool | None = None
    add_special_tokens: bool | None = None


class DetokenizeRequest(_Wire):
    model: str
    tokens: list[int]


# ---------------------------------------------------------------------------- responses


class Usage(_Wire):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class TokenLogprob(_Wire):
    token: str
    logprob: float


class ChatLogprobs(_Wire):
    content: list[TokenLogprob] | None = None


class ChatChoice(_Wire):
    index: int
    message: Message
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM: the stop string or token that ended it
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = None


class ChatCompletion(_Wire):
    id: str
    choices: list[ChatChoice]
    model: str = ""
    object: str = "chat.completion"
    created: int = 0
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


class CompletionLogprobs(_Wire):
    token_logprobs: list[float | None] | None = None
    tokens: list[str] | None = None


class CompletionChoice(_Wire):
    index: int
    text: str
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class Completion(_Wire):
    id: str
    choices: list[CompletionChoice]
    model: str = ""
    object: str = "text_completion"
    created: int = 0
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


class TokenizeResponse(_Wire):
    tokens: list[int]
    count: int = 0
    max_model_len: int = 0


class DetokenizeResponse(_Wire):
    prompt: str


class ErrorBody(_Wire):
    message: str
    type: str = "invalid_request_error"
    code: int = 400


class ErrorResponse(_Wire):
    error: ErrorBody


def tool_schema(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """One tool in the OpenAI function-calling schema."""
    return {
        "type": "function",
        "function": {"name": name, "description": description, "parameters": parameters},
    }
