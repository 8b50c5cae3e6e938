"""Which errors are a peer's failure (recovered from) and which are this rank's own (the rank ends)."""

import torch
from torch.distributed.utils import _apply_to_tensors

from ntp_ds.comm import wire


def _raised_in_a_torch_distributed_frame(error: BaseException) -> BaseException:
    def fail(_tensor):
        raise error
    try:
        _apply_to_tensors(fail, torch.zeros(1))  # torch/distributed/utils.py calls `fail`: a c10d frame
    except BaseException as caught:
        return caught
    raise AssertionError("nothing raised")


def test_a_device_error_inside_a_collective_is_this_ranks_own():
    # Before: an AcceleratorError (Xid 79, illegal address, ECC) whose traceback passes through torch.distributed was
    # taken for a wire failure, and the broken rank ran a recovery on a dead context.
    error = _raised_in_a_torch_distributed_frame(torch.AcceleratorError("CUDA error: an illegal memory access"))
    assert not wire.is_wire_failure(error)
    wire._state.failed.set()  # a peer's failure already declared does not make it the wire's either
    try:
        assert not wire.is_wire_failure(error)
    finally:
        wire._state.failed.clear()


def test_a_runtime_error_inside_a_collective_is_the_wires():
    assert wire.is_wire_failure(_raised_in_a_torch_distributed_frame(RuntimeError("Connection closed by peer")))
    assert not wire.is_wire_failure(RuntimeError("a shape bug of this rank"))
