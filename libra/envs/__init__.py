"""Environments: tasks, the tools a model may call on them, and their rewards."""

from libra.envs._env import Env
from libra.envs._registry import UnknownEnvError, available_envs, load_env
from libra.envs._sandbox import (
    ExecResult,
    Sandbox,
    SandboxError,
    SandboxProvider,
    SandboxSpec,
)
from libra.envs._tool_calls import HermesToolCallParser, ToolCall, ToolCallParser
from libra.envs._tool_return import ToolReturn, size_class, status_of_output
from libra.envs._tools import ToolError, ToolSpec, tool

__all__ = [
    "Env",
    "ExecResult",
    "HermesToolCallParser",
    "Sandbox",
    "SandboxError",
    "SandboxProvider",
    "SandboxSpec",
    "ToolCall",
    "ToolCallParser",
    "ToolError",
    "ToolReturn",
    "ToolSpec",
    "UnknownEnvError",
    "available_envs",
    "load_env",
    "size_class",
    "status_of_output",
    "tool",
]
