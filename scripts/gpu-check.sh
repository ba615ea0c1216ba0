#!/usr/bin/env bash
# The GPU check: what Libra's trainer does on this machine's GPUs, in a few minutes, with
# nothing but torch, transformers and peft (a stock CUDA image: no vLLM, no pydantic, no
# msgspec, no network). It prints, for a model of Qwen2.5-0.5B's shape (random weights):
# the FSDP2 trainer's tokens/s and MFU in bf16 on NCCL, with and without LoRA, and the
# GRPO loss and per-token logprobs against the same weights and tokens on CPU in fp32.
#
#   bash scripts/gpu-check.sh          # every visible GPU, one rank each
#   bash scripts/gpu-check.sh --cpu    # reduced: a tiny model on 2 gloo ranks, seconds
#
# PYTHON picks the interpreter (default: python3), GPU_CHECK_RANKS the ranks, and
# GPU_CHECK_TIMEOUT the seconds after which the whole check is stopped (default 290).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
python=${PYTHON:-python3}

cpu=0
for arg in "$@"; do
    case $arg in
        --cpu) cpu=1 ;;
        -h | --help) sed -n '2,12p' "$0" | cut -c3-; exit 0 ;;
        *) echo "gpu-check: unknown argument $arg (usage: gpu-check.sh [--cpu])" >&2; exit 2 ;;
    esac
done

ranks=${GPU_CHECK_RANKS:-}
if [ -z "$ranks" ]; then
    if [ "$cpu" = 1 ]; then
        ranks=2
    else
        ranks=$("$python" -c 'import torch; print(max(1, torch.cuda.device_count()))')
    fi
fi

# Libra from this checkout, not installed: its trainer core needs only torch (and peft).
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec timeout -k 10 "${GPU_CHECK_TIMEOUT:-290}" \
    "$python" -m torch.distributed.run --standalone --nproc_per_node "$ranks" \
    "$here/gpu_check.py" "$@"
