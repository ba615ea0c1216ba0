"""``python -m libra.sandbox``: build sandbox images, reap leftovers, benchmark providers."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

import anyio

from libra.envs._sandbox import SandboxError
from libra.sandbox._bench import bench_sandbox
from libra.sandbox._bwrap import reap_stale_workdirs
from libra.sandbox._docker import reap_stale_containers
from libra.sandbox._images import build_image, build_rootfs


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m libra.sandbox", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    image = commands.add_parser("build-image", help="make a sandbox image available to Docker")
    image.add_argument("name", nargs="?", default="libra/python")
    image.add_argument("--force", action="store_true", help="rebuild even if it exists")
    image.add_argument("--no-pull", action="store_true", help="skip `docker pull`")
    rootfs = commands.add_parser("build-rootfs", help="only the root filesystem (for bwrap)")
    rootfs.add_argument("name", nargs="?", default="libra/python")
    rootfs.add_argument("--force", action="store_true")
    commands.add_parser("reap", help="remove sandboxes left by dead runs")
    bench = commands.add_parser("bench", help="tool-call latency and throughput")
    bench.add_argument("--provider", choices=["docker", "bwrap"], default="docker")
    bench.add_argument("--concurrency", type=int, nargs="+", default=[8, 32])
    bench.add_argument("--calls", type=int, default=256)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "build-image":
            built = build_image(args.name, force=args.force, pull=not args.no_pull)
            print(f"{built.name}: {built.source} in {built.seconds:.1f}s (rootfs {built.rootfs})")
        elif args.command == "build-rootfs":
            print(build_rootfs(args.name, force=args.force))
        elif args.command == "reap":
            # Directories first: reaping them needs no Docker engine.
            print("bwrap dirs:", [str(path) for path in reap_stale_workdirs()])
            print("containers:", reap_stale_containers())
        else:
            report = anyio.run(bench_sandbox, args.provider, tuple(args.concurrency), args.calls)
            print(json.dumps(report, indent=2))
    except SandboxError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
