#!/usr/bin/env bash
# Short checks for a GPU machine. One GPU: bf16 training steps of a ~130M-parameter model through NTPEngine.
# Five or more GPUs: the nonuniform equivalence tests (TP (3, 2) and (2, 2, 1)) over NCCL, one rank per GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -lt 1 ]; then
  echo "gpu_check: no CUDA device visible" >&2
  exit 1
fi
echo "gpu_check: $gpus GPU(s)"
python tools/gpu_step.py
if [ "$gpus" -ge 5 ]; then
  NTP_TEST_DEVICE=cuda python -m pytest -q tests/test_equivalence.py -k "tp3_tp2_sgd or three_replicas" \
    ${NTP_GPU_CHECK_PYTEST_ARGS:-}
fi
echo "gpu_check: ok"
