"""Libra: agentic RL post-training, with tool-return-driven scheduling."""

from libra._home import libra_home

__all__ = ["libra_home"]
