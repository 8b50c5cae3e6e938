#!/usr/bin/env bash
# Checks for a GPU machine, one line each; exits non-zero if any fails. Logs go to ${NTP_GPU_CHECK_LOGS:-gpu_check_logs}.
# 1 GPU: bf16 steps of a ~1B-parameter Llama through NTPEngine in one rank (step time and peak memory).
# 4+ GPUs: the equivalence, contract and overlap tests over NCCL (one rank per GPU, cases that fit), the
#          steady-state benchmark with a contributor, and one live recovery case.
# 4+ CPU cores: the straggler benchmark (3 ranks on CPU; its target needs a core per rank).
set -uo pipefail
cd "$(dirname "$0")/.."
logs=${NTP_GPU_CHECK_LOGS:-gpu_check_logs}
mkdir -p "$logs"
gpus=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$gpus" -lt 1 ]; then
  echo "gpu_check: FAIL no CUDA device visible"
  exit 1
fi
echo "gpu_check: $gpus GPU(s)"
failed=0
check() {
  local name=$1; shift
  if "$@" > "$logs/$name.log" 2>&1; then
    echo "gpu_check: PASS $name: $(tail -n 1 "$logs/$name.log")"
  else
    echo "gpu_check: FAIL $name (see $logs/$name.log): $(tail -n 1 "$logs/$name.log")"
    failed=1
  fi
}
check bf16_step python tools/gpu_step.py
if [ "$(nproc)" -ge 4 ]; then
  check straggler env CUDA_VISIBLE_DEVICES= python benchmarks/straggler.py
fi
if [ "$gpus" -ge 4 ]; then
  export NTP_TEST_DEVICE=cuda
  check equivalence python -m pytest -q -p no:cacheprovider tests/test_equivalence.py -k "test_tp2_tp1" ${NTP_GPU_CHECK_PYTEST_ARGS:-}
  check recovery python -m pytest -q -p no:cacheprovider tests/test_recovery.py -k "2x2-zero2" ${NTP_GPU_CHECK_PYTEST_ARGS:-}
  check steady_state python benchmarks/steady_state.py --tp 2 --replicas 2 --contributor --steps 10
fi
if [ "$gpus" -ge 5 ]; then
  check equivalence_5 python -m pytest -q -p no:cacheprovider tests/test_equivalence.py tests/test_comm_contract.py \
    tests/test_overlap.py -k "tp3_tp2 or three_replicas or contract or anchor_backward" ${NTP_GPU_CHECK_PYTEST_ARGS:-}
fi
exit $failed
