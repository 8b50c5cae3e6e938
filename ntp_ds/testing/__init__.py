"""Machinery the tests and the benchmarks share: running a function on N local ranks with a hard time limit, and the
test backend `nccl_model` (NCCL's rules on CPU), which registers itself with torch when imported."""

import os

from ntp_ds.envs import TEST_BACKEND_ENV


def register_test_backend() -> None:
    """Register the test backend that `NTP_TEST_BACKEND` names, if it is one of ours (`nccl_model`): every process
    that builds groups under it calls this first (`ntp_ds.initialize`, the test spawner, the tests' conftest)."""
    if os.environ.get(TEST_BACKEND_ENV) == "nccl_model":
        import ntp_ds.testing.nccl_model  # noqa: F401  (registers the backend and its device)
