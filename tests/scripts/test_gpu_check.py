"""scripts/gpu-check.sh in its reduced form (``--cpu``: a tiny Qwen2 on 2 gloo ranks), run
where pydantic, msgspec and vLLM cannot be imported, as in the stock CUDA image the full
check is for: it measures Libra's own loss and sharding, not a copy, and keeps working."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# What a stock CUDA image (torch, transformers, peft) does not have.
ABSENT = ("pydantic", "pydantic_core", "msgspec", "vllm")

pytestmark = pytest.mark.trainer


def _blocked_env(folder: Path) -> dict[str, str]:
    """An environment whose Python fails to import ``ABSENT``: a package of each name,
    first on the path, that raises as a missing one would."""
    for name in ABSENT:
        package = folder / name
        package.mkdir(parents=True)
        (package / "__init__.py").write_text(
            f"raise ModuleNotFoundError({f'No module named {name!r} (blocked)'!r}, name={name!r})\n"
        )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(folder), env.get("PYTHONPATH")]))
    env["PYTHON"] = sys.executable
    return env


def _rows(output: str, kind: str) -> dict[tuple[str, str], dict[str, str]]:
    """The ``kind`` lines (``throughput`` or ``agreement``) by (mode, precision)."""
    rows = {}
    for line in output.splitlines():
        if line.startswith(f"{kind} "):
            fields = dict(re.findall(r"(\w+)=(\S+)", line))
            rows[fields["mode"], fields["precision"]] = fields
    return rows


def test_the_reduced_gpu_check_runs_libras_trainer_core_without_pydantic(tmp_path: Path) -> None:
    env = _blocked_env(tmp_path / "blocked")
    for name in ABSENT:
        probe = subprocess.run(
            [sys.executable, "-c", f"import {name}"], env=env, capture_output=True, text=True
        )
        assert probe.returncode != 0 and "blocked" in probe.stderr, name

    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "gpu-check.sh"), "--cpu"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "pydantic loaded: no, msgspec loaded: no" in out
    assert "peak: unknown peak for 'cpu'" in out

    throughput = _rows(out, "throughput")
    agreement = _rows(out, "agreement")
    full = throughput["full", "bf16"]
    assert full["ranks"] == "2" and float(full["tokens_per_s"]) > 0
    assert full["mfu"] == "unknown-peak" and full["trainable"] == full["params"]
    # fp32 on the sharded ranks is the CPU reference's arithmetic; bf16 is within its
    # 8-bit mantissa on a 2-layer model.
    assert float(agreement["full", "fp32"]["logprob_max_abs"]) < 1e-5
    assert float(agreement["full", "fp32"]["loss_abs"]) < 1e-5
    assert 0 < float(agreement["full", "bf16"]["logprob_max_abs"]) < 0.05
    assert float(agreement["full", "bf16"]["loss_abs"]) < 0.01

    if importlib.util.find_spec("peft") is None:
        assert "lora: skipped: peft is not installed" in out
        assert ("lora", "bf16") not in throughput
        return
    lora = throughput["lora", "bf16"]
    assert float(lora["tokens_per_s"]) > 0
    trainable = int(lora["trainable"].replace(",", ""))
    assert 0 < trainable < int(lora["params"].replace(",", ""))
    # Fresh adapters add B @ A = 0: the LoRA model computes the base model's logprobs.
    assert float(agreement["lora", "bf16"]["logprob_max_abs"]) < 0.05
