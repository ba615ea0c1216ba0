"""The emulator's byte tokenizer and ChatML template."""

from __future__ import annotations

import json
from typing import Any

import pytest

from libra.emulation import (
    EOS_ID,
    IM_END_ID,
    IM_START_ID,
    ByteTokenizer,
    render_chat,
    render_chat_text,
)
from libra.openai import FunctionCall, Message, ToolCall
from tests._helpers import CALCULATOR, conversation

tokenizer = ByteTokenizer()


@pytest.mark.parametrize(
    "text", ["", "hello", "Ünïcödé ✓ 日本語 🚀", "a<|im_end|>b<|im_start|>c", "<|endoftext|>"]
)
def test_encode_decode_round_trip(text: str) -> None:
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_special_tokens_become_ids_only_when_allowed() -> None:
    assert tokenizer.encode("<|im_start|>hi<|im_end|>") == [IM_START_ID, 104, 105, IM_END_ID]
    assert tokenizer.encode("<|im_end|>", allow_special=False) == list(b"<|im_end|>")
    assert EOS_ID == IM_END_ID == 258


def test_decode_skips_special_tokens_on_request_and_rejects_unknown_ids() -> None:
    ids = [IM_START_ID, *b"hi", IM_END_ID, 256]
    assert tokenizer.decode(ids) == "<|im_start|>hi<|im_end|><|endoftext|>"
    assert tokenizer.decode(ids, skip_special=True) == "hi"
    with pytest.raises(ValueError, match="out of vocabulary"):
        tokenizer.decode([1, 259])


def test_token_text_for_logprobs() -> None:
    assert [tokenizer.token_text(i) for i in (104, IM_END_ID, 0xE2)] == ["h", "<|im_end|>", "\\xe2"]


def test_template_text_matches_chatml_with_tools() -> None:
    text = render_chat_text(conversation()[:3], [CALCULATOR], add_generation_prompt=False)
    assert text == (
        "<|im_start|>system\nYou are careful.\n\n# Tools\n\nYou may call one or more functions "
        "to assist with the user query.\n\nYou are provided with function signatures within "
        f"<tools></tools> XML tags:\n<tools>\n{json.dumps(CALCULATOR)}\n</tools>\n\nFor each "
        "function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\nWhat is 6 times 7? Ünïcödé ✓<|im_end|>\n"
        "<|im_start|>assistant\nLet me compute.\n<tool_call>\n"
        '{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call><|im_end|>\n'
    )


def test_template_without_system_or_tools_and_with_generation_prompt() -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "tool", "content": "7"}]
    text = render_chat_text(messages, add_generation_prompt=True)
    expected = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>tool\n7<|im_end|>\n"
    assert text == expected + "<|im_start|>assistant\n"
    tools_only = render_chat_text([{"role": "user", "content": "hi"}], [CALCULATOR])
    assert tools_only.startswith("<|im_start|>system\n\n\n# Tools\n")


def test_template_is_prefix_stable_and_decodes_to_its_text() -> None:
    messages = conversation()
    full = render_chat(messages, [CALCULATOR])
    for k in range(1, len(messages) + 1):
        assert full[: len(render_chat(messages[:k], [CALCULATOR]))] == render_chat(
            messages[:k], [CALCULATOR]
        )
    assert tokenizer.decode(full) == render_chat_text(messages, [CALCULATOR])
    assert tokenizer.render_chat(messages, [CALCULATOR]) == full


def test_plain_dict_messages_render_like_structs() -> None:
    as_dicts: list[dict[str, Any]] = [
        {"role": "user", "content": "q"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}
            ],
        },
    ]
    call = ToolCall(id="c", function=FunctionCall("f", "{}"))
    as_structs = [
        Message(role="user", content="q"),
        Message(role="assistant", tool_calls=[call]),
    ]
    assert render_chat(as_dicts) == render_chat(as_structs)
