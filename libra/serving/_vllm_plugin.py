"""Libra's vLLM plugin (entry point ``libra`` of ``vllm.general_plugins``): registers the
``gloo`` weight-transfer engine (``libra.serving._vllm_gloo_engine``). vLLM calls it in
each of its processes; registering lazily means the engine's module is imported only by
a server started with that backend."""

from __future__ import annotations

import contextlib


def register() -> None:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    # Registered already where vLLM loads plugins more than once in a process.
    with contextlib.suppress(ValueError):
        WeightTransferEngineFactory.register_engine(
            "gloo", "libra.serving._vllm_gloo_engine", "GlooWeightTransferEngine"
        )
