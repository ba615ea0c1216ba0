"""Emulated agentic workloads: a TOML format, shipped workloads and their scripts.

``load_workload("swe-agent")`` loads a shipped workload (``available_workloads()``
lists them); ``load_workload("path/to/my.toml")`` loads one of yours. The format is
documented in ``README.md`` beside this file. A :class:`ScriptBook` draws every
trajectory's script (turns, tokens, tool outcomes) deterministically from the workload,
the RL step, the task seed and the sample index. ``load_step`` loads a mixture too (a
file of ``[[mix]]`` parts: one step drawing prompts from several workloads), whose
:class:`MixBook` draws each part's scripts from its own workload.
"""

from libra.emulation.workloads._env import EnvClasses, WorkloadScript, scripted_result
from libra.emulation.workloads._format import (
    CheckTool,
    ExploreTool,
    Limits,
    LogNormal,
    Mix,
    MixFile,
    MixPart,
    Output,
    Rollout,
    SolveRate,
    Turns,
    Workload,
)
from libra.emulation.workloads._load import (
    WorkloadError,
    available_workloads,
    load_step,
    load_workload,
    package_file,
    read_toml,
)
from libra.emulation.workloads._trajectory_scripts import (
    Book,
    MixBook,
    ScriptBook,
    ScriptTurn,
    TrajectoryScript,
    book_of,
    draw_script,
)

__all__ = [
    "Book",
    "CheckTool",
    "EnvClasses",
    "ExploreTool",
    "Limits",
    "LogNormal",
    "Mix",
    "MixBook",
    "MixFile",
    "MixPart",
    "Output",
    "Rollout",
    "ScriptBook",
    "ScriptTurn",
    "SolveRate",
    "TrajectoryScript",
    "Turns",
    "Workload",
    "WorkloadError",
    "WorkloadScript",
    "available_workloads",
    "book_of",
    "draw_script",
    "load_step",
    "load_workload",
    "package_file",
    "read_toml",
    "scripted_result",
]
