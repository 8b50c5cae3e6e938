"""Shared pieces of the training tests: a tiny model, configs, an NTP run per rank and the single-process reference."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ntp_ds.batch.loader import GlobalBatchSampler, SyntheticTokens, replica_micro_batches
from ntp_ds.models import Llama, LlamaConfig

SEQ = 16


def tiny_config(**overrides) -> LlamaConfig:
    base = dict(vocab_size=96, hidden_size=48, intermediate_size=72, num_hidden_layers=2, num_attention_heads=6,
                num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)
    base.update(overrides)
    return LlamaConfig(**base)


def full_model(config: LlamaConfig, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(config)


def optimizer_config(name: str) -> dict:
    if name == "sgd":
        return {"type": "SGD", "params": {"lr": 0.5}}
    return {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}}


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.5)
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def deepspeed_config(optim: str, stage: int, global_batch: int, micro: int, bf16: bool = False,
                     zero: dict | None = None, clip: float = 0.0) -> dict:
    """`zero`: more `zero_optimization` settings (e.g. round_robin_gradients); `clip`: DeepSpeed's
    gradient_clipping (0: none)."""
    return {"train_batch_size": global_batch, "train_micro_batch_size_per_gpu": micro,
            "optimizer": optimizer_config(optim), "zero_optimization": {"stage": stage, **(zero or {})},
            "bf16": {"enabled": bf16}, "steps_per_print": 10**9, "wall_clock_breakdown": False,
            "zero_allow_untested_optimizer": True, "gradient_clipping": clip}


def dataset(config: LlamaConfig) -> SyntheticTokens:
    """Uniform random tokens: SGD at lr 0.5 on a learnable language leaves the stable regime within these tests'
    steps, where float rounding differences between layouts grow without bound."""
    return SyntheticTokens(config.vocab_size, SEQ, size=256, seed=3, branching=0)


def tiny_qwen2(seed: int = 0):
    """A seeded transformers Qwen2 causal LM (8 query heads on 2 KV heads, q/k/v biases), biases drawn too."""
    import transformers

    config = transformers.Qwen2Config(vocab_size=96, hidden_size=64, intermediate_size=80, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.02)
    return model


def host_shards(module) -> dict:
    """The module's parameters as fp32 host copies: the single-process reference they are compared with trains on
    the CPU, wherever the ranks ran (NTP_TEST_DEVICE=cuda puts them on GPUs)."""
    return {n: p.detach().to("cpu", torch.float32, copy=True) for n, p in module.named_parameters()}


def train_ntp(rank, world_size, ntp: dict, optim: str, stage: int, global_batch: int, micro: int, steps: int,
              model_overrides: dict | None = None, make_model=None, save_dir: str | None = None, clip: float = 0.0,
              late_rank: int | None = None):
    """One rank of an NTP run; returns its local shards and, on the consolidating rank, the full weights.

    `make_model`: a function building the unsharded model (default: the own Llama of `tiny_config`); `save_dir`:
    where the engine writes the final weights with `save_pretrained`; `clip`: DeepSpeed's gradient_clipping;
    `late_rank`: a rank that ends 2 s after its last step (a contributor slow to take in its last parameters)."""
    import ntp_ds

    model = make_model() if make_model else full_model(tiny_config(**(model_overrides or {})))
    config = model.config
    engine = ntp_ds.initialize(model=model, config=deepspeed_config(optim, stage, global_batch, micro, clip=clip),
                               ntp=ntp)
    data, sampler = dataset(config), GlobalBatchSampler(256, seed=1)
    replica = engine.ntp_groups.replica
    losses = []
    for step in range(steps):
        for batch in replica_micro_batches(data, sampler, engine.batch_plan, replica, step):
            loss = engine(batch)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
    if rank == late_rank:
        time.sleep(2.0)
    engine.close()  # the anchors' last parameter messages arrive before anyone leaves
    shards = host_shards(engine.module)
    full = engine.consolidated_state_dict()
    if save_dir:
        engine.save_pretrained(save_dir)
    return {"replica": replica, "tp_rank": engine.ntp_groups.tp_rank, "layout": engine.ntp_groups.layout,
            "shards": shards, "full": full, "global_samples": engine.batch_plan.global_samples,
            "global_steps": engine.global_steps, "samples_seen": engine.global_samples}


def train_reference(optim: str, global_samples: int, steps: int, model_overrides: dict | None = None,
                    make_model=None, clip: float = 0.0, norms: list | None = None):
    """A single process training the unsharded model on the union of every replica's samples; with `clip`, its
    gradients clipped to that global norm (torch's clip_grad_norm_), each step's norm before clipping appended to
    `norms`."""
    model = make_model() if make_model else full_model(tiny_config(**(model_overrides or {})))
    config = model.config
    opt = make_optimizer(optim, model.parameters())
    data, sampler = dataset(config), GlobalBatchSampler(256, seed=1)
    for step in range(steps):
        items = [data[i] for i in sampler.indices(step, global_samples)]
        batch = {k: torch.stack([it[k] for it in items]) for k in items[0]}
        opt.zero_grad()
        loss = model(batch["input_ids"], labels=batch["labels"])
        (loss if torch.is_tensor(loss) else loss.loss).backward()
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            if norms is not None:
                norms.append(float(norm))
        opt.step()
    return model


def assert_equivalent(results, global_batch: int, steps: int, make_model=None) -> None:
    """Every surviving rank ended at `steps`, and its shards and the consolidated weights equal the single-process
    reference trained on the same samples (AdamW, max abs difference at most 1e-4)."""
    from ntp_ds.engine.initialize import model_config_of
    from ntp_ds.layout.sharding import shard_tensor
    from ntp_ds.models import empty_shard

    reference = train_reference("adamw", global_batch, steps, make_model=make_model)
    ref = dict(reference.named_parameters())
    specs = empty_shard(model_config_of(reference), device="meta").param_specs()
    assert results, "no rank finished"
    for rank, res in results.items():
        assert res["global_steps"] == steps, f"rank {rank} ended at step {res['global_steps']}"
        for name, shard in res["shards"].items():
            want = shard_tensor(ref[name].detach(), specs[name][0], res["layout"], res["tp_rank"])
            diff = (shard - want).abs().max().item()
            assert diff <= 1e-4, f"rank {rank} {name}: max abs difference {diff:.3g} > 1e-4"
    full = next(r["full"] for r in results.values() if r["full"] is not None)
    for name, tensor in full.items():
        assert (tensor - ref[name].detach()).abs().max().item() <= 1e-4, f"consolidated {name}"

def train_with_checkpoint(rank, world_size, ntp: dict, stage: int, steps: int, ckpt_dir: str, resume: bool):
    """Train `steps` steps, saving a checkpoint at the end; with `resume`, load it first and go on."""
    import ntp_ds

    config = tiny_config()
    engine = ntp_ds.initialize(model=full_model(config, seed=7 if resume else 0),
                               config=deepspeed_config("adamw", stage, 12, 2), ntp=ntp)
    if resume:
        engine.load_checkpoint(ckpt_dir)
    data, sampler = dataset(config), GlobalBatchSampler(256, seed=1)
    first = engine.global_steps
    for step in range(first, first + steps):
        for batch in replica_micro_batches(data, sampler, engine.batch_plan, engine.ntp_groups.replica, step):
            engine.backward(engine(batch))
            engine.step()
    if not resume:
        engine.save_checkpoint(ckpt_dir)
        engine.save_pretrained(f"{ckpt_dir}/hf")
    engine.close()
    return {"shards": host_shards(engine.module),
            "global_steps": engine.global_steps, "layout": engine.ntp_groups.layout,
            "tp_rank": engine.ntp_groups.tp_rank}


@dataclass(frozen=True)
class Scenario:
    """One run of `train_with_recovery`, the same for every rank: the job, the faults injected, the bounds."""

    ntp: dict
    """NTP settings: `tp`, `replicas`, `min_tp`, `degrees`, `bucket_size`, the redundancy settings, ..."""
    stage: int = 1
    """ZeRO stage."""
    faults: tuple = ()
    """Faults injected, `{rank, step, phase, kind}` each (`tests.helpers.recovery.fault`)."""
    steps: int = 5
    optim: str = "adamw"
    global_batch: int = 12
    micro: int = 2
    heartbeat_timeout_s: float = 2.0
    zero_redundancy: int = 1
    last_good_dir: str | None = None
    timeout_s: float = 12.0
    """The job's bound on every wait for a peer (`ntp.timeout_s`)."""
    joins: dict | None = None
    """Launch rank of each joiner -> the step from which it asks to train."""
    joiner_overrides: dict | None = None
    """Launch rank of a joiner -> DeepSpeed config entries it changes (a joiner of another job)."""
    make_model: Callable | None = None
    """Builds the unsharded model (default: the tiny Llama)."""
    zero: dict | None = None
    """More `zero_optimization` settings."""
    hang_timeout_s: float | None = None
    """Declare a peer that beats without training progress hung after this long (None: never)."""
    bf16: bool = False
    """Train in bf16 (DeepSpeed's bf16 with fp32 masters)."""
    reduce_after_verdict: int | None = None
    """A step whose last backward (and so its gradient reduction) every rank that reaches it begins only once a
    peer's failure is declared (bounded): a replica's backward that outlasts the detection."""


def train_with_recovery(rank, world_size, scenario: Scenario) -> dict:
    """One rank of a run with injected faults and live recovery, on the public handle (as `ntp-ds train` starts
    it); returns its final state and recovery events.

    A joiner (`run_ranks(..., joiners=N)`: NTP_JOIN set) asks the running job for a place from step
    `scenario.joins[rank]` on and trains from where it is admitted; members take joiners in at step boundaries. A
    refused joiner returns {"refused": reason}.
    """
    import traceback

    from ntp_ds.comm import wire
    from ntp_ds.comm.failures import DeviceError
    from ntp_ds.control.faults import FaultSchedule, fired_key
    from ntp_ds.control.joins import JoinFailed, JoinRefused
    from ntp_ds.control.store import connect_from_env
    from ntp_ds.engine.config import NTPConfig
    from ntp_ds.envs import JOIN_ENV, JOIN_STEP_ENV
    from ntp_ds.fault_tolerant import start
    from ntp_ds.recovery.errors import RecoveryImpossible

    s = scenario
    joins, timeout_s = s.joins or {}, s.timeout_s
    model = s.make_model() if s.make_model else full_model(tiny_config())
    config = model.config
    ds = deepspeed_config(s.optim, s.stage, s.global_batch, s.micro, bf16=s.bf16, zero=s.zero)
    ntp = NTPConfig.from_any(dict(s.ntp, timeout_s=timeout_s, zero_redundancy=s.zero_redundancy, fault_tolerance={
        "heartbeat_timeout_s": s.heartbeat_timeout_s, "hang_timeout_s": s.hang_timeout_s,
        "last_good_dir": s.last_good_dir, "join_timeout_s": 120.0}))
    schedule = FaultSchedule.from_config(list(s.faults), world_size + len(joins))  # joiners may fail too
    joining = bool(os.environ.get(JOIN_ENV))
    if joining:
        os.environ[JOIN_STEP_ENV] = str(joins.get(rank, 0))
        ds = {**ds, **(s.joiner_overrides or {}).get(rank, {})}
    store = connect_from_env(timeout_s)
    try:  # the public handle, as `ntp-ds train` starts it
        handle = start(model, ds, ntp, store, schedule, stop_on_signals=False)
    except (JoinRefused, JoinFailed) as refused:
        return {"refused": str(refused)}
    check = handle.injector.check

    def on_phase(step: int, phase: str) -> None:
        if phase == "grad_sync" and step == s.reduce_after_verdict:
            wire.verdict(timeout_s)
        check(step, phase)

    handle.injector.check = handle.engine.on_phase = handle.recovery.on_phase = on_phase
    if joins and not joining:
        _await_join_requests(store, len(joins))
    data, sampler = dataset(config), GlobalBatchSampler(256, seed=1)
    noticed, recovered, kept_grads = [], [], []
    try:
        for _ in handle.train_steps(s.steps):
            try:
                for batch in replica_micro_batches(data, sampler, handle.batch_plan, handle.ntp_groups.replica,
                                                   handle.global_steps):
                    handle.backward(handle(batch))
                    handle.step()
            except RecoveryImpossible:
                raise
            except Exception as error:
                if not (wire.is_wire_failure(error) or isinstance(error, DeviceError)):
                    # This rank's own error ends it at once, as an uncaught error ends `ntp-ds train`; its peers
                    # recover without it.
                    traceback.print_exc()
                    os._exit(1)
                noticed.append(time.time())
                handle.recover(error)  # a device error of its own: this rank leaves (QuiescedExit)
                recovered.append(time.time())
                kept_grads.append(handle.engine.kept_grads_step)
    except RecoveryImpossible as stop:
        handle.recovery.close(finished=True)
        return {"stopped": str(stop), "events": handle.recovery.events}
    engine = handle.engine
    full = engine.consolidated_state_dict()
    fired = {r: json.loads(store.get(fired_key(r)))["wall"] for r in range(world_size) if store.check([fired_key(r)])}
    result = {"replica": engine.ntp_groups.replica, "tp_rank": engine.ntp_groups.tp_rank,
              "layout": engine.ntp_groups.layout, "shards": host_shards(engine.module),
              "full": full, "events": handle.recovery.events, "global_steps": engine.global_steps,
              "degrees": engine.ntp_groups.topology.degrees, "noticed": noticed, "recovered": recovered,
              "fired": fired, "kept_grads_steps": kept_grads, "failed_attempts": handle.recovery.failed_attempts,
              "communicators": communicators_created()}
    handle.close()  # beat until every rank is done: a silent rank would be declared dead by a busy peer
    return result


def communicators_created() -> list[int] | None:
    """Under nccl_model, the size of every communicator this process created (None on other backends)."""
    if os.environ.get("NTP_TEST_BACKEND") != "nccl_model":
        return None
    from ntp_ds.testing.nccl_model import communicator_sizes

    return communicator_sizes()


def _await_join_requests(store, n: int, timeout_s: float = 90.0) -> None:
    """Hold the members until the test's `n` joiners have asked (bounded), so that when a joiner is taken in
    depends on the steps it asked for, not on how fast its process started."""
    from ntp_ds.control.joins import JoinRequests

    requests, deadline = JoinRequests(store), time.monotonic() + timeout_s
    while len(requests.read()) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {len(requests.read())} of {n} joiners asked within {timeout_s:g} s")
        time.sleep(0.05)


def hf_weights(directory) -> dict:
    """Every tensor of an HF directory (one safetensors file or several), by name."""
    from safetensors.torch import load_file

    tensors = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        tensors.update(load_file(f))
    assert tensors, f"no weights in {directory}"
    return tensors


def final_weights(run_dir) -> dict:
    """The weights a run of `ntp-ds train` wrote to RUN_DIR/final (HF safetensors), by name."""
    return hf_weights(run_dir / "final")


def assert_same_final_weights(run_dir, reference_dir, atol: float = 1e-5) -> None:
    """Every tensor of RUN_DIR/final within `atol` of the reference run's, and the same names."""
    want, got = final_weights(reference_dir), final_weights(run_dir)
    assert set(got) == set(want)
    for name, tensor in want.items():
        diff = (got[name] - tensor).abs().max().item()
        assert diff <= atol, f"{name}: max abs difference {diff:.3g}"


def wait_for_lines(log_path, lines: list[str], procs, deadline: float) -> None:
    """Until every line of `lines` is in the log at `log_path`, a process of `procs` ends, or `deadline`
    (monotonic); fail unless every line is there."""
    def found() -> bool:
        text = log_path.read_text() if log_path.exists() else ""
        return all(x in text for x in lines)

    while not found() and time.monotonic() < deadline and all(p.poll() is None for p in procs):
        time.sleep(0.1)
    assert found(), (log_path.read_text() if log_path.exists() else f"no {log_path}")[-4000:]
