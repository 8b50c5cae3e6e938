#!/usr/bin/env bash
# Checks for a GPU machine, one line each; exits non-zero if any fails. Logs go to ${NTP_GPU_CHECK_LOGS:-gpu_check_logs}.
# 1 GPU: bf16 steps of a ~1B-parameter Llama through NTPEngine in one rank (step time and peak memory), and a
#        device-side spin that stops the device while the host waits on it: found hung within hang_timeout_s + 2 s
#        by its device's progress, a healthy stretch before it not judged.
# 4+ GPUs: an equivalence case (3 ranks) and a live recovery case (4 ranks) over NCCL, one rank per GPU, and the
#          steady-state benchmark with a contributor (4 ranks).
# 5+ GPUs: the 5-rank equivalence, contract and overlap cases; 6+ GPUs: the contract of a recovery (6 ranks).
# 4+ CPU cores: the straggler benchmark (3 ranks on CPU; its target needs a core per rank).
# --cpu: no GPU used. The 4-GPU checks on CPU ranks over nccl_model (NCCL's rules on CPU),
#        the bf16 steps on a tiny Llama, the stopped device on nccl_model's device, and the GPU-only test selections
#        collected, so that the script runs in CI
#        (.ci/run) before it meets a GPU.
set -uo pipefail -f  # -f: the test ids' brackets are not globs
cd "$(dirname "$0")/.."
case "${1:-}" in
  --cpu) cpu=1 ;;
  "") cpu=0 ;;
  *) echo "usage: tools/gpu_check.sh [--cpu]" >&2; exit 2 ;;
esac
logs=${NTP_GPU_CHECK_LOGS:-gpu_check_logs}
mkdir -p "$logs"
failed=0

EQUIVALENCE=tests/test_equivalence.py::test_tp2_tp1_adamw_streamed_in_small_buckets
RECOVERY="tests/test_recovery.py::test_failure_at_each_phase_ends_equal_to_failure_free_run[2x2-zero2-crash-backward]"
EQUIVALENCE_5="tests/test_equivalence.py::test_tp3_tp2_sgd[0] tests/test_equivalence.py::test_tp3_tp2_sgd[1]
  tests/test_equivalence.py::test_tp3_tp2_sgd[2] tests/test_equivalence.py::test_tp3_tp2_adamw[0]
  tests/test_equivalence.py::test_tp3_tp2_adamw[1] tests/test_equivalence.py::test_tp3_tp2_adamw[2]
  tests/test_equivalence.py::test_three_replicas_tp2_tp2_tp1
  tests/test_comm_contract.py::test_equivalence_run_keeps_the_contract[1]
  tests/test_comm_contract.py::test_equivalence_run_keeps_the_contract[2]
  tests/test_overlap.py::test_anchor_backward_starts_before_the_slowed_contributor_ends"
RECOVERY_CONTRACT=tests/test_comm_contract.py::test_recovery_keeps_the_contract

report() {  # report NAME OK LOG DETAIL
  if [ "$2" = 1 ]; then
    echo "gpu_check: PASS $1: $4"
  else
    echo "gpu_check: FAIL $1 (see $3): $4"
    failed=1
  fi
}

check() {  # check NAME COMMAND...: passes if the command exits 0
  local name=$1; shift
  local log="$logs/$name.log" ok=0
  "$@" > "$log" 2>&1 && ok=1
  report "$name" $ok "$log" "$(tail -n 1 "$log")"
}

pytest_checks() {  # pytest_checks SESSION NAME=NODEIDS...: one pytest session, logged to SESSION.log; a check passes
  # only if pytest reports every one of its tests PASSED (a skipped, deselected or missing test fails it)
  local log="$logs/$1.log" spec id ok detail n ids=()
  shift
  for spec in "$@"; do ids+=(${spec#*=}); done
  python -m pytest -q -p no:cacheprovider -rA "${ids[@]}" ${NTP_GPU_CHECK_PYTEST_ARGS:-} > "$log" 2>&1
  for spec in "$@"; do
    ok=1 detail="" n=0
    for id in ${spec#*=}; do
      n=$((n + 1))
      grep -qxF "PASSED $id" "$log" && continue
      ok=0 detail=${detail:-$(grep -F "FAILED $id" "$log" | head -n 1)}
      detail=${detail:-"not PASSED (skipped, deselected or not run): $id"}
    done
    [ $ok = 1 ] && detail="$n of $n PASSED"
    report "${spec%%=*}" $ok "$log" "$detail (session: $(tail -n 1 "$log"))"
  done
}

four_rank_checks() {  # four_rank_checks TAG STEADY_STATE_ARGS...
  local tag=$1; shift
  pytest_checks "pytest$tag" "equivalence$tag=$EQUIVALENCE" "recovery$tag=$RECOVERY"
  check "steady_state$tag" timeout 900 python benchmarks/steady_state.py --tp 2 --replicas 2 --contributor "$@"
}

if [ "$cpu" = 1 ]; then
  export CUDA_VISIBLE_DEVICES="" DS_ACCELERATOR=cpu
  echo "gpu_check: --cpu, no GPU used"
  # The selections of the GPU-only checks name tests that exist (pytest exits non-zero on a missing one).
  check selections python -m pytest -q -p no:cacheprovider --collect-only $EQUIVALENCE_5 $RECOVERY_CONTRACT
  check bf16_step timeout 300 python tools/gpu_step.py --cpu
  check device_watch timeout 120 python tools/gpu_device_watch.py --cpu
  export NTP_TEST_BACKEND=nccl_model  # (NCCL's rules; the two tests run on gloo in the README suite)
  four_rank_checks "_nccl_model" --steps 3 --warmup 1 --accum 2
  exit $failed
fi

gpus=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$gpus" -lt 1 ]; then
  echo "gpu_check: FAIL no CUDA device visible (tools/gpu_check.sh --cpu runs the checks on CPU)"
  exit 1
fi
echo "gpu_check: $gpus GPU(s)"
check bf16_step timeout 1800 python tools/gpu_step.py
check device_watch timeout 300 python tools/gpu_device_watch.py
if [ "$(nproc)" -ge 4 ]; then
  check straggler env CUDA_VISIBLE_DEVICES= timeout 1800 python benchmarks/straggler.py
fi
if [ "$gpus" -ge 4 ]; then
  export NTP_TEST_DEVICE=cuda
  four_rank_checks "" --steps 10
fi
if [ "$gpus" -ge 5 ]; then
  pytest_checks pytest_5 "equivalence_5=$EQUIVALENCE_5"
fi
if [ "$gpus" -ge 6 ]; then
  pytest_checks pytest_6 "recovery_contract=$RECOVERY_CONTRACT"
fi
exit $failed
