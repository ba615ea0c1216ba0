"""Trajectory scripts: every turn of every trajectory of a workload, drawn in advance.

A trajectory's script is a pure function of the workload, the RL step, the task seed
and the sample index, so the emulated model (which sees the prompt) and the env's
tools (which see the task) play the same script, and a benchmark knows every length in
advance (the oracle and the lower bound) without peeking at a run.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass

from libra.emulation.workloads._format import CheckTool, ExploreTool, Mix, Output, Workload
from libra.envs import TaskId, TrajectoryId
from libra.signals import ToolStatus

#: Template tokens a turn adds besides its content (ChatML headers, tool-call wrapper,
#: tool-response wrapper); generous, so that scripts stay inside the context limit.
TURN_OVERHEAD_TOKENS = 96
#: Tokens the tool schemas add to the system prompt, per tool.
TOOL_SCHEMA_TOKENS = 320


@dataclass(frozen=True, slots=True)
class ScriptTurn:
    """One model turn and, unless it is the final answer, the tool call it makes."""

    output_tokens: int
    tool: str | None = None
    status: ToolStatus = "success"
    output_chars: int = 0
    latency_s: float = 0.0
    passed: bool = False  # a check that solved the task


@dataclass(frozen=True, slots=True)
class TrajectoryScript:
    workload: str
    step: int
    task_seed: int
    sample: int
    prompt_tokens: int
    solve_rate: float
    solved: bool
    turns: tuple[ScriptTurn, ...]
    tool_timeout_s: float  # its workload's: how long a scripted timeout lasts

    @property
    def task_id(self) -> TaskId:
        """Its task, as the engine names it: the workload's env, keyed by the seed."""
        return TaskId(self.workload, str(self.task_seed))

    @property
    def trajectory_id(self) -> TrajectoryId:
        """The engine's id for it (``TrajectoryJob.id``)."""
        return TrajectoryId(self.step, self.task_id, self.sample)

    @property
    def output_tokens(self) -> int:
        return sum(turn.output_tokens for turn in self.turns)

    @property
    def tool_s(self) -> float:
        return sum(turn.latency_s for turn in self.turns)


class ScriptBook:
    """The scripts of one workload, drawn on demand and kept (bounded) once drawn."""

    def __init__(self, workload: Workload, seed: int = 0, max_cached: int = 65536) -> None:
        self.workload = workload
        self.seed = seed
        self.max_cached = max_cached
        self._cache: OrderedDict[tuple[int, int, int], TrajectoryScript] = OrderedDict()

    def task_seeds(self, step: int) -> list[int]:
        """The task seeds of the prompts of RL step ``step``."""
        workload, rollout = self.workload, self.workload.rollout
        if rollout.dataset_prompts is None:
            rng = random.Random(f"{workload.name}/{self.seed}/step/{step}")
            return [rng.randrange(2**31) for _ in range(rollout.prompts)]
        pool_rng = random.Random(f"{workload.name}/{self.seed}/dataset")
        pool = [pool_rng.randrange(2**31) for _ in range(rollout.dataset_prompts)]
        first = step * rollout.prompts
        return [pool[(first + i) % len(pool)] for i in range(rollout.prompts)]

    def step(self, step: int) -> list[TrajectoryScript]:
        """Every trajectory of RL step ``step``, prompt by prompt, sample by sample."""
        samples = self.workload.rollout.samples_per_prompt
        return [
            self.script(step, seed, sample)
            for seed in self.task_seeds(step)
            for sample in range(samples)
        ]

    @property
    def names(self) -> tuple[str, ...]:
        """The workloads whose scripts it draws (the envs its trajectories name)."""
        return (self.workload.name,)

    def part(self, name: str) -> ScriptBook:
        """The book of workload ``name`` (this one)."""
        if name != self.workload.name:
            raise KeyError(f"no workload {name!r} in {self.workload.name!r}")
        return self

    def script(
        self, step: int, task_seed: int, sample: int, workload: str | None = None
    ) -> TrajectoryScript:
        """The script of sample ``sample`` of task ``task_seed`` at RL step ``step`` (of
        ``workload``, if named: it must be this book's)."""
        if workload is not None:
            self.part(workload)
        key = (step, task_seed, sample)
        found = self._cache.get(key)
        if found is not None:
            self._cache.move_to_end(key)
            return found
        script = draw_script(self.workload, step, task_seed, sample, self.seed)
        self._cache[key] = script
        if len(self._cache) > self.max_cached:
            self._cache.popitem(last=False)
        return script


class MixBook:
    """The scripts of a mixed step: each part's own book, its prompts after the last's."""

    def __init__(self, workload: Mix, seed: int = 0) -> None:
        self.workload = workload
        self.seed = seed
        self._parts = {part.name: ScriptBook(part, seed) for part in workload.parts}

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._parts)

    def part(self, name: str) -> ScriptBook:
        found = self._parts.get(name)
        if found is None:
            raise KeyError(f"no workload {name!r} in the mixture {self.workload.name!r}")
        return found

    def step(self, step: int) -> list[TrajectoryScript]:
        return [script for book in self._parts.values() for script in book.step(step)]

    def script(
        self, step: int, task_seed: int, sample: int, workload: str | None = None
    ) -> TrajectoryScript:
        if workload is None:
            raise ValueError("a mixture's script is named by its workload")
        return self.part(workload).script(step, task_seed, sample)


Book = ScriptBook | MixBook


def book_of(workload: Workload | Mix, seed: int = 0) -> Book:
    """The scripts of a workload or of a mixed step."""
    return MixBook(workload, seed) if isinstance(workload, Mix) else ScriptBook(workload, seed)


def draw_script(
    workload: Workload, step: int, task_seed: int, sample: int, seed: int = 0
) -> TrajectoryScript:
    """The script of sample ``sample`` of task ``task_seed`` at RL step ``step``; ``seed``
    picks one of the workload's possible worlds."""
    prompt_rng = random.Random(f"{workload.name}/{seed}/prompt/{task_seed}")
    prompt_tokens = round(workload.prompt_tokens.draw(prompt_rng))
    solve_rate = prompt_rng.betavariate(workload.solve_rate.alpha, workload.solve_rate.beta)
    learned = (1.0 + workload.rollout.solve_rate_drift_per_step) ** step
    solve_rate = min(1.0, solve_rate * learned)  # the policy learns its tasks as RL proceeds
    rng = random.Random(f"{workload.name}/{seed}/{step}/{task_seed}/{sample}")
    scale = (1.0 + workload.rollout.drift_per_step) ** step
    turns, solved = _play(workload, rng, scale, prompt_tokens, solve_rate)
    return TrajectoryScript(
        workload.name,
        step,
        task_seed,
        sample,
        prompt_tokens,
        solve_rate,
        solved,
        turns,
        workload.limits.tool_timeout_s,
    )


def _play(
    workload: Workload, rng: random.Random, scale: float, prompt_tokens: int, solve_rate: float
) -> tuple[tuple[ScriptTurn, ...], bool]:
    """Attempts until a check passes, the model gives up, or a limit is near."""
    limits = workload.limits
    budget = limits.max_context_tokens - _final_reserve(workload, scale)
    context = prompt_tokens + TOOL_SCHEMA_TOKENS * len(workload.tool_names)
    turns: list[ScriptTurn] = []
    solved = False
    for attempt in range(limits.max_turns):  # every attempt before this one failed
        for tool in _attempt_plan(workload, rng, attempt):
            if len(turns) + 1 >= limits.max_turns:
                return _finish(workload, rng, scale, turns), solved
            growth = workload.turn.growth_after_failure**attempt
            tokens = round(workload.turn.tokens.draw(rng, scale * growth))
            turn = _tool_turn(workload, tool, rng, tokens, solve_rate)
            context += turn.output_tokens + turn.output_chars + TURN_OVERHEAD_TOKENS
            if context > budget:
                return _finish(workload, rng, scale, turns), solved
            turns.append(turn)
        if turns[-1].passed:
            solved = True
            break
        if rng.random() < workload.solve_rate.give_up:
            break
    return _finish(workload, rng, scale, turns), solved


def _attempt_plan(
    workload: Workload, rng: random.Random, attempt: int
) -> list[ExploreTool | CheckTool]:
    plan: list[ExploreTool | CheckTool] = []
    for tool in workload.explore:
        low, high = tool.calls_first_attempt if attempt == 0 else tool.calls_later_attempts
        plan += [tool] * rng.randint(low, high)
    rng.shuffle(plan)
    return [*plan, workload.check]


def _tool_turn(
    workload: Workload,
    tool: ExploreTool | CheckTool,
    rng: random.Random,
    tokens: int,
    solve_rate: float,
) -> ScriptTurn:
    # A scripted latency never reaches the timeout: timeouts are scripted on their own.
    latency = min(tool.latency_s.draw(rng), workload.limits.tool_timeout_s * 0.9)
    tokens = max(tokens, round(workload.turn.tokens.min))
    if isinstance(tool, ExploreTool):
        output = tool.output
        if tool.failure_output is not None and rng.random() < tool.failure_probability:
            output = tool.failure_output
        return _returns(tool.name, tokens, output, rng, latency)
    if rng.random() < tool.timeout_probability:
        timeout = workload.limits.tool_timeout_s
        return ScriptTurn(tokens, tool.name, "timeout", 0, timeout)
    passed = rng.random() < solve_rate
    output = tool.on_pass if passed else tool.on_fail
    return _returns(tool.name, tokens, output, rng, latency, passed)


def _returns(
    name: str,
    tokens: int,
    output: Output,
    rng: random.Random,
    latency: float,
    passed: bool = False,
) -> ScriptTurn:
    chars = max(1, round(output.chars.draw(rng)))
    return ScriptTurn(tokens, name, output.status, chars, latency, passed)


def _finish(
    workload: Workload, rng: random.Random, scale: float, turns: list[ScriptTurn]
) -> tuple[ScriptTurn, ...]:
    final = ScriptTurn(max(1, round(workload.turn.final_tokens.draw(rng, scale))))
    return (*turns, final)


def _final_reserve(workload: Workload, scale: float) -> int:
    """Context kept free for the final answer."""
    final = workload.turn.final_tokens
    largest = final.max if final.max is not None else final.median * 4
    return round(largest * scale) + TURN_OVERHEAD_TOKENS
