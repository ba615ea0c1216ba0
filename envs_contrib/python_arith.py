"""``python_arith``: small arithmetic, computed with Python in a sandbox (the RL demo's env).

``python_math``'s problems are beyond a 135M model: its reward there is always 0, and
GRPO learns nothing from a group whose rewards are all equal. Here each task (from its
seed) is one arithmetic expression of small whole numbers, such as ``37 * 12 + 5`` or
``(86 + 18) * 20``; printing it is within SmolLM2-135M's reach on some samples and not
on others. The model's programs run in the same locked-down container as
``python_math``'s (fenced code blocks or ``run_python`` calls).

The reward, computed on the host from the expected value:

- 1.0 when the last whole number of the final answer is the expression's value;
- 0.5 when it is not, but one of the model's programs printed that value (as its output's
  last whole number): the computation was right and the answer misreported it;
- 0.0 otherwise.

Measured on the embedded model (real vLLM on CPU, Docker sandboxes) at the demo's sampling
settings (temperature 0.7, 512 tokens a turn), on a 2-core machine shared with five other
jobs (vLLM made 5-15 generated tokens/s instead of ~560), so both runs were stopped at
25 minutes with 16 of their 64 trajectories cancelled (no reward, left out below)::

    libra rollout --config examples/demo.toml -n 64 --samples-per-prompt 4 \
        --concurrency 16 --seed S --out f.jsonl
    python examples/reward_spread.py f.jsonl

    seed                                   0            1
    trajectories ended                     23           27
    mean reward                            0.20         0.17
    ... without the 9 / 10 cut by max_wall_s  0.29         0.21
    full credit (1.0)                      3            1
    groups of >= 2 samples with spread     5 of 6       5 of 6
    mean turns                             2.7          2.9
    programs run in containers             38           52

Most reward is the computed credit: SmolLM2-135M often prints the right value and then
misstates it, which is what GRPO has to teach it.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable

from envs_contrib.python_math import PythonMath
from libra.envs import ToolResult, tool

_INTEGER = re.compile(r"-?\d+")
#: A program's right output earns this much when the final answer does not state it.
COMPUTED_CREDIT = 0.5


def _product_plus(rng: random.Random) -> tuple[str, int]:
    a, b, c = rng.randint(11, 99), rng.randint(3, 29), rng.randint(2, 99)
    return f"{a} * {b} + {c}", a * b + c


def _product_minus(rng: random.Random) -> tuple[str, int]:
    a, b, c = rng.randint(11, 99), rng.randint(3, 29), rng.randint(2, 99)
    return f"{a} * {b} - {c}", a * b - c


def _sum_times(rng: random.Random) -> tuple[str, int]:
    a, b, c = rng.randint(11, 99), rng.randint(2, 99), rng.randint(3, 29)
    return f"({a} + {b}) * {c}", (a + b) * c


def _triple_product(rng: random.Random) -> tuple[str, int]:
    a, b, c = rng.randint(11, 99), rng.randint(3, 29), rng.randint(2, 99)
    return f"{a} * {b} * {c}", a * b * c


def _long_sum(rng: random.Random) -> tuple[str, int]:
    numbers = [rng.randint(2, 99) for _ in range(rng.randint(4, 6))]
    return " + ".join(map(str, numbers)), sum(numbers)


SHAPES: list[Callable[[random.Random], tuple[str, int]]] = [
    _product_plus,
    _product_minus,
    _sum_times,
    _triple_product,
    _long_sum,
]


def last_integer(text: str) -> int | None:
    numbers = _INTEGER.findall(text.replace(",", ""))
    return int(numbers[-1]) if numbers else None


class PythonArith(PythonMath):
    """Small arithmetic expressions; the model prints them with Python in a sandbox."""

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        self.expression, self.expected = rng.choice(SHAPES)(rng)
        self.ran_code = False
        self.computed = False
        # Worded so for a reason: "print ... with one line of Python" gets a bare print()
        # from SmolLM2-135M far more often than "write a program" (which gets functions
        # that read input()) or a worked example (which it copies, numbers and all).
        return (
            f"Print the value of {self.expression} with one line of Python."
            " When you have seen its output, answer with 'The answer is N.'"
        )

    @tool
    async def run_python(self, code: str) -> ToolResult:
        """Run a Python 3 program and return what it prints (stdout, then stderr).

        Args:
            code: the program; print the values you want to see
        """
        result = await super().run_python(code)
        if result.status == "success" and last_integer(result.content) == self.expected:
            self.computed = True
        return result

    def reward(self, answer: str) -> float:
        if last_integer(answer) == self.expected:
            return 1.0
        return COMPUTED_CREDIT if self.computed else 0.0
