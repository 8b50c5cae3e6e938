"""`ntp-ds train` and `python -m ntp_ds.train`: compose the config, then dry-run, launch the workers, or be one.

- Outside any launcher (no RANK in the environment) it validates the config and starts the world's workers on this
  node through `ntp_ds.supervise.launch` (`python -m ntp_ds.train` with the same overrides), then waits for them.
- Under a launcher (`ntp-ds launch`, `deepspeed --module ntp_ds.train`, `torchrun -m ntp_ds.train`) it is one rank:
  it builds the NTPEngine and runs the Trainer. The deepspeed launcher's `--local_rank=N` is accepted.
- `dry_run=true` prints shapes, per-GPU memory (healthy and degraded) and the group layout, and starts nothing.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
import warnings
from pathlib import Path

from ntp_ds.control.keys import WANDB_ID_KEY
from ntp_ds.envs import JOIN_ENV, RANK, WORLD_SIZE

PROG = "ntp-ds train"

USAGE = """usage: ntp-ds train [recipe=NAME] [GROUP=OPTION ...] [KEY=VALUE ...]

Train a Llama with nonuniform tensor parallelism on DeepSpeed. Without a launcher around it, this starts one
worker per GPU (the sum of the replicas' TP degrees) on this machine and waits for them.

  recipe=NAME        a ready experiment from recipes/: {recipes}
  GROUP=OPTION       pick a config group option:
{groups}
  KEY=VALUE          set one field, e.g. parallel.tp=2 parallel.replicas=2 parallel.zero_stage=1
                     train.steps=20 train.global_batch=8 seed=0 fault=none logging.wandb.mode=disabled
  hydra.run.dir=DIR  run directory (or run_dir=DIR); default outputs/DATE/TIME
  existing_run=resume|overwrite   the run directory holds a run: continue it from its last checkpoint (e.g.
                     after Ctrl-C or SIGTERM, which stop every worker cleanly), or replace it; default: refuse
  dry_run=true       print shapes, per-GPU memory (healthy and degraded) and the group layout; start nothing
  deepspeed_config=PATH.json   use this DeepSpeed config whole instead of generating one

Examples:
  ntp-ds train recipe=cpu_demo
  ntp-ds train recipe=gpu_70b_nvl72 dry_run=true
  ntp-ds train parallel.tp=2 parallel.replicas=2 fault=none train.steps=20 hydra.run.dir=runs/a
  ntp-ds report runs/a

The run directory gets metrics.jsonl, events.jsonl, summary.json, config.json, logs/, wandb/, final/ (HF weights)
and checkpoints/ (DeepSpeed's, for existing_run=resume).
Other launchers: ntp-ds launch --nproc-per-node N -m ntp_ds.train ..., deepspeed --num_gpus N --module
ntp_ds.train ..., torchrun --nproc-per-node N -m ntp_ds.train ... (see docs/usage.md for their limits).
"""

log = logging.getLogger("ntp_ds.train")


def usage() -> str:
    from ntp_ds.run.compose import GROUPS, available_recipes, group_options

    groups = "\n".join(f"                     {g}: {', '.join(group_options(g))}" for g in GROUPS)
    return USAGE.format(recipes=", ".join(available_recipes()), groups=groups)


class _TqdmHandler(logging.StreamHandler):
    """Write log lines above the progress bar instead of through it."""

    def emit(self, record):
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=sys.stderr)
        except Exception:
            self.handleError(record)


def setup_logging(rank: int, level: str, other_ranks_level: str) -> logging.Handler:
    """Console logging of this rank: `level` on rank 0 (the writer), `other_ranks_level` elsewhere; return the console
    handler, whose level follows the writer's role."""
    root = logging.getLogger("ntp_ds")
    root.setLevel(logging.DEBUG)
    root.propagate = False
    handler = _TqdmHandler()
    handler.setLevel(level if rank == 0 else other_ranks_level)
    handler.setFormatter(logging.Formatter(f"%(asctime)s [rank {rank}] %(levelname)s %(message)s", "%H:%M:%S"))
    root.handlers = [handler]
    return handler


def add_file_log(run_dir: Path, rank: int, level: str) -> None:
    """Also log this rank to RUN_DIR/logs/rank{rank}.log."""
    path = run_dir / "logs" / f"rank{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path)
    handler.setLevel(level)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.getLogger("ntp_ds").addHandler(handler)


def agree_run_dir(run_dir: str) -> Path:
    """Every rank takes rank 0's run directory (launchers that start ranks separately may compose different ones)."""
    from ntp_ds.comm import wire

    return Path(wire.broadcast_object(str(Path(run_dir).resolve()), 0))


def open_records(cfg, run_dir: Path, store, resume: bool):
    """The writer's records: metrics, events and summary files and the W&B run (resumed after a takeover)."""
    from ntp_ds.goodput.wandb_log import WandbLogger
    from ntp_ds.run.records import RunRecorder

    w = cfg.logging.wandb
    run_id = store.get(WANDB_ID_KEY).decode() if resume and store is not None and store.check([WANDB_ID_KEY]) else None
    wandb = WandbLogger(mode=w.mode, project=w.project, entity=w.entity, name=w.name or run_dir.name, tags=w.tags,
                        run_dir=run_dir, config=cfg.to_dict(), run_id=run_id or None)
    if store is not None and wandb.run_id and not resume:
        store.set(WANDB_ID_KEY, wandb.run_id)
    return RunRecorder(run_dir, wandb, resume=resume)


def run_worker(cfg, started: float, stop) -> int:
    """Be one rank: build the engine under live recovery (or, as a joiner, receive it from the running job), run the
    Trainer, write the records and the final weights."""
    from tqdm import tqdm

    import ntp_ds
    from ntp_ds import fault_tolerant
    from ntp_ds.comm import wire
    from ntp_ds.control.liveness_store import outlive_peers
    from ntp_ds.control.job import publish_job
    from ntp_ds.control.joins import JoinFailed, JoinRefused, JoinTimeout
    from ntp_ds.control.store import job_store
    from ntp_ds.recovery.manager import QuiescedExit, RecoveryImpossible
    from ntp_ds.run.records import CHECKPOINTS, LAST_GOOD, RUN_CONFIG, RunRecorder
    from ntp_ds.run.rundir import run_dir_of
    from ntp_ds.run.trainer import Trainer, is_writer, seed_everything

    rank = int(os.environ[RANK])
    console = setup_logging(rank, cfg.logging.level, cfg.logging.other_ranks_level)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    seed_everything(cfg.seed)
    store, hosts_store = job_store(cfg.parallel.timeout_s)
    stop.store = store
    joining = bool(os.environ.get(JOIN_ENV))
    build = dict(model=cfg.model.source(), config=cfg.ds_config(), seq_len=cfg.data.seq_len)
    if joining:  # a repaired or spare worker: the running job takes it in at a step boundary
        run_dir = Path(run_dir_of(cfg)).resolve()
        add_file_log(run_dir, rank, cfg.logging.level)
    if store is None:
        log.warning("no store to coordinate through: a failure ends the run")
        engine = ntp_ds.initialize(ntp=cfg.parallel.ntp(), **build)
    else:
        try:
            engine = fault_tolerant.start(ntp=cfg.parallel.ntp(live=True), store=store,
                                          schedule=cfg.fault_schedule(), hosts_store=hosts_store,
                                          stop_on_signals=False, **build)
        except (JoinRefused, JoinFailed, JoinTimeout) as why:
            log.error("rank %d cannot join: %s", rank, why)
            return 2
    if not joining:
        run_dir = agree_run_dir(run_dir_of(cfg))
        add_file_log(run_dir, rank, cfg.logging.level)
    live = store is not None
    if live:
        engine.recovery.last_good_dir = run_dir / LAST_GOOD
    if cfg.existing_run == "resume" and not joining:
        engine.load_checkpoint(run_dir / CHECKPOINTS)  # checked before the workers started: same degrees
        engine.refresh_copies()  # the buddies' copies of the loaded optimizer state, as after every step
    g = engine.ntp_groups
    members = engine.members if joining else None  # launch ranks by global rank: who writes the records
    console.setLevel(cfg.logging.level if is_writer(engine, members) else cfg.logging.other_ranks_level)
    log.info("replica %d, TP rank %d of %d (%s)", g.replica, g.tp_rank, len(g.tp_ranks),
             "anchor" if g.is_anchor else "contributor")
    recorder, progress = RunRecorder(None), None
    if joining and is_writer(engine, members):  # it took the writer's place: it goes on with the run's records
        recorder = open_records(cfg, run_dir, store, resume=True)
    elif not joining and is_writer(engine):
        if store is not None:
            publish_job(store, cfg.world_size, cfg.train.steps, engine.global_steps)
        (run_dir / RUN_CONFIG).write_text(json.dumps(cfg.to_dict(), indent=2, default=str) + "\n")
        recorder = open_records(cfg, run_dir, store, resume=False)
        log.info("run directory %s; TP degrees %s (%d ranks, %d GPUs allocated); W&B %s", run_dir,
                 list(g.topology.degrees), cfg.world_size, cfg.allocated_gpus, cfg.logging.wandb.mode)
        progress = tqdm(total=cfg.train.steps, desc=f"train {cfg.model.name}", unit="step", dynamic_ncols=True,
                        file=sys.stderr, disable=None if cfg.logging.progress else True)
        if progress.disable:
            progress = None

    def switch_writer(writer: bool) -> RunRecorder:
        console.setLevel(cfg.logging.level if writer else cfg.logging.other_ranks_level)
        return open_records(cfg, run_dir, store, resume=True) if writer else RunRecorder(None)

    trainer = Trainer(cfg, engine, recorder, run_dir=run_dir, switch_writer=switch_writer, stop=stop,
                      progress=progress, startup_s=time.perf_counter() - started, joined=joining)
    del g  # only the handle may hold the inner engine: a recovery releases it, closing its connections
    try:
        trainer.train()
    except QuiescedExit:
        trainer.recorder.hand_over()
        if hosts_store:
            outlive_peers(store, rank, cfg.world_size, cfg.parallel.heartbeat_timeout_s)
        raise
    except RecoveryImpossible as stop:
        log.error("training stops at step %d: %s", trainer.step + 1, " ".join(str(stop).split()))
        trainer.recorder.event("run_stopped", trainer.step, reason=str(stop))
        trainer.recorder.abort()
        if live:
            engine.recovery.close(finished=True)
        return 1
    except BaseException:
        trainer.recorder.abort()
        if live:
            engine.recovery.close()
        raise
    # Finish the transfers in flight and meet the peers after the job's last collective; the live handle also stops
    # beating, records this rank's exit and leaves the groups, which the plain engine leaves here.
    engine.close()
    if not live:
        wire.teardown()
    return stop.exit_code if trainer.stopped_by is not None else 0


def launch_local(cfg, argv: list[str]) -> int:
    """Start this node's workers of `python -m ntp_ds.train ARGV` and wait for them."""
    from ntp_ds.run.records import SUMMARY, read_summary
    from ntp_ds.supervise.forked import can_fork, preload
    from ntp_ds.supervise.launch import LaunchSpec, launch

    run_dir = Path(cfg.run_dir).resolve()
    lc = cfg.launcher
    nproc = lc.nproc_per_node or cfg.world_size // lc.nnodes
    print(f"{PROG}: {cfg.world_size} workers ({nproc} on this node), run directory {run_dir}", file=sys.stderr,
          flush=True)
    fork = lc.fork and can_fork()
    if fork:
        preload()
    spec = LaunchSpec([sys.executable, "-u", "-m", "ntp_ds.train", *argv], nproc, lc.nnodes, lc.node_rank,
                      lc.store, str(run_dir), lc.grace_s, fork=fork, repairs=cfg.fault_schedule().repairs(),
                      rack_size=lc.rack_size)
    code = launch(spec)
    summary = read_summary(run_dir / SUMMARY)
    if summary.get("status") == "stopped":
        print(f"{PROG}: stopped after step {summary.get('last_step')}; see the run with: ntp-ds report {run_dir}; "
              f"continue it with the same command and existing_run=resume", file=sys.stderr, flush=True)
    elif summary:
        print(f"{PROG}: done; see the run with: ntp-ds report {run_dir}", file=sys.stderr, flush=True)
    return code


def prepare_run_dir(cfg, clear: bool) -> None:
    """Check the run directory before any worker starts (see `ntp_ds.run.rundir`); with `existing_run=overwrite`,
    `clear` deletes the earlier run's outputs (done once: by `ntp-ds train`, or by rank 0 under a launcher)."""
    from ntp_ds.run.rundir import check_run_dir, clear_run, run_dir_of

    run_dir = run_dir_of(cfg)
    check_run_dir(run_dir, cfg.existing_run, cfg.parallel.replica_degrees, cfg.train.steps, config=cfg.to_dict())
    if cfg.existing_run == "overwrite" and clear:
        clear_run(run_dir)


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    under_launcher = RANK in os.environ
    early: list[int] = []
    if under_launcher:  # hold a stop signal that arrives during the imports below; StopSignals takes it over
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, lambda signum, _frame: early.append(signum))
    from ntp_ds.supervise.launch import set_cpu_accelerator

    set_cpu_accelerator()  # before the first deepspeed import
    from ntp_ds.run.compose import BAD_INPUT, fail, load_config, strip_launcher_args

    argv = strip_launcher_args(list(sys.argv[1:] if argv is None else argv))
    if any(a in ("-h", "--help", "help") for a in argv):
        print(usage())
        return 0

    first = int(os.environ.get(RANK, "0")) == 0
    if under_launcher:
        from ntp_ds.supervise.stop import StopSignals

        stop = StopSignals().install()  # a signal during start-up stops the run after its first step
        for signum in early:
            stop.receive(signum)
    try:
        cfg = load_config(argv)
        world = int(os.environ.get(WORLD_SIZE, "0")) if under_launcher and not cfg.dry_run else 0
        cfg.validate(world or None)
        if under_launcher and not cfg.dry_run:
            from ntp_ds.supervise.sentinel import become_sentinel, under_foreign_launcher

            if under_foreign_launcher():  # deepspeed, torchrun: a worker's death must not reach them
                stop.uninstall()  # the sentinel passes signals on to its worker
                return become_sentinel(cfg.fault_schedule().repairs())
        if not cfg.dry_run and not os.environ.get(JOIN_ENV):  # a joiner joins the run its directory holds
            prepare_run_dir(cfg, clear=first)
    except BAD_INPUT as e:
        return fail(PROG, e) if first else 2
    if cfg.dry_run:
        if first:
            from ntp_ds.run.dry_run import describe

            print(describe(cfg))
        return 0
    if not under_launcher:
        return launch_local(cfg, argv)
    return run_worker(cfg, started, stop)


if __name__ == "__main__":
    raise SystemExit(main())
