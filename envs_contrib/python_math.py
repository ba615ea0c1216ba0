"""``python_math``: number problems that reward computing, with Python in a sandbox.

Each task is generated from its seed (sums of primes, divisibility counts, modular
powers, Fibonacci digit sums) and asks for a program that prints the answer; the answer
is computed here, on the host. The model's programs (fenced code blocks, or
``run_python`` tool calls) run in a locked-down container (no network, read-only root,
non-root user, memory/CPU/pids limits); the reward is 1 when the last whole number in
its final answer is exactly right.
"""

from __future__ import annotations

import random
import re
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

from libra.envs import (
    Env,
    ExecResult,
    HermesToolCallParser,
    SandboxSpec,
    ToolCall,
    ToolResult,
    tool,
)

_INTEGER = re.compile(r"-?\d+")
_OUTPUT_CHARS = 4000
_CODE_BLOCK = re.compile(r"```(?:python|py)\s*\n(.*?)(?:```|$)", re.DOTALL)


class CodeBlockParser(HermesToolCallParser):
    """Hermes ``<tool_call>`` blocks, and fenced Python code as a ``run_python`` call.

    Small models write a Markdown code block far more reliably than a JSON tool call;
    running it is what they mean. SmolLM2-135M also often drops the opening fence yet
    closes the block: a reply that is a Python program followed by a lone fence runs too.
    """

    def parse(self, text: str) -> list[ToolCall]:
        calls = super().parse(text)
        if calls:
            return calls
        blocks = _CODE_BLOCK.findall(text) or _unopened_block(text)
        return [ToolCall(f"code_{i}", "run_python", {"code": b}) for i, b in enumerate(blocks)]

    def describe(self, tools: list[dict[str, Any]]) -> str:
        # Short on purpose: a 135M-parameter model follows this, not a JSON tool schema.
        return (
            "You can run Python: write a program in a ```python code block and you will see"
            " what it prints."
        )


def _unopened_block(text: str) -> list[str]:
    """The program before a reply's only fence, its closing one, if it compiles."""
    head, fence, tail = text.rstrip().rpartition("```")
    if not fence or tail or "```" in head:
        return []
    try:
        with warnings.catch_warnings():  # the model's odd escapes are not our warnings
            warnings.simplefilter("ignore")
            compile(head, "<reply>", "exec")  # parses only: nothing runs on the host
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []  # prose before a fence: more likely an opening fence than a program
    return [head]


def _program_output(result: ExecResult, timeout_s: float) -> str:
    """What the model reads of its program's run: the output's tail and how it ended."""
    output = (result.stdout + result.stderr)[-_OUTPUT_CHARS:]
    if result.timed_out:
        return f"{output}\nError: the program ran longer than {timeout_s:g} s and was killed"
    if result.exit_code != 0:
        return f"{output}\n(exit code {result.exit_code})"
    return output or "(the program printed nothing)"


def _primes_below(n: int) -> list[int]:
    sieve = bytearray([1]) * n
    sieve[:2] = b"\x00\x00"
    for i in range(2, int(n**0.5) + 1):
        if sieve[i]:
            sieve[i * i :: i] = bytearray(len(sieve[i * i :: i]))
    return [i for i, is_prime in enumerate(sieve) if is_prime]


def _fibonacci(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a


def _task_prime_sum(rng: random.Random) -> tuple[str, int]:
    n = rng.randint(1_000, 200_000)
    return f"the sum of all prime numbers below {n}", sum(_primes_below(n))


def _task_divisible(rng: random.Random) -> tuple[str, int]:
    n, (a, b) = rng.randint(10_000, 10_000_000), rng.sample(range(3, 41), 2)
    count = n // a + n // b - n // (a * b // _gcd(a, b))
    return f"how many integers from 1 to {n} are divisible by {a} or by {b}", count


def _task_modpow(rng: random.Random) -> tuple[str, int]:
    base, exponent, modulus = (
        rng.randint(2, 999),
        rng.randint(10**5, 10**9),
        rng.randint(10**3, 10**6),
    )
    return f"{base} to the power {exponent}, modulo {modulus}", pow(base, exponent, modulus)


def _task_fibonacci_digits(rng: random.Random) -> tuple[str, int]:
    n = rng.randint(200, 3_000)
    digits = str(_fibonacci(n))
    return f"the sum of the decimal digits of Fibonacci number F({n}), with F(1) = 1", sum(
        map(int, digits)
    )


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


_TASKS: list[Callable[[random.Random], tuple[str, int]]] = [
    _task_prime_sum,
    _task_divisible,
    _task_modpow,
    _task_fibonacci_digits,
]


class PythonMath(Env):
    """Number problems; the model may run Python in a sandbox."""

    max_turns = 6
    tool_timeout_s = 20.0
    #: A program's own time limit in the sandbox (within the tool's ``tool_timeout_s``).
    program_timeout_s: ClassVar[float] = 10.0
    sandbox_spec = SandboxSpec(image="libra/python", memory_mb=256, cpus=1.0, pids=64)
    tool_call_parser = CodeBlockParser()
    # End the turn at the code block's closing fence: the program runs at once, and a
    # small model does not go on to invent its output (or ramble into the token limit).
    stop_strings = ("\n```\n",)

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        what, self.expected = rng.choice(_TASKS)(rng)
        self.ran_code = False
        return (
            f"Write a Python program that prints {what}. When you have seen its output,"
            " answer with 'The answer is N.'"
        )

    @tool
    async def run_python(self, code: str) -> ToolResult:
        """Run a Python 3 program and return what it prints (stdout, then stderr).

        Args:
            code: the program; print the values you want to see
        """
        self.ran_code = True
        timeout_s = self.program_timeout_s
        result = await self.sandbox.exec(["python3", "-"], stdin=code.encode(), timeout_s=timeout_s)
        # The status comes from the sandbox (exit code, timeout), not from the text.
        return ToolResult(_program_output(result, timeout_s), result.status)

    def on_reply(self, text: str) -> str | None:
        if self.ran_code:
            return None  # the model has seen its program's output: this is its answer
        return "Please write the program in a ```python code block, so that it can be run."

    def reward(self, answer: str) -> float:
        numbers = _INTEGER.findall(answer.replace(",", ""))
        return 1.0 if numbers and int(numbers[-1]) == self.expected else 0.0
