"""A failure in step 1, before any optimizer step: recovery has no optimizer state to move (none exists yet), so
it is lossless, and the re-run step and the rest of the run end equal to the failure-free run."""

from tests.helpers.recovery import assert_equivalent, assert_lossless_and_minimal, fault, run


def test_failure_before_the_first_optimizer_step_is_recovered_losslessly():
    results = run((2, 2), 1, [fault(3, 1, "backward")])
    assert sorted(results) == [0, 1, 2]
    assert_lossless_and_minimal(results, (2, 1))
    assert_equivalent(results)
