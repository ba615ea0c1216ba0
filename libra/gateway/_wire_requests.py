"""The public OpenAI API of ``libra serve``, its requests: strict structs, decoded and checked,
and turned into the core's protocol (``_wire_replies.py`` holds the replies).

``libra.openai``'s structs are lenient on purpose (the emulated server must accept what
any client of vLLM sends); these are strict: a request is decoded with unknown fields
forbidden, and every field that is declared but cannot be honoured is refused too. A
refused field is an HTTP 400 in OpenAI's error shape naming it (``param``), never
silently dropped. What real clients send is accepted: ``stop`` as a string or a list,
content as a string or a list of text parts, the ``developer`` role (a system message),
``n`` of 1, ``tool_choice`` ``"auto"`` or ``"none"``, ``max_completion_tokens`` or
``max_tokens``, ``stream`` with ``stream_options.include_usage``, ``user``, ``metadata``.
"""

from __future__ import annotations

import re
from typing import Any, Literal

import msgspec

from libra import openai
from libra.gateway._protocol import ChatTurn
from libra.signals import ToolStatus

# OpenAI's request fields that libra serve knows and refuses (a clearer 400 than
# "unrecognized"): nothing behind it could honour them.
_UNSUPPORTED = frozenset(
    {
        "frequency_penalty",
        "presence_penalty",
        "logit_bias",
        "response_format",
        "reasoning_effort",
        "service_tier",
        "modalities",
        "audio",
        "prediction",
        "web_search_options",
        "functions",
        "function_call",
        "store",
        "best_of",
        "echo",
        "suffix",
        "verbosity",
    }
)
SESSION_METADATA = "libra_session"
_UNKNOWN = re.compile(r"Object contains unknown field `([^`]*)`(?: - at `\$\.?([^`]*)`)?")
_AT = re.compile(r" - at `\$\.?([^`]*)`")


class WireError(Exception):
    """A request the API refuses: HTTP ``status``, OpenAI's error fields."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        status: int = 400,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.kind = kind
        self.code = code


class _Strict(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    pass


# ------------------------------------------------------------------------ messages


class TextPart(_Strict, tag="text", tag_field="type"):
    text: str


class ImagePart(_Strict, tag="image_url", tag_field="type"):
    image_url: dict[str, Any]


class AudioPart(_Strict, tag="input_audio", tag_field="type"):
    input_audio: dict[str, Any]


class FilePart(_Strict, tag="file", tag_field="type"):
    file: dict[str, Any]


ContentPart = TextPart | ImagePart | AudioPart | FilePart


class FunctionCallIn(_Strict):
    name: str
    arguments: str


class ToolCallIn(_Strict):
    id: str
    function: FunctionCallIn
    type: Literal["function"] = "function"


class MessageIn(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None  # an assistant message handed back as the SDK parsed it


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(msgspec.Struct, forbid_unknown_fields=True):
    # Not omit_defaults: the tool goes upstream as it came, "type" included.
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    function: NamedFunction
    type: Literal["function"] = "function"


class StreamOptions(_Strict):
    include_usage: bool | None = None


# ------------------------------------------------------------------------ requests


class ChatRequest(_Strict):
    model: str
    messages: list[MessageIn]
    tools: list[ToolDef] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None


class CompletionRequest(_Strict):
    model: str
    prompt: str | list[int]
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    logprobs: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extensions, for a trainer's exact records: the sampled ids and (with
    # ``logprobs`` 0) each one's logprob come back; ``priority`` is accepted and replaced
    # by the gateway's own scheduler's.
    return_token_ids: bool | None = None
    priority: int | None = None


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM's): a chat rendered into token ids by the model's template,
    what a trainer's engine needs to send exact token prompts to ``/v1/completions``."""

    model: str
    messages: list[openai.Message]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool | None = None


class ToolOutcome(_Strict):
    name: str
    status: ToolStatus


class ReportRequest(_Strict):
    """``POST /v1/libra/report``: a client's own account of its session."""

    session: str
    tool: ToolOutcome | None = None
    reward: float | None = None
    done: bool = False


class ReloadRequest(_Strict):
    """``POST /admin/reload_weights``."""

    path: str
    version: int


_chat_decoder = msgspec.json.Decoder(ChatRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)


def decode(decoder: msgspec.json.Decoder[Any], body: bytes) -> Any:
    """``body`` decoded; a 400 naming the field at fault when it does not fit."""
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as error:
        raise _field_error(str(error)) from None
    except msgspec.DecodeError as error:
        raise WireError(f"The request body is not valid JSON: {error}") from None


def _field_error(text: str) -> WireError:
    unknown = _UNKNOWN.search(text)
    if unknown is not None:
        field, at = unknown.group(1), unknown.group(2)
        param = f"{at}.{field}" if at else field
        if field in _UNSUPPORTED and not at:
            return WireError(f"`{field}` is not supported by libra serve.", param=param)
        return WireError(f"Unrecognized request argument supplied: {param}", param=param)
    at = _AT.search(text)
    return WireError(f"Invalid request: {text}", param=at.group(1) if at else None)


def decode_chat(body: bytes) -> ChatRequest:
    request: ChatRequest = decode(_chat_decoder, body)
    _check_chat(request)
    return request


def decode_completion(body: bytes) -> CompletionRequest:
    request: CompletionRequest = decode(_completion_decoder, body)
    _check_n(request.n)
    if request.logprobs not in (None, 0):
        raise WireError(
            "Only `logprobs` 0 (each sampled token's logprob) is supported by libra serve.",
            param="logprobs",
        )
    if isinstance(request.prompt, str) and not request.prompt:
        raise WireError("The prompt cannot be empty.", param="prompt")
    return request


def _check_chat(request: ChatRequest) -> None:
    _check_n(request.n)
    if not request.messages:
        raise WireError("`messages` must hold at least one message.", param="messages")
    if isinstance(request.tool_choice, NamedToolChoice) or request.tool_choice == "required":
        raise WireError(
            "Only tool_choice 'auto' and 'none' are supported by libra serve.", param="tool_choice"
        )
    if request.logprobs:
        raise WireError("`logprobs` are not returned by libra serve.", param="logprobs")
    if request.stream_options is not None and not request.stream:
        message = "`stream_options` is only allowed when `stream` is true."
        raise WireError(message, param="stream_options")
    if request.top_logprobs is not None:
        raise WireError("`top_logprobs` are not returned by libra serve.", param="top_logprobs")
    for name in ("max_completion_tokens", "max_tokens"):
        value = getattr(request, name)
        if value is not None and value < 1:
            raise WireError(f"`{name}` must be at least 1, got {value}.", param=name)


def _check_n(n: int | None) -> None:
    if n is not None and n != 1:
        raise WireError(
            f"n={n} is not supported: libra serve samples one choice per request "
            "(send n requests, each its own session, to sample several).",
            param="n",
        )


# ----------------------------------------------------------------- to the protocol


def chat_turn(request: ChatRequest, session: str | None) -> ChatTurn:
    """The core's view of a validated request. Its session key: ``session`` (the
    documented header ``X-Libra-Session``) when the client sent it, else the request's
    ``metadata["libra_session"]``, else its ``user``; none: the core finds it by prefix."""
    tools: list[dict[str, object]] = []
    if request.tools and request.tool_choice != "none":
        tools = [msgspec.to_builtins(tool) for tool in request.tools]
    max_tokens = request.max_completion_tokens
    if max_tokens is None:
        max_tokens = request.max_tokens
    return ChatTurn(
        messages=[_message(m, i) for i, m in enumerate(request.messages)],
        tools=tools,
        max_tokens=max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
        stop=_stop_list(request.stop),
        session=session or _metadata_session(request.metadata) or request.user,
    )


def _metadata_session(metadata: dict[str, str] | None) -> str | None:
    return metadata.get(SESSION_METADATA) if metadata else None


def _message(message: MessageIn, index: int) -> openai.Message:
    role = "system" if message.role == "developer" else message.role
    calls = None
    if message.tool_calls:
        if role != "assistant":
            param = f"messages[{index}].tool_calls"
            raise WireError("Only assistant messages carry tool_calls.", param=param)
        calls = [
            openai.ToolCall(c.id, openai.FunctionCall(c.function.name, c.function.arguments))
            for c in message.tool_calls
        ]
    if role == "tool" and message.tool_call_id is None:
        param = f"messages[{index}].tool_call_id"
        raise WireError("A tool message needs the tool_call_id it answers.", param=param)
    return openai.Message(
        role=role,
        content=_text(message.content, index),
        tool_calls=calls,
        tool_call_id=message.tool_call_id,
        name=message.name,
    )


def _text(content: str | list[ContentPart] | None, index: int) -> str | None:
    if content is None or isinstance(content, str):
        return content
    texts: list[str] = []
    for number, part in enumerate(content):
        if not isinstance(part, TextPart):
            kind = type(part).__struct_config__.tag
            param = f"messages[{index}].content[{number}]"
            raise WireError(
                f"Content parts of type '{kind}' are not supported: the models behind "
                "libra serve read text only.",
                param=param,
            )
        texts.append(part.text)
    return "".join(texts)


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else stop


def upstream_completion(request: CompletionRequest, model: str) -> openai.CompletionRequest:
    """The ``/v1/completions`` request the core forwards (to the upstream's ``model``)."""
    return openai.CompletionRequest(
        model=model,
        prompt=request.prompt,
        max_tokens=request.max_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        seed=request.seed,
        stop=_stop_list(request.stop) or None,
        logprobs=request.logprobs,
        return_token_ids=request.return_token_ids,
    )
