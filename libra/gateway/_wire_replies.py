"""The public OpenAI API of ``libra serve``, its replies: chat completions and their stream
chunks, completions, and errors, in OpenAI's shape."""

from __future__ import annotations

import msgspec

from libra import openai
from libra.gateway._protocol import ChatReply


class FunctionOut(msgspec.Struct):
    name: str
    arguments: str


class ToolCallOut(msgspec.Struct):
    id: str
    function: FunctionOut
    type: str = "function"


class AssistantOut(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


_CHUNK = "chat.completion.chunk"


class Usage(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class ChoiceOut(msgspec.Struct):
    index: int
    message: AssistantOut
    finish_reason: str
    logprobs: None = None


class ChatCompletionOut(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChoiceOut]
    usage: Usage


class FunctionDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionDelta | None = None


class Delta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(msgspec.Struct):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: None = None


class ChatChunk(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None


class ErrorFields(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorOut(msgspec.Struct):
    error: ErrorFields


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)


def tool_calls_out(reply: ChatReply, parallel: bool) -> list[ToolCallOut]:
    """The reply's tool calls; only the first when the client asked for no parallel ones."""
    calls = reply.tool_calls if parallel else reply.tool_calls[:1]
    return [ToolCallOut(c.id, FunctionOut(c.function.name, c.function.arguments)) for c in calls]


class Head(msgspec.Struct, frozen=True):
    """What every object of one answer repeats, and whether tool calls may be parallel."""

    id: str
    created: int
    model: str
    parallel: bool = True


def chat_completion(reply: ChatReply, head: Head) -> ChatCompletionOut:
    id, created, model = head.id, head.created, head.model
    calls = tool_calls_out(reply, head.parallel)
    message = AssistantOut("assistant", reply.content, calls or None)
    choice = ChoiceOut(0, message, reply.finish_reason)
    tokens = usage(reply.prompt_tokens, reply.completion_tokens)
    return ChatCompletionOut(id, "chat.completion", created, model, [choice], tokens)


def chat_chunks(reply: ChatReply, head: Head, include_usage: bool) -> list[ChatChunk]:
    """The reply as OpenAI's stream: the role, the content, each tool call (its id and
    name, then its arguments), the finish reason, and the usage when asked for."""
    id, created, model = head.id, head.created, head.model
    deltas = [Delta(role="assistant", content="")]
    if reply.content:
        deltas.append(Delta(content=reply.content))
    for index, call in enumerate(tool_calls_out(reply, head.parallel)):
        named = FunctionDelta(name=call.function.name, arguments="")
        deltas.append(Delta(tool_calls=[ToolCallDelta(index, call.id, "function", named)]))
        arguments = FunctionDelta(arguments=call.function.arguments)
        deltas.append(Delta(tool_calls=[ToolCallDelta(index, function=arguments)]))
    chunks = [ChatChunk(id, _CHUNK, created, model, [ChunkChoice(0, delta)]) for delta in deltas]
    finish = ChunkChoice(0, Delta(), reply.finish_reason)
    chunks.append(ChatChunk(id, _CHUNK, created, model, [finish]))
    if include_usage:
        tokens = usage(reply.prompt_tokens, reply.completion_tokens)
        chunks.append(ChatChunk(id, _CHUNK, created, model, [], usage=tokens))
    return chunks


class CompletionChunkChoice(msgspec.Struct):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: None = None


class CompletionChunk(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChunkChoice]
    usage: Usage | None = None


def completion_chunks(completion: CompletionOut, include_usage: bool) -> list[CompletionChunk]:
    """A whole completion as OpenAI's stream: its text, then its finish reason."""
    choice = completion.choices[0]
    head = (completion.id, "text_completion", completion.created, completion.model)
    chunks = [
        CompletionChunk(*head, [CompletionChunkChoice(0, choice.text)]),
        CompletionChunk(*head, [CompletionChunkChoice(0, "", choice.finish_reason)]),
    ]
    if include_usage:
        chunks.append(CompletionChunk(*head, [], usage=completion.usage))
    return chunks


class CompletionLogprobsOut(msgspec.Struct):
    token_logprobs: list[float | None]


class CompletionChoiceOut(msgspec.Struct):
    """A choice; ``token_ids`` and ``stop_reason`` only when the request asked for ids."""

    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobsOut | None = None
    token_ids: list[int] | msgspec.UnsetType = msgspec.UNSET
    stop_reason: int | str | msgspec.UnsetType | None = msgspec.UNSET


class CompletionOut(msgspec.Struct):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoiceOut]
    usage: Usage


def public_completion(
    completion: openai.Completion, model: str, *, token_ids: bool = False
) -> CompletionOut:
    """The upstream's completion as the client sees it: its model name, and the sampled
    ids and their logprobs only when the request asked for them."""
    choices = [_public_choice(c, token_ids=token_ids) for c in completion.choices]
    counted = completion.usage or openai.Usage()
    tokens = usage(counted.prompt_tokens, counted.completion_tokens)
    return CompletionOut(
        completion.id, "text_completion", completion.created, model, choices, tokens
    )


def _public_choice(choice: openai.CompletionChoice, *, token_ids: bool) -> CompletionChoiceOut:
    logprobs = choice.logprobs
    out = CompletionChoiceOut(choice.index, choice.text, choice.finish_reason)
    if logprobs is not None and logprobs.token_logprobs is not None:
        out.logprobs = CompletionLogprobsOut(logprobs.token_logprobs)
    if token_ids and choice.token_ids is not None:
        out.token_ids, out.stop_reason = choice.token_ids, choice.stop_reason
    return out
