"""``calc``: arithmetic word problems with a calculator tool.

Tasks are generated from the seed (a few templates, small integers, answers are whole
numbers); the reward is 1 when the last number in the model's answer is exactly right.
The calculator parses the expression with ``ast`` and evaluates only numbers and
arithmetic operators: no names, calls or attributes, so nothing but arithmetic can run.
"""

from __future__ import annotations

import ast
import operator
import random
import re
from collections.abc import Callable
from fractions import Fraction

from libra.envs import Env, ToolError, tool

_BINARY: dict[type[ast.operator], Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_MAX_EXPONENT = 64
_MAX_DIGITS = 60
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")

_TEMPLATES = [
    "{name} has {a} boxes with {b} apples in each box and gives away {c} apples. "
    "How many apples are left?",
    "A train travels {a} km every hour for {b} hours, then {c} km more. How far does it go?",
    "{name} buys {a} pens at {b} dollars each and pays with a {d} dollar note. "
    "How much change does {name} get?",
    "A farm has {a} rows of {b} trees. A storm knocks down {c} trees. How many trees stand?",
]
_NAMES = ["Ana", "Bo", "Chen", "Dara", "Emil", "Farah", "Goran", "Hana"]


def evaluate(expression: str) -> Fraction:
    """Evaluate an arithmetic expression exactly, or raise ``ToolError`` saying why not."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as exc:
        raise ToolError(f"cannot parse {expression!r}: {exc.msg}") from None
    return _eval(tree.body)


def _eval(node: ast.expr) -> Fraction:
    value = node.value if isinstance(node, ast.Constant) else None
    if isinstance(value, int | float) and not isinstance(value, bool):
        return Fraction(value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        operand = _eval(node.operand)
        return -operand if isinstance(node.op, ast.USub) else operand
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
        return _power(_eval(node.left), _eval(node.right))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if right == 0 and not isinstance(node.op, ast.Add | ast.Sub | ast.Mult):
            raise ToolError("division by zero")
        return _bounded(_BINARY[type(node.op)](left, right))
    raise ToolError(f"only numbers and + - * / // % ** are allowed, not {ast.unparse(node)!r}")


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1 or abs(exponent) > _MAX_EXPONENT:
        raise ToolError(f"exponents must be whole numbers up to {_MAX_EXPONENT}")
    if base == 0 and exponent < 0:
        raise ToolError("division by zero")
    return _bounded(base ** int(exponent))


def _bounded(value: Fraction) -> Fraction:
    if len(str(abs(value.numerator))) > _MAX_DIGITS:
        raise ToolError("the result is too large")
    return value


def format_number(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.10g}"


class Calc(Env):
    """Arithmetic word problems; the model may use a calculator."""

    system_prompt = (
        "Solve the problem. You may use the calculator tool. End with 'The answer is N.'"
    )
    max_turns = 6
    tool_timeout_s = 5.0

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        c = rng.randint(1, a * b - 1)
        d = (a * b // 10 + 1) * 10 + rng.choice([0, 10, 50])
        template = rng.randrange(len(_TEMPLATES))
        self.expected = [a * b - c, a * b + c, d - a * b, a * b - c][template]
        return _TEMPLATES[template].format(name=rng.choice(_NAMES), a=a, b=b, c=c, d=d)

    @tool
    def calculator(self, expression: str) -> str:
        """Evaluate an arithmetic expression exactly.

        Args:
            expression: numbers with + - * / // % ** and parentheses, e.g. "(12*7)-5"
        """
        return format_number(evaluate(expression))

    def reward(self, answer: str) -> float:
        numbers = _NUMBER.findall(answer.replace(",", ""))
        return 1.0 if numbers and Fraction(numbers[-1]) == self.expected else 0.0
