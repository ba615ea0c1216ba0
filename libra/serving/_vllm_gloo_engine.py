"""vLLM's end of the gloo weight transport: a weight-transfer engine (vLLM 0.32's
``WeightTransferEngine``) registered as ``gloo`` by Libra's vLLM plugin
(``libra.serving._vllm_plugin``, an entry point of ``vllm.general_plugins``).

vLLM's own engines (``nccl``, ``ipc``) need CUDA; this one runs wherever torch's gloo
does, the CPU build included. A server started with ``--weight-transfer-config
'{"backend": "gloo"}'`` joins the trainer's group on ``/init_weight_transfer_engine``
and loads each version from ``/start_weight_update``, ``/update_weights`` (the tensors'
metadata; the bytes come over the group, ``libra.serving._gloo_weights``) and
``/finish_weight_update``, through vLLM's layerwise reload as its nccl engine does.
Imported only inside vLLM's processes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from libra.serving._gloo_weights import TensorMeta, open_weights_group, receive_weights


@dataclass
class GlooInitInfo(WeightTransferInitInfo):
    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    bucket_bytes: int
    timeout_s: float = 300.0


@dataclass
class GlooUpdateInfo(WeightTransferUpdateInfo):
    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]


class GlooWeightTransferEngine(WeightTransferEngine[GlooInitInfo, GlooUpdateInfo]):
    init_info_cls = GlooInitInfo
    update_info_cls = GlooUpdateInfo
    supports_draft_weight_update = False

    group: Any = None
    bucket_bytes: int = 0

    def init_transfer_engine(self, init_info: GlooInitInfo) -> None:
        parallel = self.parallel_config
        worker = parallel.data_parallel_index * parallel.world_size + parallel.rank
        self.bucket_bytes = init_info.bucket_bytes
        self.group = open_weights_group(
            init_info.master_address,
            init_info.master_port,
            init_info.rank_offset + worker,
            init_info.world_size,
            init_info.timeout_s,
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class then synchronizes the accelerator: there is none on CPU, and
        # gloo's broadcast has completed when receive_weights returns.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: GlooUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError("gloo weight transfer is not initialized: call init first")
        metas = [
            TensorMeta(name, dtype, tuple(shape))
            for name, dtype, shape in zip(
                update_info.names, update_info.dtype_names, update_info.shapes, strict=True
            )
        ]
        for named in receive_weights(self.group, metas, self.bucket_bytes):
            self.model.load_weights(named)

    def shutdown(self) -> None:
        self.group = None
