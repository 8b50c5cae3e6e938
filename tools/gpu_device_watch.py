"""A stopped device is found by its progress within hang_timeout_s + 2 s, and a healthy one is not (one rank).

The training thread's device events (`ntp_ds.comm.device`) feed the progress a heartbeat would send; a judge thread
reads it ten times a second into a `LivenessMonitor`, as a waiting peer's heartbeat would. First a healthy stretch
(phase points, device work, waits on the device): nobody may call it hung. Then the device stops (a device-side
spin longer than the bound under CUDA; nccl_model's stopped device with --cpu) and the host waits on it inside a
wait, its thread alive: the judge must call it hung within hang_timeout_s + 2 s. The last line says PASS or FAIL.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from ntp_ds.comm import device, wire
from ntp_ds.control.liveness import Beat, LivenessMonitor
from ntp_ds.testing.spawn import free_port


def spin_cycles(seconds: float) -> int:
    """Device cycles `torch.cuda._sleep` spins for about `seconds` (measured with a short spin)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 50_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return int(cycles * seconds * 1000.0 / start.elapsed_time(end))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="nccl_model's device on CPU instead of a GPU")
    parser.add_argument("--hang-timeout-s", type=float, default=2.0)
    args = parser.parse_args()
    bound = args.hang_timeout_s
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()))
    if args.cpu:
        import ntp_ds.testing.nccl_model  # noqa: F401  (registers the backend and its device)
        backend, on = "nccl_model", "cpu"
    else:
        if not torch.cuda.is_available():
            print("gpu_device_watch: FAIL no CUDA device (use --cpu)")
            return 1
        torch.cuda.set_device(0)
        backend, on = "nccl", "cuda"
    dist.init_process_group(backend, rank=0, world_size=1)
    wire.configure(60.0)
    if device.recorder(backend) is None:
        print(f"gpu_device_watch: FAIL no device events under {backend}")
        return 1

    monitor = LivenessMonitor([0], 3600.0, hang_timeout_s=bound)
    found: list[float] = []
    stop = threading.Event()

    def judge():
        beat = 0
        while not stop.wait(0.1):
            beat += 1
            now = wire.progress()
            monitor.observe({0: Beat(beat, time.time(), now.count, now.waiting)})
            if monitor.hung() and not found:
                found.append(time.monotonic())

    thread = threading.Thread(target=judge, daemon=True)
    thread.start()
    x = torch.randn(512, 512, device=on)
    healthy_until = time.monotonic() + 2 * bound
    while time.monotonic() < healthy_until:  # a healthy rank: phase points, device work, waits on its device
        with wire.working():
            x = torch.tanh(x @ x)
        with wire.waiting():
            if on == "cuda":
                torch.cuda.current_stream().synchronize()
    if found:
        print(f"gpu_device_watch: FAIL a healthy device was found hung after {found[0] - healthy_until:.2f} s")
        return 1

    stopped = time.monotonic()
    if on == "cuda":
        torch.cuda._sleep(spin_cycles(bound + 6.0))  # longer than the bound and its slack
    else:
        device.hang(backend)
    with wire.waiting():  # the host waits on its own stopped device, its thread alive
        if on == "cuda":
            torch.cuda.current_stream().synchronize()
        else:
            while not found and time.monotonic() < stopped + bound + 6.0:
                time.sleep(0.05)
    stop.set()
    thread.join()
    if not found:
        print(f"gpu_device_watch: FAIL a stopped device was not found hung (hang_timeout_s {bound:g})")
        return 1
    seen = found[0] - stopped
    verdict = "PASS" if seen <= bound + 2.0 else "FAIL"
    print(f"gpu_device_watch: {verdict} stopped device found hung after {seen:.2f} s (hang_timeout_s {bound:g}, "
          f"bound {bound + 2.0:g} s; healthy stretch of {2 * bound:g} s not judged)")
    if on == "cuda":
        dist.destroy_process_group()
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
