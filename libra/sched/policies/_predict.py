"""Predictors of a trajectory's remaining output, behind one small interface.

- :class:`TreePredictor`: C-MLFQ's causal prefix forest (tool-return paths).
- :class:`PromptHistoryPredictor`: the total length of earlier trajectories of the same
  prompt, shrunk toward the global mean while the prompt has few of them (the
  length-prediction baselines: StreamRL ranks by predicted length, the reference's
  length-aware policy routes by it).
- :class:`FeaturePredictor`: the total length from the prompt's features (its env and
  its length), learnt from every finished trajectory: what length-prediction schedulers
  do with a model of the prompt, for prompts never seen before.
- :class:`OraclePredictor`: the true length, from whoever scripted the workload; a
  reference for benchmarks, never something a real run has.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Protocol

from libra.sched.policies._base import Track, Truth
from libra.sched.policies._prefix_tree import NO_ESTIMATE, PrefixForest, Residual


class Predictor(Protocol):
    def residual(self, track: Track) -> Residual:
        """Output tokens the trajectory is expected still to generate."""
        ...

    def learn(self, track: Track, output_tokens: int) -> None:
        """The trajectory finished with ``output_tokens`` in all."""
        ...


class TreePredictor:
    def __init__(self, forest: PrefixForest | None = None) -> None:
        self.forest = forest or PrefixForest()

    def residual(self, track: Track) -> Residual:
        return self.forest.residual(track.prompt_id, track.path, track.marks, track.generated)

    def learn(self, track: Track, output_tokens: int) -> None:
        remaining = [output_tokens] + [max(0, output_tokens - mark) for mark in track.marks]
        self.forest.observe(track.prompt_id, track.path, remaining)


class PromptHistoryPredictor:
    """Predicted total length: ``(n * prompt_mean + k * global_mean) / (n + k)``."""

    def __init__(
        self,
        *,
        per_prompt: int = 64,
        global_window: int = 5000,
        shrinkage: float = 2.0,
        max_prompts: int = 16384,
    ) -> None:
        self.per_prompt = per_prompt
        self.shrinkage = shrinkage
        self.max_prompts = max_prompts
        self.prompts: OrderedDict[str, deque[int]] = OrderedDict()
        self.recent: deque[int] = deque(maxlen=global_window)

    def total(self, prompt_id: str) -> tuple[float, int]:
        """Predicted total output tokens of a trajectory of ``prompt_id``, and the number
        of finished trajectories behind the prediction (0: no history at all)."""
        if not self.recent:
            return 0.0, 0
        global_mean = sum(self.recent) / len(self.recent)
        own = self.prompts.get(prompt_id)
        if not own:
            return global_mean, len(self.recent)
        n = len(own)
        prompt_mean = sum(own) / n
        blended = (n * prompt_mean + self.shrinkage * global_mean) / (n + self.shrinkage)
        return blended, n

    def residual(self, track: Track) -> Residual:
        total, samples = self.total(track.prompt_id)
        if samples == 0:
            return NO_ESTIMATE
        left = max(0.0, total - track.generated)
        return Residual(left, left, samples, 0, "history")

    def learn(self, track: Track, output_tokens: int) -> None:
        self.recent.append(output_tokens)
        own = self.prompts.get(track.prompt_id)
        if own is None:
            own = self.prompts[track.prompt_id] = deque(maxlen=self.per_prompt)
            while len(self.prompts) > self.max_prompts:
                self.prompts.popitem(last=False)
        else:
            self.prompts.move_to_end(track.prompt_id)
        own.append(output_tokens)


class FeaturePredictor:
    """Predicted total length from the prompt's features: the mean total of finished
    trajectories of the same env whose prompt length fell in the same power-of-two bin,
    shrunk toward that env's mean while the bin has few of them. A prompt never seen
    before is predicted as well as one seen often (no exact-history lookup)."""

    def __init__(self, *, window: int = 4096, shrinkage: float = 8.0) -> None:
        self.window = window
        self.shrinkage = shrinkage
        self.by_env: dict[str, deque[int]] = {}
        self.by_bin: dict[tuple[str, int], deque[int]] = {}

    @staticmethod
    def features(env: str, prompt_tokens: int) -> tuple[str, int]:
        return env, max(0, prompt_tokens).bit_length()

    def total(self, env: str, prompt_tokens: int) -> tuple[float, int]:
        """Predicted total output of a trajectory of ``env`` whose first call held
        ``prompt_tokens``, and the trajectories behind it (0: none of this env yet)."""
        seen = self.by_env.get(env)
        if not seen:
            return 0.0, 0
        env_mean = sum(seen) / len(seen)
        own = self.by_bin.get(self.features(env, prompt_tokens))
        if not own:
            return env_mean, len(seen)
        n = len(own)
        blended = (sum(own) + self.shrinkage * env_mean) / (n + self.shrinkage)
        return blended, len(seen)

    def learn_total(self, env: str, prompt_tokens: int, output_tokens: int) -> None:
        self.by_env.setdefault(env, deque(maxlen=self.window)).append(output_tokens)
        key = self.features(env, prompt_tokens)
        self.by_bin.setdefault(key, deque(maxlen=self.window)).append(output_tokens)


class OraclePredictor:
    """Knows every trajectory's remaining output and, with ``tool_seconds``, the seconds
    its tool calls still take."""

    def __init__(self, truth: Truth, *, tool_seconds: bool = True) -> None:
        self.truth = truth
        self.tool_seconds = tool_seconds

    def residual(self, track: Track) -> Residual:
        trajectory, generated = track.trajectory_id, track.generated
        left = float(max(0, self.truth.output_tokens(trajectory) - generated))
        tool_s = self.truth.tool_s_left(trajectory, generated) if self.tool_seconds else 0.0
        return Residual(left, left, 1, len(track.path), "oracle", tool_s)

    def learn(self, track: Track, output_tokens: int) -> None:
        pass  # it knows already
