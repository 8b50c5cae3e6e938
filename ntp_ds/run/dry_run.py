"""`dry_run=true`: check a recipe without GPUs. Print shapes, per-GPU memory (healthy and degraded), the group
layout and each degraded degree's pace, computed from the config alone: no process group, no weights (the model is
built on the meta device).
"""

from __future__ import annotations

import json
import math
import re

from ntp_ds.batch import BatchError, StepCost, lockstep_replicas, max_micro_batch, plan_batch, predict_step_s
from ntp_ds.batch.memory import rank_memory
from ntp_ds.layout import ShardLayout, Topology, plan_gradient_sync, replica_paces
from ntp_ds.layout import units as U
from ntp_ds.run.config import RunConfig

GIB = 2**30


def _ranges(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])


def _size(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _spread(values: list[int]) -> str:
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}-{hi}"


def degraded_layouts(layout: ShardLayout, min_tp: int) -> list[tuple[str, ShardLayout]]:
    """The healthy layout, after one lost GPU, and at `min_tp`, as recovery would shrink it (work-balanced)."""
    tp = layout.tp
    out = [(f"healthy TP {tp}", layout)]
    if tp - 1 >= min_tp and tp > 1:
        out.append((f"1 GPU lost: TP {tp - 1}", layout.without_ranks({tp - 1})))
    if min_tp < tp - 1:
        out.append((f"at min_tp: TP {min_tp}", layout.without_ranks(set(range(min_tp, tp)))))
    return out


def pace_section(cfg: RunConfig, ds: dict, healthy: ShardLayout) -> list[str]:
    """For each degree from tp-1 down to min_tp: the most loaded rank's work per token against a healthy rank's
    (the replica's pace), the ideal t/t', the samples the batch planner gives that replica next to healthy ones
    (from that pace) and the step it charges, against the failure-free step."""
    p, lines = cfg.parallel, []
    share = ds["train_batch_size"] // p.replicas
    for degree in range(p.tp - 1, max(p.min_tp, 1) - 1, -1):
        layouts = (healthy,) * (p.replicas - 1) + (healthy.without_ranks(set(range(degree, p.tp))),)
        paces = replica_paces(layouts, p.tp)
        try:
            plan = plan_batch(paces, ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], p.batch_policy)
            step = predict_step_s(plan, [StepCost(0.0, pace) for pace in paces]) / share
            samples = f"share {plan.replicas[-1].samples} of {share} samples, step {step:.3f}x failure-free"
        except BatchError as e:
            samples = f"no share ({e})"
        lines.append(f"degraded pace TP{degree}: {paces[-1]:.2f}x a healthy rank (ideal {p.tp / degree:.3f}x), "
                     f"{samples}")
    return lines


def shapes_section(cfg: RunConfig, layouts: list[tuple[str, ShardLayout]]) -> list[str]:
    from ntp_ds.models import empty_shard

    specs = empty_shard(cfg.model.model_config(), device="meta").param_specs()
    seen: dict[str, tuple[int, tuple]] = {}
    for name, (spec, shape) in specs.items():
        key = re.sub(r"\.layers\.\d+\.", ".layers.N.", name)
        count = seen.get(key, (0, None))[0]
        seen[key] = (count + 1, (spec, shape))
    rows = [["parameter", "full"] + [label.split(": ")[-1] for label, _ in layouts]]
    for key, (count, (spec, shape)) in seen.items():
        shards = [str(list(max((lay.shard_shape(spec, shape, r) for r in range(lay.tp)), key=math.prod)))
                  for _, lay in layouts]
        rows.append([key + (f" (x{count})" if count > 1 else ""), str(list(shape))] + shards)
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["shapes (full, then the largest rank's shard):"]
    for row in rows:
        lines.append("  " + row[0].ljust(widths[0]) + "".join(f"  {c:>{w}}" for c, w in zip(row[1:], widths[1:])))
    return lines


def memory_section(cfg: RunConfig, ds: dict, layouts: list[tuple[str, ShardLayout]]) -> list[str]:
    llama, micro = cfg.model.model_config(), ds["train_micro_batch_size_per_gpu"]
    budget = cfg.parallel.memory_budget_gb
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    share = f"over ZeRO-{stage} DP {cfg.parallel.replicas}" if stage else "unpartitioned"
    title = (f"memory per GPU, estimate (most loaded rank: weights, grads, fp32 master and Adam moments {share}; "
             f"activations at seq {cfg.data.seq_len}):")
    lines = [title,
             f"  {'layout':<22} {'static':>10} {'per sample':>10} {'micro':>5} {'total':>10}  budget"]
    for label, lay in layouts:
        static, per_sample = rank_memory(llama, lay, ds, cfg.data.seq_len, dp=cfg.parallel.replicas)
        fit = micro
        verdict = "no budget set"
        if budget is not None:
            try:
                fit = max_micro_batch(static, per_sample, int(budget * GIB), micro)
                verdict = f"fits {budget:g} GiB" + (f" at micro-batch {fit}" if fit < micro else "")
            except BatchError:
                fit, verdict = micro, f"DOES NOT FIT {budget:g} GiB"
        total = static + per_sample * fit
        lines.append(f"  {label:<22} {_size(static):>10} {_size(per_sample):>10} {fit:>5} {_size(total):>10}  "
                     f"{verdict}")
    return lines


def layout_section(cfg: RunConfig, ds: dict, topology: Topology) -> list[str]:
    plan = plan_gradient_sync(topology)
    batch = plan_batch(replica_paces(topology.layouts, cfg.parallel.tp), ds["train_batch_size"],
                       ds["train_micro_batch_size_per_gpu"], cfg.parallel.batch_policy,
                       lockstep_replicas(plan.anchors, cfg.parallel.zero_stage))
    lines = ["group layout (anchors reduce in DeepSpeed's DP groups; contributors send to their anchor):"]
    for r, lay in enumerate(topology.layouts):
        role = "anchor" if plan.is_anchor(r) else f"contributor -> replica {plan.anchor_of[r]}"
        units = ", ".join(f"{k} {_spread([U.count(lay.owned(k, t)) for t in range(lay.tp)])}"
                          for k in ("heads", "kv", "ffn", "vocab"))
        part = batch.replicas[r]
        lines.append(f"  replica {r}: ranks {_ranges(topology.ranks_of(r))} (TP {lay.tp}, {role}); per rank: {units}; "
                     f"{part.samples} samples in {part.micro_steps} micro-batch(es) of {_spread(list(part.micro_sizes))}")
    return lines


def describe(cfg: RunConfig) -> str:
    """The dry-run report of a validated config."""
    llama, ds, p = cfg.model.model_config(), cfg.ds_config(), cfg.parallel
    units = llama.units(cfg.data.seq_len)
    topology = Topology.from_degrees(units, p.replica_degrees)
    from ntp_ds.models import empty_shard

    params = sum(math.prod(shape) for _, shape in empty_shard(llama, device="meta").param_specs().values())
    nproc = cfg.launcher.nproc_per_node or cfg.world_size // cfg.launcher.nnodes
    precision = "bf16" if ds.get("bf16", {}).get("enabled") else "fp32"
    head = f"dry run: recipe {cfg.recipe or '-'}, model {cfg.model.name} ({_count(params)} parameters, {precision})"
    topo = (f"topology: {p.replicas} replicas, TP degrees {list(topology.degrees)} (healthy {p.tp}, min {p.min_tp}) = "
            f"{cfg.world_size} processes of {cfg.allocated_gpus} GPUs allocated; launcher: {cfg.launcher.nnodes} "
            f"node(s) x {nproc}; ZeRO-{ds.get('zero_optimization', {}).get('stage', 0)}; "
            f"batch {ds['train_batch_size']} x {cfg.data.seq_len} tokens, micro-batch "
            f"{ds['train_micro_batch_size_per_gpu']}, policy {p.batch_policy}")
    lines = [head, topo, ""]
    healthy = ShardLayout.balanced(units, p.tp)
    layouts = degraded_layouts(healthy, p.min_tp)
    lines += shapes_section(cfg, layouts) + [""] + memory_section(cfg, ds, layouts) + [""]
    lines += layout_section(cfg, ds, topology)
    lines += [""] + pace_section(cfg, ds, healthy)
    lines += ["", f"DeepSpeed config: {json.dumps(ds, sort_keys=True)}"]
    return "\n".join(lines)
