"""`ntp-ds inject`: send a fault to a running job through its store.

    ntp-ds inject --store HOST:PORT --rank R --step S --phase P --kind K [--factor F]
    ntp-ds inject --store HOST:PORT --rank R --step S --kind repair

The target rank fires it at the first boundary of phase P at or after step S (`--kind slow --factor F`: from
then on its micro-batches take F times as long; F=1 restores full speed). A `repair` names a rank that has left: its
node's launcher starts a replacement, which joins the job and trains from step S on (no --phase). The fault is checked against the
running job first (its world size, steps, the ranks that have left: `ntp_ds.control.job`), and every wait is
bounded by --timeout-s, also against an address that accepts connections but is no store. A mistake is reported on
one line that names the option at fault, with exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from ntp_ds.control.faults import KINDS, PHASES, REPAIR_PHASE, Fault, send_fault
from ntp_ds.control.liveness_store import read_exits
from ntp_ds.control.job import read_job
from ntp_ds.control.store import connect_store, parse_address

USAGE_ERROR = 2


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """An argument parser that raises instead of printing usage and exiting."""

    def error(self, message):
        raise _UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ntp-ds inject", description="Send a fault to a running ntp_ds job through its store.")
    parser.add_argument("--store", required=True, help="HOST:PORT of the job's store (its launcher prints it)")
    parser.add_argument("--rank", required=True, type=int, help="launch rank that fails")
    parser.add_argument("--step", required=True, type=int, help="first step at which it fails")
    parser.add_argument("--phase", choices=PHASES, help="phase boundary at which it fails (not for a repair)")
    parser.add_argument("--kind", required=True, choices=KINDS,
                        help="crash (SIGKILL), hang (SIGSTOP), device_error (DeviceError raised), slow "
                             "(micro-batches take --factor times as long) or repair (a rank that left comes back "
                             "from --step on)")
    parser.add_argument("--factor", type=float, default=None,
                        help="kind slow only: how many times as long the rank's micro-batches take (>= 1; 1: full "
                             "speed again)")
    parser.add_argument("--timeout-s", type=float, default=10.0,
                        help="bound on every wait: reaching the store and each call to it (default: 10)")
    return parser


def check_against_job(store, fault: Fault) -> str:
    """Check `fault` against the job running on `store`; return how it will fire, or raise _UsageError."""
    job = read_job(store)
    if job is None:
        raise _UsageError("no ntp_ds job has published itself in this store yet (it does once its workers start "
                          "training); check --store, or wait for the first step")
    if fault.rank >= job.world_size:
        raise _UsageError(f"--rank={fault.rank} does not exist (the job's world size is {job.world_size}: ranks "
                          f"0..{job.world_size - 1})")
    exits = read_exits(store)
    if fault.kind == "repair":
        if fault.rank not in exits:
            raise _UsageError(f"--rank={fault.rank} has not left the job: only a rank that failed can be repaired")
        if fault.step > job.steps:
            raise _UsageError(f"--step={fault.step} does not exist (the job runs steps 1..{job.steps})")
        return (f"its launcher starts a replacement that joins from step {max(fault.step, job.step + 2)}; job at step "
                f"{job.step} of {job.steps}")
    if fault.rank in exits:
        raise _UsageError(f"--rank={fault.rank} has already left the job ({exits[fault.rank]})")
    if fault.step > job.steps:
        raise _UsageError(f"--step={fault.step} does not exist (the job runs steps 1..{job.steps})")
    if fault.step <= job.step:
        when = f"at the first {fault.phase} boundary after step {job.step} (the job has completed step {job.step})"
    else:
        when = f"at the first {fault.phase} boundary of step {fault.step} or later"
    if fault.phase in ("recovery", "rendezvous", "groups", "transfer"):
        when = f"in the first recovery at step {max(fault.step, job.step + 1)} or later, if one happens"
    return f"{when}; job at step {job.step} of {job.steps}, world size {job.world_size}"


def main(argv: list[str] | None = None) -> int:
    """Send one fault; return 0 on success, 2 on a usage mistake, an unreachable store or a fault the job cannot
    take. Every wait (connecting, the handshake, each store call) is bounded by --timeout-s."""
    try:
        args = build_parser().parse_args(argv)
        try:
            parse_address(args.store)
        except ValueError as err:
            raise _UsageError(f"--store: {err}") from None
        if not args.timeout_s > 0:
            raise _UsageError(f"--timeout-s={args.timeout_s} must be positive")
        if args.kind == "repair" and args.phase is not None:
            raise _UsageError("--phase: a repair happens at a step boundary; leave --phase out")
        if args.kind != "repair" and args.phase is None:
            raise _UsageError("--phase is required for a crash, hang or device_error")
        try:
            fault = Fault(args.rank, args.step, args.phase or REPAIR_PHASE, args.kind, args.factor)
        except ValueError as err:
            raise _UsageError("--" + str(err).removeprefix("fault.")) from None
        if fault.step < 1:
            raise _UsageError(f"--step={fault.step} does not exist: steps count from 1")
        try:
            store = connect_store(args.store, args.timeout_s)
            when = check_against_job(store, fault)
            n = send_fault(store, fault)
        except (ConnectionError, RuntimeError) as err:
            raise _UsageError(f"--store={args.store}: {' '.join(str(err).split())[:300]}") from None
    except _UsageError as err:
        print(f"ntp-ds inject: error: {err}", file=sys.stderr)
        return USAGE_ERROR
    what = f"slow (x{fault.factor:g})" if fault.kind == "slow" else fault.kind
    print(f"sent fault {n}: {what} on rank {fault.rank}, {when}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
