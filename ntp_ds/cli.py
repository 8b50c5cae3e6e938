"""The `ntp-ds` command: one entry point for training, launching, fault injection, simulation and reports."""

from __future__ import annotations

import importlib
import sys

USAGE = """usage: ntp-ds COMMAND [ARGS ...]

Nonuniform tensor parallelism for DeepSpeed: data-parallel replicas may run at different TP degrees, and a
replica that loses a GPU keeps training at a smaller degree.

commands:
  train [OVERRIDES]     train (or dry-run) a recipe; starts its own workers on this machine
                          ntp-ds train recipe=cpu_demo
                          ntp-ds train recipe=gpu_70b_nvl72 dry_run=true
                          ntp-ds train parallel.tp=2 parallel.replicas=2 fault=none train.steps=20
  launch [OPTIONS] -m MODULE [ARGS]
                        start N workers on this node; survivors keep running when one dies
                          ntp-ds launch --nproc-per-node 4 -m ntp_ds.train recipe=cpu_demo
  inject --store HOST:PORT --rank R --step S --phase P --kind K
                        send a fault to a running job (its launcher prints the store address)
  simulate [OVERRIDES]  cluster-scale goodput simulator (no GPU needed)
                          ntp-ds simulate recipe=paper_eval out=outputs/sim
  report RUN_DIR        goodput timeline PNG and summary table of a training run

Run `ntp-ds COMMAND --help` for a command's options. Quick start: `ntp-ds train recipe=cpu_demo`, then
`ntp-ds report RUN_DIR` with the directory it prints. Docs: docs/usage.md.
"""

COMMANDS = {
    "train": "ntp_ds.train",
    "launch": "ntp_ds.supervise.launch",
    "inject": "ntp_ds.control.inject",
    "simulate": "ntp_ds.sim.cli",
    "report": "ntp_ds.report",
}


def main(argv: list[str] | None = None) -> int:
    """Dispatch `ntp-ds COMMAND ARGS` to the command's `main(ARGS)`; return its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(f"ntp-ds: error: give a command: {', '.join(COMMANDS)} (ntp-ds --help)", file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"ntp-ds: error: unknown command {command!r}; choose one of {', '.join(COMMANDS)} "
              f"(ntp-ds --help)", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(COMMANDS[command])
    except ModuleNotFoundError as e:
        if e.name and COMMANDS[command].startswith(e.name):
            print(f"ntp-ds {command}: error: not available in this build ({COMMANDS[command]} is missing)",
                  file=sys.stderr)
            return 2
        raise
    try:
        code = module.main(rest)
    except SystemExit as e:  # argparse's --help and usage errors
        code = e.code
    except KeyboardInterrupt:  # Ctrl-C before a command took charge of its signals (e.g. while composing a config)
        print(f"ntp-ds {command}: interrupted", file=sys.stderr)
        return 130
    return code if isinstance(code, int) else (0 if code is None else 2)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
