"""Environments: tasks, the tools a model may call on them, and their rewards."""

from libra.envs._bugs import EnvBugs
from libra.envs._env import Env
from libra.envs._registry import (
    UnknownEnvError,
    available_envs,
    env_name,
    load_env,
    load_object,
)
from libra.envs._sandbox import (
    ExecResult,
    Sandbox,
    SandboxError,
    SandboxProvider,
    SandboxSpec,
    check_exec_args,
)
from libra.envs._task import GroupId, Task, TaskId, TrajectoryId
from libra.envs._text import cut_middle, valid_utf8
from libra.envs._tool_calls import HermesToolCallParser, ToolCall, ToolCallParser, from_openai
from libra.envs._tool_result import ToolResult
from libra.envs._tool_return import ToolReturn
from libra.envs._tools import ToolError, ToolSpec, ToolTimeout, tool

__all__ = [
    "Env",
    "EnvBugs",
    "ExecResult",
    "GroupId",
    "HermesToolCallParser",
    "Sandbox",
    "SandboxError",
    "SandboxProvider",
    "SandboxSpec",
    "Task",
    "TaskId",
    "ToolCall",
    "ToolCallParser",
    "ToolError",
    "ToolResult",
    "ToolReturn",
    "ToolSpec",
    "ToolTimeout",
    "TrajectoryId",
    "UnknownEnvError",
    "available_envs",
    "check_exec_args",
    "cut_middle",
    "env_name",
    "from_openai",
    "load_env",
    "load_object",
    "tool",
    "valid_utf8",
]
