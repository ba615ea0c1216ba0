"""``libra model prepare`` and ``libra vllm``: the embedded model on a real vLLM server.

``libra vllm`` runs a bare vLLM server in the foreground and records it in
``$LIBRA_HOME/run/embedded.json``, so that ``--server embedded`` (``libra rollout``,
``libra serve``) reuses it instead of starting (and stopping) a server of its own.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
from pathlib import Path

from libra.cli._config import add_config_arguments
from libra.serving import (
    EMBEDDED_MODEL_NAME,
    VLLMServer,
    prepare_model,
    resolve_model,
    server_config,
    state_file,
)


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    model = commands.add_parser("model", help="the embedded default model")
    actions = model.add_subparsers(title="actions", metavar="ACTION", required=True)
    prepare = actions.add_parser("prepare", help="build the embedded model folder (once)")
    prepare.add_argument("--force", action="store_true", help="rebuild it")
    prepare.set_defaults(run=lambda args: print(prepare_model(force=args.force)) or 0)

    vllm = commands.add_parser("vllm", help="run a bare vLLM server (OpenAI-compatible)")
    vllm.add_argument("--model", default="embedded", help="'embedded' or a local HF folder")
    vllm.add_argument("--port", type=int, default=8000)
    vllm.add_argument("--host", default="127.0.0.1")
    vllm.add_argument("--threads", type=int, help="CPU threads for the server")
    vllm.add_argument("--max-model-len", type=int, help="default 8192")
    vllm.add_argument("--scheduling-policy", choices=["fcfs", "priority"], help="default priority")
    vllm.add_argument("--dev-mode", action="store_true", help="allow weight reloads")
    vllm.add_argument("--tool-call-parser", help="vLLM's parser for tool calls, e.g. hermes")
    vllm.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        help="skip torch.compile and CUDA graphs (default: on with vLLM's CPU build, for "
        "quick starts; off with its GPU build)",
    )
    add_config_arguments(vllm, "VLLMServerConfig settings", "tensor_parallel_size=2")
    vllm.set_defaults(run=run_vllm)


def run_vllm(args: argparse.Namespace) -> int:
    model = resolve_model(args.model)
    name = EMBEDDED_MODEL_NAME if args.model == "embedded" else Path(model).name
    flags = {
        "host": args.host,
        "port": args.port,
        "threads": args.threads,
        "max_model_len": args.max_model_len,
        "scheduling_policy": args.scheduling_policy,
        "dev_mode": args.dev_mode or None,
        "tool_call_parser": args.tool_call_parser,
        "enforce_eager": args.enforce_eager,
    }
    config = server_config(args.config, flags, args.set)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    with VLLMServer(model, served_model_name=name, config=config) as server:
        if args.model == "embedded":
            state_file().write_text(json.dumps({"url": server.url, "pid": os.getpid()}))
        print(f"serving {name} at {server.url} (log: {server.log_file}); Ctrl-C stops it")
        try:
            while not stop.wait(1.0) and server.is_running:
                pass
        finally:
            state_file().unlink(missing_ok=True)
    return 0
