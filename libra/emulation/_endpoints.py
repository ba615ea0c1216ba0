"""The emulated server's OpenAI endpoints, shaped like vLLM's: ``/v1/models``,
``/v1/chat/completions`` (with the Hermes tool-call parser), ``/v1/completions`` (token-id
prompts, continuing a turn a pause cut short), ``/tokenize`` and ``/detokenize``; and the
generation they share, timed by the app's batching engine. Each handler takes the app."""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from libra._asgi import ClientDisconnected, Receive, cancel_on_disconnect
from libra.emulation._config import EmulatorConfig
from libra.emulation._http import JSON, HTTPError, Response, decode, encode
from libra.emulation._reply import (
    Generation,
    logprobs,
    parse_hermes_tool_calls,
    partial_turn,
    reply_text,
    reply_tokens,
)
from libra.emulation._scripts import Conversation, Reply
from libra.emulation._tokenizer import VOCAB_SIZE, pack_ids
from libra.openai import (
    ChatChoice,
    ChatCompletion,
    ChatCompletionRequest,
    ChatLogprobs,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    Message,
    TokenizeRequest,
    TokenizeResponse,
    TokenLogprob,
    Usage,
)

if TYPE_CHECKING:
    from libra.emulation._app import EmulatorApp

_MAX_LOGPROBS = 20  # vLLM's default --max-logprobs

_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_completion_decoder = msgspec.json.Decoder(CompletionRequest)
_tokenize_decoder = msgspec.json.Decoder(TokenizeRequest)
_detokenize_decoder = msgspec.json.Decoder(DetokenizeRequest)


def models_body(config: EmulatorConfig) -> bytes:
    """The ``/v1/models`` answer (made once per app)."""
    card = {
        "id": config.model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "libra",
        "root": config.model_name,
        "max_model_len": config.max_model_len,
    }
    return encode({"object": "list", "data": [card]})


async def list_models(app: EmulatorApp, body: bytes, receive: Receive, query: bytes) -> Response:
    return 200, app.models_body, JSON


# ------------------------------------------------------------------------- tokenizer


async def tokenize(app: EmulatorApp, body: bytes, receive: Receive, query: bytes) -> Response:
    request = decode(_tokenize_decoder, body)
    _check_model(app, request.model)
    if request.messages is not None:
        # vLLM's TokenizeChatRequest adds the generation prompt unless told not to.
        add_generation_prompt = request.add_generation_prompt is not False
        tokens = app.tokenizer.render_chat(
            request.messages, _rendered_tools(app, request.tools), add_generation_prompt
        )
    elif request.prompt is not None:
        tokens = app.tokenizer.encode(request.prompt)
    else:
        raise HTTPError(400, "Either 'prompt' or 'messages' is required.")
    response = TokenizeResponse(
        tokens=tokens, count=len(tokens), max_model_len=app.config.max_model_len
    )
    return 200, encode(response), JSON


async def detokenize(app: EmulatorApp, body: bytes, receive: Receive, query: bytes) -> Response:
    request = decode(_detokenize_decoder, body)
    _check_model(app, request.model)
    _check_token_ids(app, request.tokens)
    response = DetokenizeResponse(prompt=app.tokenizer.decode(request.tokens))
    return 200, encode(response), JSON


# ------------------------------------------------------------------------ generation


async def chat_completions(
    app: EmulatorApp, body: bytes, receive: Receive, query: bytes
) -> Response:
    request = decode(_chat_decoder, body)
    _check_model(app, request.model)
    _check_streaming(request.stream)
    tokenizer = app.tokenizer
    prompt = tokenizer.render_chat(request.messages, _rendered_tools(app, request.tools), True)
    max_new_tokens = _max_new_tokens(app, len(prompt), request.max_tokens)
    fault = await app.faults.strike(receive)
    key = app.seeds.key(prompt, request.seed)
    rng = random.Random(key)
    conversation = Conversation(prompt, request.messages, request.tools or [], rng, tokenizer)
    reply = _run_script(app, conversation)
    generation = reply_tokens(tokenizer, reply.text, request.stop, max_new_tokens)
    generation = app.faults.cut_if_aborted(generation, fault)
    generation = await _generate(app, prompt, generation, request.priority, receive)
    app.seeds.remember_if_aborted(prompt, generation, key, request.seed)
    generated = generation.tokens
    finish_reason: str = generation.finish_reason

    text = reply_text(tokenizer, generation, request.include_stop_str_in_output, True)
    message = Message(role="assistant", content=text)
    if request.tools and finish_reason != "abort":
        parsed = parse_hermes_tool_calls(text, rng)
        if parsed is not None:
            message, finish_reason = parsed, "tool_calls"
    chat_logprobs = None
    if request.logprobs:
        texts = tokenizer.token_texts(generated)
        entries = zip(texts, logprobs(key, len(generated)), strict=True)
        content = [TokenLogprob(text, logprob) for text, logprob in entries]
        chat_logprobs = ChatLogprobs(content=content)
    with_ids = bool(request.return_token_ids)
    choice = ChatChoice(
        index=0,
        message=message,
        finish_reason=finish_reason,
        stop_reason=generation.stop_string,
        logprobs=chat_logprobs,
        token_ids=generated if with_ids else None,
    )
    response = ChatCompletion(
        id=app.new_id("chatcmpl"),
        choices=[choice],
        model=app.config.model_name,
        created=int(time.time()),
        usage=_usage(len(prompt), len(generated)),
        prompt_token_ids=prompt if with_ids else None,
    )
    return 200, app.faults.answer_body(encode(response), fault), JSON


async def completions(app: EmulatorApp, body: bytes, receive: Receive, query: bytes) -> Response:
    request = decode(_completion_decoder, body)
    _check_model(app, request.model)
    _check_streaming(request.stream)
    tokenizer, prompt = app.tokenizer, request.prompt
    if isinstance(prompt, str):
        prompt = tokenizer.encode(prompt)
    packed = pack_ids(prompt)  # once: the checks, the seed, the cache and the decoding
    _check_token_ids(app, prompt, packed)
    if not prompt:
        raise HTTPError(400, "The prompt cannot be empty.")
    if request.logprobs is not None and not 0 <= request.logprobs <= _MAX_LOGPROBS:
        raise HTTPError(400, f"logprobs must be between 0 and {_MAX_LOGPROBS}.")
    max_new_tokens = _max_new_tokens(app, len(prompt), request.max_tokens)
    fault = await app.faults.strike(receive)
    # A prompt that ends inside an assistant turn (a turn a pause cut short) goes on
    # with that turn's reply: the script sees the conversation up to the turn's start,
    # and the reply, its seed and its logprobs are the uninterrupted turn's.
    partial = partial_turn(prompt, app.assistant_header)
    turn_prompt = prompt[: len(prompt) - len(partial)] if partial else prompt
    turn_packed = pack_ids(turn_prompt) if partial else packed
    key = None
    if partial and request.seed is None and packed is not None:
        key = app.seeds.continuation_key(packed)
    if key is None:
        key = app.seeds.key(turn_prompt, request.seed, turn_packed)
    rng = random.Random(key)
    conversation = Conversation.from_prompt(turn_prompt, rng, tokenizer, turn_packed)
    reply = _run_script(app, conversation)
    generation = reply_tokens(tokenizer, reply.text, request.stop, max_new_tokens, partial)
    generation = app.faults.cut_if_aborted(generation, fault)
    generation = await _generate(app, prompt, generation, request.priority, receive, packed)
    app.seeds.remember_if_aborted(prompt, generation, key, request.seed)
    generated = generation.tokens

    skip_special = request.skip_special_tokens is not False
    completion_logprobs = None
    if request.logprobs is not None:
        completion_logprobs = CompletionLogprobs(
            token_logprobs=list(logprobs(key, len(partial) + len(generated))[len(partial) :]),
            tokens=tokenizer.token_texts(generated),
        )
    with_ids = bool(request.return_token_ids)
    text = reply_text(tokenizer, generation, request.include_stop_str_in_output, skip_special)
    choice = CompletionChoice(
        index=0,
        text=text,
        finish_reason=generation.finish_reason,
        stop_reason=generation.stop_string,
        logprobs=completion_logprobs,
        token_ids=generated if with_ids else None,
        prompt_token_ids=prompt if with_ids else None,
    )
    response = Completion(
        id=app.new_id("cmpl"),
        choices=[choice],
        model=app.config.model_name,
        created=int(time.time()),
        usage=_usage(len(prompt), len(generated)),
    )
    return 200, app.faults.answer_body(encode(response), fault), JSON


async def _generate(
    app: EmulatorApp,
    prompt: list[int],
    reply: Generation,
    priority: int | None,
    receive: Receive,
    packed: bytes | None = None,
) -> Generation:
    """Spend the emulated GPU time of a request; abort it if the client goes away.

    Returns the reply as far as it got: cut short (finish reason ``"abort"``) when a
    pause in abort mode stopped it. With prefix caching, the cached part of the prompt
    costs no prefill, and the prompt and reply are cached for the next request that
    starts with them.
    """
    engine, cache = app.engine, app.prefix_cache
    app.prompt_tokens_total += len(prompt)
    if engine is None:
        while app.resumed is not None:  # paused: queue until /resume
            await app.resumed.wait()
        app.generation_tokens_total += len(reply.tokens)
        return reply
    cached, chain, digests = (0, None, []) if cache is None else cache.lookup(prompt, packed)
    produced: int | None = None
    async with anyio.create_task_group() as group:
        group.start_soon(cancel_on_disconnect, receive, group.cancel_scope)
        # A stop string at the very start still cost the model one decode step.
        produced = await engine.generate(
            len(prompt), max(1, len(reply.tokens)), priority=priority or 0, cached_tokens=cached
        )
        group.cancel_scope.cancel()
    if produced is None:
        raise ClientDisconnected
    reply = reply.cut_to(produced)
    app.generation_tokens_total += len(reply.tokens)
    if cache is not None and chain is not None:
        cache.store(digests + chain.extend(reply.tokens))
    return reply


# --------------------------------------------------------------------------- checks


def _rendered_tools(
    app: EmulatorApp, tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]] | None:
    return tools if app.config.template_renders_tools else None


def _check_model(app: EmulatorApp, model: str) -> None:
    if app.config.check_model_name and model != app.config.model_name:
        raise HTTPError(404, f"The model `{model}` does not exist.", "NotFoundError")


def _check_streaming(stream: bool | None) -> None:
    if stream:
        raise HTTPError(400, "Streaming is not supported by the emulated server.")


def _check_token_ids(app: EmulatorApp, ids: list[int], packed: bytes | None = None) -> None:
    if not app.tokenizer.in_vocabulary(ids, packed):
        bad = next(token_id for token_id in ids if not 0 <= token_id < VOCAB_SIZE)
        raise HTTPError(400, f"Token id {bad} is out of vocabulary.")


def _max_new_tokens(app: EmulatorApp, prompt_tokens: int, max_tokens: int | None) -> int:
    """The most tokens a request may generate; 400 when it cannot fit the context."""
    limit = app.config.max_model_len
    if max_tokens is not None and max_tokens < 1:
        raise HTTPError(400, f"max_tokens must be at least 1, got {max_tokens}.")
    if prompt_tokens >= limit:
        raise HTTPError(
            400,
            f"This model's maximum context length is {limit} tokens. However, your "
            f"request has {prompt_tokens} input tokens. Please reduce the length of "
            "the input messages.",
        )
    if max_tokens is None:
        return limit - prompt_tokens
    if prompt_tokens + max_tokens > limit:
        raise HTTPError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you "
            f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the "
            f"messages, {max_tokens} in the completion).",
        )
    return max_tokens


def _run_script(app: EmulatorApp, conversation: Conversation) -> Reply:
    try:
        return app.script(conversation)
    except Exception as error:  # a script bug is the server's error, as a 500
        message = f"Script failed: {type(error).__name__}: {error}"
        raise HTTPError(500, message, "InternalServerError") from error


def _usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )
