"""The causal prefix tree: what tool-return paths say about the output still to come.

A trajectory's path is the sequence of its tool-return states (``_signals``). When a
trajectory finishes, every node along its path records how many output tokens the
model still generated after reaching that node (the root records the whole length).
Asked about a live trajectory, the tree answers with the residual distribution at the
deepest node of its path that has enough samples: its mean and an upper quantile.

A :class:`PrefixForest` holds one tree per prompt (GRPO samples of a prompt share a
difficulty) and one global tree (paths generalise across prompts) and answers from
whichever matches the path more deeply. Long exact paths are rarely seen twice, so the
forest also keeps what followed each state at each depth on any path (how far into its
turns a trajectory is says much of what is left): asked about a path whose own node has
too few samples, it answers from there before falling back to the path's ancestors.
Memory is bounded three ways: each node keeps the last ``max_samples`` samples (so the
tree follows the length drift of training), trees (and the per-depth table) stop growing
new nodes at ``max_nodes`` and ``max_depth``, and per-prompt trees are evicted least
recently used beyond ``max_prompts``. The forest is saved and
restored with msgspec, so a resumed run keeps what it learnt.
"""

from __future__ import annotations

import bisect
import itertools
import math
import os
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Literal, NamedTuple

import msgspec
from pydantic import Field, PositiveInt

from libra.config import Section

_FORMAT_VERSION = 1


class TreeConfig(Section):
    max_samples: PositiveInt = Field(200, description="samples a node keeps (the latest)")
    max_depth: PositiveInt = Field(32, description="tool returns a path is followed for")
    max_nodes: PositiveInt = Field(20_000, description="nodes of the global tree")
    max_prompt_nodes: PositiveInt = Field(512, description="nodes of each per-prompt tree")
    max_prompts: PositiveInt = Field(4096, description="per-prompt trees kept (LRU)")
    min_samples: PositiveInt = Field(
        5, description="a node answers only with at least this many samples"
    )
    quantile: float = Field(0.9, gt=0, le=1, description="the upper quantile reported")
    demote_quantile: float | None = Field(
        None,
        gt=0,
        le=1,
        description="a higher upper quantile a move down to a shorter bucket is priced by "
        "(a straggler moved down in error runs its tail on a slow instance); none: the "
        "upper quantile, as every other move",
    )


class Residual(NamedTuple):
    """Remaining output tokens expected for a trajectory, and where the estimate comes from."""

    mean: float
    upper: float  # the configured quantile (p90 by default)
    samples: int
    depth: int  # tool returns of the path matched
    source: Literal["prompt", "global", "history", "oracle", "none"]
    tool_s: float = 0.0  # tool seconds still to come (only an oracle knows them)
    demote_upper: float | None = None  # the demotion quantile, where there is one


NO_ESTIMATE = Residual(0.0, 0.0, 0, 0, "none")


class _Samples:
    """A ring buffer of the latest samples, with their sorted order cached."""

    __slots__ = ("_sorted", "_sums", "capacity", "next", "values")

    def __init__(self, capacity: int, values: Sequence[int] = ()) -> None:
        self.capacity = capacity
        self.values = array("q", values[-capacity:])
        self.next = len(self.values) % capacity
        self._sorted: list[int] | None = None
        self._sums: list[int] = []  # prefix sums of _sorted

    def __len__(self) -> int:
        return len(self.values)

    def add(self, value: int) -> None:
        if len(self.values) < self.capacity:
            self.values.append(value)
        else:
            self.values[self.next] = value
        self.next = (self.next + 1) % self.capacity
        self._sorted = None

    def oldest_first(self) -> list[int]:
        if len(self.values) < self.capacity:
            return list(self.values)
        return list(self.values[self.next :]) + list(self.values[: self.next])

    def residual(self, already: int, quantile: float) -> tuple[float, float, int]:
        """Mean and ``quantile`` (nearest rank) of what is left of the samples longer than
        ``already`` (a trajectory that generated ``already`` tokens since this node is
        one of those), and how many there are. Nothing left: the mean is 0."""
        if self._sorted is None:
            self._sorted = sorted(self.values)
            self._sums = list(itertools.accumulate(self._sorted))
        ordered = self._sorted
        first = bisect.bisect_right(ordered, already)
        count = len(ordered) - first
        if count == 0:
            return 0.0, 0.0, 0
        below = self._sums[first - 1] if first else 0
        mean = (self._sums[-1] - below) / count - already
        rank = first + max(0, math.ceil(quantile * count) - 1)
        return mean, float(ordered[rank] - already), count


class _Node:
    __slots__ = ("children", "samples")

    def __init__(self, capacity: int, samples: Sequence[int] = ()) -> None:
        self.children: dict[str, _Node] = {}
        self.samples = _Samples(capacity, samples)


class PrefixTree:
    """One trie over tool-return paths, bounded in nodes, depth and samples per node."""

    def __init__(self, max_samples: int = 200, max_depth: int = 32, max_nodes: int = 20_000):
        self.max_samples = max_samples
        self.max_depth = max_depth
        self.max_nodes = max_nodes
        self.root = _Node(max_samples)
        self.node_count = 1

    def insert(self, path: Sequence[str], remaining: Sequence[int]) -> None:
        """Record a finished trajectory: ``remaining[d]`` output tokens followed the
        ``d``-th state of ``path`` (``remaining[0]``: the whole output)."""
        if len(remaining) != len(path) + 1:
            raise ValueError("remaining needs one value per state of the path, plus the root")
        node = self.root
        node.samples.add(remaining[0])
        for depth, key in enumerate(path[: self.max_depth], start=1):
            child = node.children.get(key)
            if child is None:
                if self.node_count >= self.max_nodes:
                    return  # full: deeper states stay unrecorded rather than grow memory
                child = node.children[key] = _Node(self.max_samples)
                self.node_count += 1
            node = child
            node.samples.add(remaining[depth])

    def along(self, path: Sequence[str], min_samples: int) -> list[tuple[_Node, int]]:
        """The nodes along ``path`` with at least ``min_samples`` samples, and their
        depths, deepest first (empty when even the root has fewer)."""
        node = self.root
        found = [(node, 0)] if len(node.samples) >= min_samples else []
        for depth, key in enumerate(path[: self.max_depth], start=1):
            child = node.children.get(key)
            if child is None:
                break
            node = child
            if len(node.samples) >= min_samples:
                found.append((node, depth))
        found.reverse()
        return found


class _NodeState(msgspec.Struct, array_like=True):
    samples: list[int]
    children: dict[str, _NodeState]


class _ForestState(msgspec.Struct):
    version: int
    config: dict[str, float | int]
    global_tree: _NodeState
    prompts: list[tuple[str, _NodeState]]  # least recently used first
    by_depth: list[tuple[int, str, list[int]]] = []  # (absent from older files)


class PrefixForest:
    """A global tree plus one tree per prompt; answers from the deeper match."""

    def __init__(self, config: TreeConfig | None = None) -> None:
        self.config = config or TreeConfig()
        self.global_tree = self._tree(self.config.max_nodes)
        self.prompts: OrderedDict[str, PrefixTree] = OrderedDict()
        # What followed the d-th state, whatever the path before it: (d, state) -> samples.
        self.by_depth: dict[tuple[int, str], _Samples] = {}

    def _tree(self, max_nodes: int) -> PrefixTree:
        return PrefixTree(self.config.max_samples, self.config.max_depth, max_nodes)

    # --------------------------------------------------------------------- learning

    def observe(self, prompt_id: str, path: Sequence[str], remaining: Sequence[int]) -> None:
        """A trajectory of ``prompt_id`` finished (see :meth:`PrefixTree.insert`)."""
        self.global_tree.insert(path, remaining)
        for depth, state in enumerate(path[: self.config.max_depth], start=1):
            samples = self.by_depth.get((depth, state))
            if samples is None:
                if len(self.by_depth) >= self.config.max_nodes:
                    continue
                samples = self.by_depth[depth, state] = _Samples(self.config.max_samples)
            samples.add(remaining[depth])
        tree = self.prompts.get(prompt_id)
        if tree is None:
            tree = self.prompts[prompt_id] = self._tree(self.config.max_prompt_nodes)
            while len(self.prompts) > self.config.max_prompts:
                self.prompts.popitem(last=False)
        else:
            self.prompts.move_to_end(prompt_id)
        tree.insert(path, remaining)

    def residual(
        self,
        prompt_id: str,
        path: Sequence[str],
        marks: Sequence[int] = (),
        generated: int = 0,
    ) -> Residual:
        """The output still expected of a trajectory at ``path``: from the prompt's own
        tree when it matches at least as deep as the global one, else the global tree.

        ``marks[d]`` is how many tokens the trajectory had generated when it reached the
        ``d+1``-th state and ``generated`` how many it has now, so that a node matched
        above the end of the path is read as what is left *given* the tokens since. An
        answer needs ``min_samples`` samples that outlived those tokens: a node with
        fewer (the trajectory has outlived most of its samples) gives way to a shallower
        one, then to the other tree; past every node, there is no estimate.
        """
        config = self.config
        for samples, depth, source in self._candidates(prompt_id, path):
            since = generated - (marks[depth - 1] if depth and len(marks) >= depth else 0)
            mean, upper, count = samples.residual(since, config.quantile)
            if count >= config.min_samples:
                demote_upper = None
                if config.demote_quantile is not None:
                    demote_upper = samples.residual(since, config.demote_quantile)[1]
                return Residual(mean, upper, count, depth, source, demote_upper=demote_upper)
        return NO_ESTIMATE

    def _candidates(
        self, prompt_id: str, path: Sequence[str]
    ) -> Iterator[tuple[_Samples, int, Literal["prompt", "global"]]]:
        """Where to look, best first: the deeper-matching tree's nodes along the path,
        deepest first, then the other's; in the global tree, before any node above the
        path's end, what followed the path's last state at its depth on any path."""
        min_samples = self.config.min_samples
        in_global = self.global_tree.along(path, min_samples)
        tree = self.prompts.get(prompt_id)
        in_prompt = tree.along(path, min_samples) if tree is not None else []
        prompt_first = in_prompt and (not in_global or in_prompt[0][1] >= in_global[0][1])
        if prompt_first:
            yield from ((node.samples, depth, "prompt") for node, depth in in_prompt)
        by_depth = self.by_depth.get((len(path), path[-1])) if path else None
        for node, depth in in_global:
            if by_depth is not None and depth < len(path):
                if len(by_depth) >= min_samples:
                    yield by_depth, len(path), "global"
                by_depth = None
            yield node.samples, depth, "global"
        if not prompt_first:
            yield from ((node.samples, depth, "prompt") for node, depth in in_prompt)

    # ------------------------------------------------------------------ persistence

    def to_bytes(self) -> bytes:
        state = _ForestState(
            version=_FORMAT_VERSION,
            config=self.config.model_dump(exclude_none=True),
            global_tree=_dump(self.global_tree.root),
            prompts=[(prompt, _dump(tree.root)) for prompt, tree in self.prompts.items()],
            by_depth=[(d, state, s.oldest_first()) for (d, state), s in self.by_depth.items()],
        )
        return msgspec.json.encode(state)

    @classmethod
    def from_bytes(cls, data: bytes) -> PrefixForest:
        state = msgspec.json.decode(data, type=_ForestState)
        if state.version != _FORMAT_VERSION:
            raise ValueError(f"prefix forest format {state.version} is not {_FORMAT_VERSION}")
        forest = cls(TreeConfig.model_validate(state.config))
        forest.global_tree = _load(state.global_tree, forest._tree(forest.config.max_nodes))
        for prompt, root in state.prompts:
            tree = forest._tree(forest.config.max_prompt_nodes)
            forest.prompts[prompt] = _load(root, tree)
        for depth, key, values in state.by_depth[: forest.config.max_nodes]:
            forest.by_depth[depth, key] = _Samples(forest.config.max_samples, values)
        return forest

    def save(self, path: str | Path) -> None:
        """Write the forest to ``path`` atomically (a crash leaves the old file whole)."""
        path = Path(path)
        temporary = path.with_name(path.name + ".tmp")
        temporary.write_bytes(self.to_bytes())
        os.replace(temporary, path)

    @classmethod
    def load(cls, path: str | Path) -> PrefixForest:
        return cls.from_bytes(Path(path).read_bytes())


def _dump(node: _Node) -> _NodeState:
    children = {key: _dump(child) for key, child in node.children.items()}
    return _NodeState(node.samples.oldest_first(), children)


def _load(state: _NodeState, tree: PrefixTree) -> PrefixTree:
    tree.root = _node_from(state, tree)
    return tree


def _node_from(state: _NodeState, tree: PrefixTree) -> _Node:
    node = _Node(tree.max_samples, state.samples)
    for key, child in state.children.items():
        if tree.node_count >= tree.max_nodes:
            break
        tree.node_count += 1
        node.children[key] = _node_from(child, tree)
    return node
