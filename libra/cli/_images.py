"""``libra images build|reap``: the sandbox images the contributed envs need, and leftovers."""

from __future__ import annotations

import argparse

from libra.sandbox import RECIPES, build_image, reap_stale_containers, reap_stale_workdirs


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
    reap = actions.add_parser("reap", help="remove sandboxes left behind by dead runs")
    reap.set_defaults(run=run_reap)


def run_build(args: argparse.Namespace) -> int:
    for name in args.names or list(RECIPES):
        built = build_image(name, force=args.force, pull=not args.no_pull)
        print(f"{built.name}: {built.source} in {built.seconds:.1f} s")
    return 0


def run_reap(args: argparse.Namespace) -> int:
    # Directories first: reaping them needs no Docker engine.
    print("bwrap dirs:", [str(path) for path in reap_stale_workdirs()])
    print("containers:", reap_stale_containers())
    return 0
