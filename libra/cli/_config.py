"""``--config FILE`` and ``--set KEY=VALUE`` on every command (loading: ``libra.config``)."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_config_arguments(parser: argparse.ArgumentParser, settings: str, example: str) -> None:
    """``--config FILE`` and ``--set KEY=VALUE``, the same on every command."""
    parser.add_argument("--config", type=Path, help=f"TOML file of {settings}")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help=f"override any of them, e.g. {example}",
    )
