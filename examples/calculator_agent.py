"""An agent as people write them: a loop over the plain ``openai`` SDK with a tool of its
own, trained as it is by ``libra train --config examples/agent.toml``.

Libra calls ``solve(task, client)`` once per sample: ``client`` is an
``openai.AsyncOpenAI`` whose calls Libra's scheduler routes and records token-exact;
the return value is the episode's reward. Nothing here imports Libra.
"""

from __future__ import annotations

import ast
import json
import operator
import random
import re
from typing import Any

CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression with + - * / and parentheses.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_OPERATORS |= {ast.Div: operator.truediv, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """The agent's own tool: arithmetic only (no ``eval``), an error as text."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError("only numbers and + - * / ( )")

    try:
        return f"{value(ast.parse(expression, mode='eval').body):g}"
    except (SyntaxError, ValueError, ZeroDivisionError) as error:
        return f"error: {error}"


async def solve(task: Any, client: Any, max_turns: int = 3) -> float:
    """One episode: a question from the task's seed, up to ``max_turns`` model calls
    (each tool call answered), then a reward that is higher the closer the answer."""
    rng = random.Random(task.seed)
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
    truth = a + b * c
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Use the calculate tool, then give the number."},
        {"role": "user", "content": f"What is {a} + {b} * {c}?"},
    ]
    for _ in range(max_turns):
        reply = await client.chat.completions.create(
            model="policy", messages=messages, tools=[CALCULATOR], max_tokens=96
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except (json.JSONDecodeError, AttributeError):
                expression = ""
            result = calculate(str(expression))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    numbers = re.findall(r"-?\d+(?:\.\d+)?", messages[-1].get("content") or "")
    if not numbers:
        return 0.0
    return 1.0 / (1.0 + abs(float(numbers[-1]) - truth) / truth)
