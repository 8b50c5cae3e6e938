"""Recovery time: ntp_ds in-memory recovery against DeepSpeed checkpoint-restart, same model, same failure.

Both jobs train the same tiny Llama on 2 replicas x TP 2 (4 processes, gloo on CPU or NCCL on GPUs), the same
batches, and lose the same rank the same way: launch rank 3 SIGKILLs itself (the fault injector's `crash`) in the
backward pass of step K of N.

- ntp_ds: the survivors detect the death, agree on it, regroup, rebuild replica 1 at TP 1 from replica 0's shards
  in memory and re-run step K. No completed step is lost.
- checkpoint-restart, as DeepSpeed users do it today: a plain DeepSpeed engine (same shards, same groups through
  the `mpu`) saves `engine.save_checkpoint` every C steps. When the rank dies the job is over; every process starts
  again (new interpreter, imports, process group, engine build), `load_checkpoint` reads the last checkpoint, and
  the steps after it are done again. The restart here is immediate (no scheduler queue, no node replacement), so
  its time is a lower bound.

Recovery time runs from the crash (the wall time the injector recorded) to the completion of step K, the step the
failure interrupted: the job is then back where it was. Lost steps are the completed steps the resumed state lacks.

The physical bound, measured in the same run: the crash detection floor (the soonest any survivor's step failed
after the crash), plus the median degraded step after the recovery (step K has to be done again at the new degree),
plus the dead rank's parameter and optimizer bytes over the point-to-point bandwidth measured between two ranks of
the job before training. `failure_cost_speedup` compares what each approach loses beyond the step it had to finish
anyway: (restart_s - step) / (ntp_s - step), with the healthy median step. The last line reads
`recovery_speedup=<restart / ntp> ntp_s=<x> restart_s=<y> ntp_lost_steps=<n> restart_lost_steps=<m> bound_s=<b>
bound_ratio=<ntp / bound> failure_cost_speedup=<f> healthy_stall_s=<s> healthy_stall_ratio=<r>`: the healthy stall is
the longest time a rank of the replica that lost nothing took from the crash to its completion of step K, and its
ratio is over the detection floor plus a degraded step (the target is 1.2 or less).

    python benchmarks/recovery.py               # about 17M parameters (hidden 512, 5 layers)
    python benchmarks/recovery.py --size large  # about 100M: the restart reads that model's checkpoint
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time

from ntp_ds.testing.spawn import run_ranks

WORLD, TP, REPLICAS, CRASH_RANK = 4, 2, 2, 3
SIZES = {"default": (512, 5), "large": (1024, 8)}
"""Presets of (hidden, layers): about 17M and 100M parameters."""
BANDWIDTH_BYTES = 32 << 20


def _model(args):
    from ntp_ds.models import LlamaConfig

    return LlamaConfig(vocab_size=1024, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                       num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                       max_position_embeddings=args.seq)


def _bandwidth(rank: int) -> float | None:
    """Bytes per second one way between ranks 0 and 2 (different replicas), best of three timed exchanges."""
    import torch

    from ntp_ds.comm import wire

    peer = {0: 2, 2: 0}.get(rank)
    send = torch.ones(BANDWIDTH_BYTES // 4, device=wire.device_of())
    recv = torch.empty_like(send)
    best = None
    for _ in range(3):
        wire.barrier()
        t = time.perf_counter()
        if peer is not None:
            wire.exchange({peer: send}, {peer: recv}, op="bandwidth").wait()
        elapsed = time.perf_counter() - t
        wire.barrier()
        if peer is not None:
            best = max(best or 0.0, BANDWIDTH_BYTES / elapsed)
    return best


def _ds_config(args) -> dict:
    return {"train_batch_size": args.global_batch, "train_micro_batch_size_per_gpu": args.micro,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            "zero_optimization": {"stage": 1}, "steps_per_print": 10**9, "wall_clock_breakdown": False}


def _faults(args) -> list[dict]:
    return [{"rank": CRASH_RANK, "step": args.fail_step, "phase": "backward", "kind": "crash"}]


def _fired(store) -> float | None:
    """Wall time at which the crashed rank fired its fault, as its injector recorded it in the store."""
    from ntp_ds.control.faults import fired_key

    key = fired_key(CRASH_RANK)
    return json.loads(store.get(key))["wall"] if store.check([key]) else None


# -- ntp_ds: live recovery ---------------------------------------------------------------------------------------
def ntp_worker(rank, world_size, args):
    """One rank of the ntp_ds job; returns its step completion times and what the recovery resumed from."""
    from ntp_ds.batch.loader import GlobalBatchSampler, SyntheticTokens, replica_micro_batches
    from ntp_ds.control.faults import FaultSchedule
    from ntp_ds.control.store import connect_from_env
    from ntp_ds.engine.config import NTPConfig
    from ntp_ds.fault_tolerant import start

    config = _model(args)
    ntp = NTPConfig.from_any({"tp": TP, "replicas": REPLICAS, "timeout_s": args.timeout_s, "fault_tolerance": {
        "heartbeat_timeout_s": args.heartbeat_timeout_s, "hang_timeout_s": None}})
    store = connect_from_env(args.timeout_s)
    engine = start(config, _ds_config(args), ntp, store, FaultSchedule.from_config(_faults(args), world_size),
                   seq_len=args.seq, stop_on_signals=False)  # the public handle, as users and `ntp-ds train` run it
    bandwidth = _bandwidth(rank)
    data = SyntheticTokens(config.vocab_size, args.seq, size=4096, seed=0)
    sampler = GlobalBatchSampler(len(data), seed=0)
    done, resumed_at_steps, noticed, recovered = {}, None, None, None
    for step in engine.train_steps(args.steps):
        try:
            for batch in replica_micro_batches(data, sampler, engine.batch_plan, engine.ntp_groups.replica, step):
                engine.backward(engine(batch))
                engine.step()
        except (RuntimeError, TimeoutError, ConnectionError) as error:
            noticed = time.time()
            engine.recover(error)
            recovered = time.time()
            resumed_at_steps = engine.global_steps
            continue
        done[step + 1] = time.time()
    events = engine.recovery.events
    engine.close()
    return {"done": done, "resumed_at_steps": resumed_at_steps, "fired": _fired(store), "noticed": noticed,
            "recovered": recovered, "bandwidth": bandwidth, "event": events[-1] if events else None}


# -- DeepSpeed: checkpoint-restart -------------------------------------------------------------------------------
def deepspeed_worker(rank, world_size, args, ckpt_dir: str, resume: bool):
    """One rank of the plain DeepSpeed job: train (from the last checkpoint if `resume`), checkpoint every C steps.

    Returns its step completion times, the steps the loaded checkpoint held, the seconds spent saving checkpoints
    and the times at which the process started training and finished loading. A peer's death ends it.
    """
    t_fn = time.time()
    from datetime import timedelta

    import deepspeed
    import torch

    from ntp_ds.batch import plan_batch
    from ntp_ds.batch.loader import GlobalBatchSampler, SyntheticTokens, replica_micro_batches
    from ntp_ds.comm.groups import NTPMpu, backend_for_device, build_groups
    from ntp_ds.control.faults import FaultInjector, FaultSchedule
    from ntp_ds.control.store import connect_from_env
    from ntp_ds.layout import Topology, plan_gradient_sync
    from ntp_ds.models import Llama

    config = _model(args)
    deepspeed.init_distributed(dist_backend=backend_for_device(), timeout=timedelta(seconds=args.timeout_s))
    topology = Topology.from_degrees(config.units(), (TP,) * REPLICAS)
    sync = plan_gradient_sync(topology)
    groups = build_groups(topology, sync, rank, args.timeout_s)
    torch.manual_seed(0)
    module = Llama(config, layout=groups.layout, tp_rank=groups.tp_rank, tp_group=groups.tp_group, seed=0)
    if torch.cuda.is_available():
        module = module.cuda()
    engine, *_ = deepspeed.initialize(model=module, model_parameters=list(module.parameters()),
                                      config=_ds_config(args), mpu=NTPMpu(groups))
    loaded = 0
    if resume:
        engine.load_checkpoint(ckpt_dir)
        loaded = engine.global_steps
    t_ready = time.time()
    store = connect_from_env(args.timeout_s)
    injector = FaultInjector(FaultSchedule.from_config(_faults(args) if not resume else [], world_size), rank, store)
    plan = plan_batch((1.0,) * REPLICAS, args.global_batch, args.micro, "preserve_global_batch", sync.anchors)
    data = SyntheticTokens(config.vocab_size, args.seq, size=4096, seed=0)
    sampler = GlobalBatchSampler(len(data), seed=0)
    done, save_s = {}, 0.0
    try:
        for step in range(engine.global_steps, args.steps):
            for batch in replica_micro_batches(data, sampler, plan, groups.replica, step):
                loss = engine(input_ids=batch["input_ids"].to(engine.device), labels=batch["labels"].to(engine.device))
                injector.check(step + 1, "backward")
                engine.backward(loss)
                engine.step()
            done[step + 1] = time.time()
            if (step + 1) % args.checkpoint_every == 0:
                t = time.time()
                engine.save_checkpoint(ckpt_dir)
                save_s += time.time() - t
    except (RuntimeError, TimeoutError, ConnectionError):
        pass  # a peer died: this job is over, as the launcher would end it
    return {"done": done, "loaded_steps": loaded, "save_s": save_s, "fired": _fired(store), "t_fn": t_fn,
            "t_ready": t_ready}


# -- the comparison ----------------------------------------------------------------------------------------------
def measure_ntp(args) -> dict:
    out = run_ranks(ntp_worker, WORLD, args, timeout=args.timeout, store=True)
    survivors = [out[r] for r in sorted(out)]
    fired = next(s["fired"] for s in survivors if s["fired"] is not None)
    first = max(s["done"][args.fail_step] for s in survivors)
    lost = (args.fail_step - 1) - survivors[0]["resumed_at_steps"]
    done = survivors[0]["done"]
    healthy = sorted(done[s] - done[s - 1] for s in done if s - 1 in done and s < args.fail_step)
    degraded = sorted(done[s] - done[s - 1] for s in done if s - 1 in done and s > args.fail_step)
    event = survivors[0]["event"] or {}
    lost_bytes = event.get("lost_shard_bytes", 0) + event.get("lost_optimizer_bytes", 0)
    bandwidth = max(s["bandwidth"] for s in survivors if s["bandwidth"])
    floor = min(s["noticed"] - fired for s in survivors if s["noticed"] is not None)
    degraded_step = degraded[len(degraded) // 2] if degraded else float("nan")
    # A replica that lost nothing: from the crash to its own completion of the step the failure interrupted.
    worst = max((r for r in out if r // TP != CRASH_RANK // TP), key=lambda r: out[r]["done"][args.fail_step])
    stall = out[worst]["done"][args.fail_step] - fired
    w = out[worst]
    # Where that rank's stall went: its step went on until it noticed, then it recovered, then it re-ran the step.
    parts = {"noticed_s": w["noticed"] - fired, "recovered_s": w["recovered"] - w["noticed"],
             "rerun_s": w["done"][args.fail_step] - w["recovered"]}
    return {"seconds": first - fired, "healthy_stall_s": stall, "stall_parts": parts, "lost_steps": lost,
            "event": event, "step_s": healthy[len(healthy) // 2],
            "detection_floor_s": floor, "degraded_step_s": degraded_step, "lost_bytes": lost_bytes,
            "bandwidth": bandwidth, "bound_s": floor + degraded_step + lost_bytes / bandwidth}


def measure_restart(args) -> dict:
    ckpt = tempfile.mkdtemp(prefix="ntp_bench_ckpt_")
    try:
        t0 = time.time()
        first = run_ranks(deepspeed_worker, WORLD, args, ckpt, False, timeout=args.timeout, store=True)
        crashed = time.time()
        fired = next(r["fired"] for r in first.values() if r["fired"] is not None)
        t_restart = time.time()
        # A restarted job starts fresh interpreters that import torch and DeepSpeed again.
        second = run_ranks(deepspeed_worker, WORLD, args, ckpt, True, timeout=args.timeout, store=True, fresh=True)
        ranks = [second[r] for r in sorted(second)]
        back = max(r["done"][args.fail_step] for r in ranks)
        first_step = max(min(r["done"].values()) for r in ranks)
        loaded = ranks[0]["loaded_steps"]
        return {"seconds": back - fired, "first_step_s": first_step - fired,
                "lost_steps": (args.fail_step - 1) - loaded, "loaded_steps": loaded, "teardown_s": crashed - fired,
                "start_s": max(r["t_fn"] for r in ranks) - t_restart,
                "build_and_load_s": max(r["t_ready"] - r["t_fn"] for r in ranks),
                "save_s": max(r["save_s"] for r in first.values()), "first_run_s": crashed - t0}
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="steps N of each job")
    parser.add_argument("--fail-step", type=int, default=14, help="step K in whose backward rank 3 crashes")
    parser.add_argument("--checkpoint-every", type=int, default=5, help="checkpoint interval C of the restart job")
    parser.add_argument("--size", choices=sorted(SIZES), default="default",
                        help="model preset: default about 17M parameters (hidden 512, 5 layers), large about 100M")
    parser.add_argument("--hidden", type=int, help="override the preset's hidden size")
    parser.add_argument("--layers", type=int, help="override the preset's layer count")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=20.0, help="bound on every wait for a peer")
    parser.add_argument("--heartbeat-timeout-s", type=float, default=3.0)
    parser.add_argument("--timeout", type=float, default=300.0, help="hard limit on each multi-process run")
    args = parser.parse_args(argv)
    args.hidden = args.hidden or SIZES[args.size][0]
    args.layers = args.layers or SIZES[args.size][1]
    if args.fail_step + 2 > args.steps:
        parser.error(f"--fail-step={args.fail_step} leaves fewer than two degraded steps to time before --steps="
                     f"{args.steps}")
    if not 1 < args.fail_step <= args.steps or args.checkpoint_every < 1:
        parser.error(f"need 1 < --fail-step <= --steps and --checkpoint-every >= 1; got --fail-step={args.fail_step} "
                     f"--steps={args.steps} --checkpoint-every={args.checkpoint_every}")

    from ntp_ds.models import Llama

    params = sum(p.numel() for p in Llama(_model(args), init=False, device="meta").parameters())
    print(f"Llama of {params / 1e6:.1f}M parameters (hidden {args.hidden}, {args.layers} layers), {REPLICAS} replicas "
          f"x TP {TP}, rank {CRASH_RANK} crashes (SIGKILL) in the backward of step {args.fail_step} of {args.steps}",
          flush=True)
    ntp = measure_ntp(args)
    e = ntp["event"] or {}
    print(f"ntp_ds in-memory recovery: {ntp['seconds']:.2f} s from the crash to step {args.fail_step} completed; "
          f"{ntp['lost_steps']} steps lost; TP degrees {e.get('degrees_before')} -> {e.get('degrees_after')}, "
          f"agreement {e.get('agreement_s', 0):.2f} s, regroup {e.get('regroup_s', 0):.2f} s, reshard "
          f"{e.get('reshard_s', 0):.2f} s, lossless {e.get('lossless')}; a step takes {ntp['step_s']:.2f} s "
          f"({ntp['degraded_step_s']:.2f} s degraded)", flush=True)
    print(f"bound: detection floor {ntp['detection_floor_s']:.2f} s + a degraded step {ntp['degraded_step_s']:.2f} s "
          f"+ {ntp['lost_bytes'] / 2**20:.1f} MiB lost at {ntp['bandwidth'] / 2**20:.0f} MiB/s point to point = "
          f"{ntp['bound_s']:.2f} s", flush=True)
    parts = ntp["stall_parts"]
    print(f"healthy replica: noticed the crash {parts['noticed_s']:.2f} s after it, recovered in "
          f"{parts['recovered_s']:.2f} s, re-ran step {args.fail_step} in {parts['rerun_s']:.2f} s: a stall of "
          f"{ntp['healthy_stall_s']:.2f} s against 1.2 x (detection floor + degraded step) = "
          f"{1.2 * (ntp['detection_floor_s'] + ntp['degraded_step_s']):.2f} s", flush=True)
    restart = measure_restart(args)
    print(f"DeepSpeed checkpoint-restart (checkpoint every {args.checkpoint_every} steps): {restart['seconds']:.2f} s "
          f"from the crash to step {args.fail_step} completed ({restart['first_step_s']:.2f} s to the first step "
          f"after the restart); {restart['lost_steps']} steps lost (resumed from step {restart['loaded_steps']}); "
          f"job teardown {restart['teardown_s']:.2f} s, process start (spawn, import torch) "
          f"{restart['start_s']:.2f} s, "
          f"import deepspeed + process group + engine + load_checkpoint {restart['build_and_load_s']:.2f} s; "
          f"checkpoint writes cost "
          f"{restart['save_s']:.2f} s over the first {args.fail_step - 1} steps", flush=True)
    speedup = restart["seconds"] / ntp["seconds"] if ntp["seconds"] > 0 else float("inf")
    step = ntp["step_s"]
    cost = (restart["seconds"] - step) / (ntp["seconds"] - step) if ntp["seconds"] > step else float("inf")
    print(f"recovery_speedup={speedup:.1f} ntp_s={ntp['seconds']:.2f} restart_s={restart['seconds']:.2f} "
          f"ntp_lost_steps={ntp['lost_steps']} restart_lost_steps={restart['lost_steps']} "
          f"bound_s={ntp['bound_s']:.2f} bound_ratio={ntp['seconds'] / ntp['bound_s']:.2f} "
          f"failure_cost_speedup={cost:.1f} healthy_stall_s={ntp['healthy_stall_s']:.2f} "
          f"healthy_stall_ratio={ntp['healthy_stall_s'] / (ntp['detection_floor_s'] + ntp['degraded_step_s']):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
