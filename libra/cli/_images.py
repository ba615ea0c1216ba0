"""``libra images build``: the sandbox images the contributed envs need."""

from __future__ import annotations

import argparse

from libra.sandbox import RECIPES, build_image


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = commands.add_parser("images", help="sandbox images")
    actions = parser.add_subparsers(title="actions", metavar="ACTION", required=True)
    build = actions.add_parser(
        "build", help="build sandbox images (works without a registry: debootstrap + import)"
    )
    build.add_argument("names", nargs="*", help=f"images (default: all of {', '.join(RECIPES)})")
    build.add_argument("--force", action="store_true", help="rebuild images that exist")
    build.add_argument("--no-pull", action="store_true", help="do not try a registry first")
    build.set_defaults(run=run_build)


def run_build(args: argparse.Namespace) -> int:
    for name in args.names or list(RECIPES):
        built = build_image(name, force=args.force, pull=not args.no_pull)
        print(f"{built.name}: {built.source} in {built.seconds:.1f} s")
    return 0
