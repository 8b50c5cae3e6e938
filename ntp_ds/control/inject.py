"""`ntp-ds inject`: send a fault to a running job through its store.

    ntp-ds inject --store HOST:PORT --rank R --step S --phase P --kind K

The target rank fires it at the first boundary of phase P at or after step S. A mistake is reported on one line
that names the option at fault, with exit status 2.
"""

from __future__ import annotations

import argparse
import sys

from ntp_ds.control.faults import KINDS, PHASES, Fault, send_fault
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
    parser.add_argument("--phase", required=True, choices=PHASES, help="phase boundary at which it fails")
    parser.add_argument("--kind", required=True, choices=KINDS,
                        help="crash (SIGKILL), hang (SIGSTOP) or device_error (DeviceError raised)")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="bound on reaching the store")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Send one fault; return 0 on success, 2 on a usage mistake or an unreachable store."""
    try:
        args = build_parser().parse_args(argv)
        try:
            parse_address(args.store)
        except ValueError as err:
            raise _UsageError(f"--store: {err}") from None
        if not args.timeout_s > 0:
            raise _UsageError(f"--timeout-s={args.timeout_s} must be positive")
        try:
            fault = Fault(args.rank, args.step, args.phase, args.kind)
        except ValueError as err:
            raise _UsageError("--" + str(err).removeprefix("fault.")) from None
        try:
            n = send_fault(connect_store(args.store, args.timeout_s), fault)
        except (ConnectionError, RuntimeError) as err:
            raise _UsageError(f"--store={args.store}: {' '.join(str(err).split())[:300]}") from None
    except _UsageError as err:
        print(f"ntp-ds inject: error: {err}", file=sys.stderr)
        return USAGE_ERROR
    print(f"sent fault {n}: rank {fault.rank} {fault.kind} at step {fault.step}, phase {fault.phase}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
