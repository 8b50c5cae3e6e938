"""NTPEngine: a DeepSpeedEngine whose replica may run at a TP degree different from its peers.

Anchor replicas (the most common layout) run DeepSpeed unchanged: its data-parallel reduction, ZeRO partitioning
and optimizer. A contributor replica adds its gradients into its anchor's before the anchor reduces, and copies
the anchor's updated parameters after the anchor steps; it keeps no optimizer state. Every micro-batch's loss is
weighted by its share of the global batch's tokens, so the update is the token-weighted mean over all samples.
A new batch plan (different samples and micro-batches per replica, same topology) is taken at a step boundary
(`set_batch_plan`), without rebuilding the engine.
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch
import torch.distributed as dist
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from ntp_ds.batch import BatchPlan
from ntp_ds.batch.loader import counted_tokens
from ntp_ds.comm import wire
from ntp_ds.comm.exchange import same_layout
from ntp_ds.comm.groups import NTPMpu, ReplicaGroups, ring_neighbours
from ntp_ds.comm.streams import IncomingGradients, IncomingParameters, OutgoingGradients, OutgoingParameters
from ntp_ds.engine import checkpoint, clipping
from ntp_ds.engine import fragments as state
from ntp_ds.engine.copies import StateCopies
from ntp_ds.engine.recut import recut_zero
from ntp_ds.engine.snapshot import Snapshot, lr_state, take_snapshot
from ntp_ds.layout import ParamSpec
from ntp_ds.layout.domains import domain_neighbours

log = logging.getLogger(__name__)


class NTPEngine(DeepSpeedEngine):
    """DeepSpeedEngine API (`engine(batch)`, `backward`, `step`, checkpoints) over a nonuniform topology."""

    def __init__(self, *, ntp_groups: ReplicaGroups, batch_plan: BatchPlan, specs: dict[str, ParamSpec],
                 full_shapes: dict[str, tuple[int, ...]], job, store, resharded: bool = False, **deepspeed_kwargs):
        """`resharded`: built by a recovery or a grow, whose shards are assembled from the job's live units (equal
        on every member of a data-parallel group, and to the anchors' on a contributor, already), so DeepSpeed's
        broadcast of the model and the parameter copy to the contributors are skipped."""
        self.__dict__["_resharded"] = resharded  # (read inside DeepSpeed's construction, before nn.Module's own)
        super().__init__(**deepspeed_kwargs)
        state.link_round_robin(self)
        # The global gradient norm (clipping, and the norm DeepSpeed reports) counts every element of the model once.
        clipping.mark_norm_counting(self.module.named_parameters(), specs, ntp_groups.layout, ntp_groups.tp_rank)
        if isinstance(self.optimizer, DeepSpeedZeroOptimizer):
            clipping.count_once_in_zero_norm(self.optimizer)
        self.ntp_groups, self.batch_plan, self.job, self.store = ntp_groups, batch_plan, job, store
        """`job`: the validated JobSpec this engine was built from; `store`: the coordination store, if any."""
        self.param_specs, self.full_shapes = specs, full_shapes
        self._plan_transfers()
        self._loss_weight = None
        self._step_start_micro = 0
        """`micro_steps` when the current batch plan took effect: micro-batches are counted per step from there."""
        self.sync_wait_s = 0.0
        """Seconds this rank has spent in the gradient exchange between replicas during backward (a running total):
        what a replica's step work is measured without."""
        self.device_waits: list[tuple] | None = None
        """Under CUDA, while a step's work is measured (`ntp_ds.engine.balancer.StepWork` sets a list and takes it at
        the step's end), the (start, end) timing events around each of those waits on the device."""
        self.on_phase = lambda step, phase: None
        """Called at every phase point (forward, backward, grad_sync, optimizer, in_optimizer, refresh): the
        fault-injection seam."""
        self.in_optimizer_step = False
        """Between the ready vote and the commit vote of a step: this rank's state may be partly updated."""
        self.join_notice = False
        """Raised by global rank 0 for the next step only: joiners are planned for the boundary after it. The step's
        commit vote carries it to every rank (`join_announced`), so that no other rank reads the store for joins."""
        self.join_announced = False
        """Some rank raised `join_notice` for the step just committed: its boundary takes joiners in."""
        self._before_step = None
        self._whole_grads_step = None
        """The step whose accumulated gradients this rank holds whole: its reduction found a verdict already in and
        never started (`allreduce_gradients`)."""
        self._grads_proof: list = []
        """The ops of the step still in flight when its whole gradients were found (`wire.outstanding`): they are
        whole only once every one of those is proven to have completed (the step's TP all-reduces, the parameter and
        gradient buckets it received)."""
        self._synced: list = []
        """The exchanges of the last `sync_parameters` (a contributor's weights are theirs only once proven)."""
        self._plan_after_step = None
        """The plan the step under way hands over to at its end (after the rest of an interrupted step: `resume`)."""
        self.kept_grads_step = None
        """The step whose gradients from before a failure this rank carries (its replica kept its finished backward:
        `resume`), until that step ends: a loop that sums its own figures over the step (the loss) keeps those of
        the micro-batches that made them."""
        if not self.is_anchor:
            self.enable_backward_allreduce = False
        elif self.optimizer is not None:  # DeepSpeed steps its optimizer once per parameter group under ZeRO 1/2
            state.inner_optimizer(self).register_step_post_hook(
                lambda *_: self._phase(self.global_steps + 1, "in_optimizer"))
        if not resharded:  # a recovery's or grow's engines all skip it (built so, or rebound): nobody posts it
            self.sync_parameters()
        if self.stream_parameters and self._params.incoming:
            self._add_parameter_hooks()

    def _plan_transfers(self) -> None:
        """What the generation's plan sends between replicas: the contributors' gradients to their anchors, the
        anchors' parameters back, and the redundant copies of the optimizer state."""
        ntp, groups, specs, shapes = self.job.ntp, self.ntp_groups, self.param_specs, self.full_shapes
        plan, rank, topo = groups.plan, groups.rank, groups.topology
        self._grads = same_layout(plan.grad_transfers, rank, topo, specs, shapes, ntp.bucket_size)
        self._params = same_layout(plan.param_transfers, rank, topo, specs, shapes, ntp.bucket_size, forward=True)
        self._outgoing, self._incoming = OutgoingGradients(self._grads), IncomingGradients(self._grads)
        # With two or more anchor replicas every anchor unit has another holder, so the copy to the contributors may
        # travel during their next forward: an anchor lost meanwhile takes nothing that exists nowhere else.
        self.stream_parameters = len(plan.anchors) >= 2 and bool(self._params.outgoing or self._params.incoming)
        self._params_out, self._params_in = OutgoingParameters(self._params), IncomingParameters(self._params)
        self.copies = StateCopies(rank, self.job.buddies(topo, plan), list(specs), on_host=ntp.redundancy_on_host,
                                  chunk=ntp.bucket_size, keep_previous=ntp.redundancy_keep_previous)
        self._step_mark = wire.mark()
        """Where the ops the step under way depends on begin (`wire.mark`): here for a new or rebound engine, then
        before each step's parameter copy to the contributors."""

    def _phase(self, step: int, phase: str) -> None:
        """A phase point: progress for the heartbeat (this rank's own work, even inside DeepSpeed's step), then the
        fault-injection seam."""
        with wire.working():
            self.on_phase(step, phase)

    # -- parameters --------------------------------------------------------------------------------------------
    def _broadcast_model(self):
        """DeepSpeed's copy of data-parallel rank 0's parameters over the group, at construction; not for an engine
        a recovery or a grow builds (`resharded`): it would move a whole shard that every member holds already, and
        a member that keeps its engine (`rebind`) does not construct one to take part."""
        if not self.__dict__.get("_resharded"):
            super()._broadcast_model()

    def named_shards(self) -> dict[str, torch.nn.Parameter]:
        return dict(self.module.named_parameters())

    @property
    def is_anchor(self) -> bool:
        return self.ntp_groups.is_anchor

    @torch.no_grad()
    def sync_parameters(self) -> None:
        """Copy the anchors' parameters onto the contributor replicas, now."""
        self.settle_parameters()
        params = {n: p.data for n, p in self.named_shards().items()}
        self._synced = []
        self._params.run(params, params, op="param_sync", proofs=self._synced)

    def settle_parameters(self) -> None:
        """Complete the parameter copy still in flight to this contributor (streamed during its forward).

        Every engine method that reads parameters calls this; call it before reading a contributor's
        `engine.module` parameters directly between `step()` and the next forward.
        """
        self._params_in.settle()

    def quiesce(self) -> None:
        """Complete every transfer this rank has in flight, both ways: the parameters streamed from the anchors to
        the contributors, and the redundant copies; raise if one failed.

        For a teardown with every peer alive (a grow): under NCCL a send still queued on a communicator when it is
        aborted never runs, and its receiver, whose communicator nobody aborts, waits for ever. (A failure's recovery
        salvages what arrives instead, and every survivor aborts its own communicators.)

        A rank either sends parameters (an anchor) or receives them (a contributor), so the order of the two is free."""
        self.settle_parameters()
        self._params_out.wait()
        self.copies.finish()

    def close(self) -> None:
        """End this rank's part of the job with every peer alive (every rank calls it, after its last step and
        whatever it saves): complete the transfers in flight (`quiesce`), then meet every rank of the generation.

        An anchor's last parameter messages to the contributors may still be queued on its communicators when its
        loop ends, and a process that exits drops them: its contributor, settling its weights, would wait for ever.
        After this no rank leaves while a peer still waits on its messages. The engine stays usable."""
        if self.ntp_groups is None:  # detached: a recovery owns it
            return
        self.quiesce()
        wire.settle_device()  # NCCL: a completed wait only orders the stream; the transfers must be done, not queued
        wire.barrier()

    def _add_parameter_hooks(self) -> None:
        """Before a module first uses its parameters in a forward, complete the buckets that hold them."""
        names = self._params_in.names
        for prefix, module in self.module.named_modules():
            own = [f"{prefix}.{n}" if prefix else n for n, _ in module.named_parameters(recurse=False)]
            own = [n for n in own if n in names]
            if own:
                module.register_forward_pre_hook(lambda _m, _a, own=tuple(own): self._params_in.settle_for(own))

    def watched_peers(self) -> set[int]:
        """The peers whose liveness this rank judges: the global ranks it exchanges data with directly (its TP group,
        sync partners and buddies) but, of its data-parallel group (every anchor replica, thousands at scale), only
        its two ring neighbours. Every member is watched by those two; the death or hang of another member of the
        group reaches this rank as the fence its watchers request (a watcher reports a fence request for any member
        of the generation). A bounded set whatever the replica count. In a topology placed in racks, also the ranks
        of the two replicas next to its own on the ring that interleaves the racks (`layout.domains`): a rack lost
        whole is then seen from outside it."""
        g = self.ntp_groups
        return (set(g.tp_ranks) | ring_neighbours(g.dp_ranks, g.rank) | self._grads.peers() | self._params.peers()
                | self.copies.peers() | domain_neighbours(g.topology, g.rank)) - {g.rank}

    # -- forward / backward / step -----------------------------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        """Run the model; a dict batch (as the loader yields) is unpacked and its loss weight recorded. With
        `full_logits=True` it returns the batch's full-vocabulary logits instead of its loss (see `logits`)."""
        self._phase(self.global_steps + 1, "forward")
        self.copies.advance()  # host copies in flight move on between micro-batches
        if len(inputs) == 1 and isinstance(inputs[0], dict):
            kwargs, inputs = {**inputs[0], **kwargs}, ()
        global_tokens = kwargs.pop("global_tokens", None)
        labels = kwargs.get("labels")  # counted as the caller gave them (the loader's: on the host), not on the device:
        if labels is not None:  # a count read back from the device would hold the host there every micro-batch
            if global_tokens:
                self._loss_weight = counted_tokens(labels) / int(global_tokens)
            else:
                self._loss_weight = labels.shape[0] / self.batch_plan.global_samples
        kwargs = {k: v.to(self.device) if torch.is_tensor(v) else v for k, v in kwargs.items()}
        if kwargs.get("full_logits"):
            kwargs.pop("labels", None)  # they weight the caller's loss; the caller computes it
        return super().forward(*inputs, **kwargs)

    def logits(self, batch: dict) -> torch.Tensor:
        """The full-vocabulary logits [batch, seq, vocab] of a micro-batch, for a loss function of the caller's own.

        `batch` is one that `micro_batches` yields: its `labels` (and `global_tokens`) weight the loss handed to the
        next `backward` exactly as they weight `engine(batch)`'s, so a per-token mean over the tokens the built-in
        loss counts (labels shifted by one, -100 skipped) trains the same model. The logits are gathered over the TP
        group, so every rank holds all of them (an unsharded model's activation memory for this tensor); each rank's
        gradient flows back to its own vocabulary rows."""
        return self.forward(batch, full_logits=True)

    def set_batch_plan(self, plan: BatchPlan) -> None:
        """Run the next steps with `plan` (same replicas; e.g. a straggler-aware re-plan); call at a step boundary on
        every rank. Under ZeRO 2 the anchors must share one micro-batch count in it
        (`ntp_ds.batch.lockstep_replicas`)."""
        if (self.micro_steps - self._step_start_micro) % self._micro_count() or self._loss_weight is not None:
            raise RuntimeError("set_batch_plan must be called between steps, not inside one")
        if len(plan.replicas) != len(self.batch_plan.replicas):
            raise ValueError(f"the plan has {len(plan.replicas)} replicas, the topology "
                             f"{len(self.batch_plan.replicas)}")
        self.batch_plan, self._step_start_micro = plan, self.micro_steps
        self._configure_batch(plan)

    def _configure_batch(self, plan: BatchPlan) -> None:
        """DeepSpeed's batch fields for this replica's share of `plan`."""
        micro_sizes = plan.replicas[self.ntp_groups.replica].micro_sizes
        batch = deepspeed_batch(micro_sizes, len(self.ntp_groups.dp_ranks), self.is_anchor)
        self._config.train_micro_batch_size_per_gpu = batch["train_micro_batch_size_per_gpu"]
        self._config.gradient_accumulation_steps = batch["gradient_accumulation_steps"]
        # No train_batch_size here: `train_batch_size()` reads the plan's global batch.
        if hasattr(self.optimizer, "gradient_accumulation_steps"):
            self.optimizer.gradient_accumulation_steps = batch["gradient_accumulation_steps"]

    def train_batch_size(self) -> int:
        """The current plan's global batch: what DeepSpeed adds to `global_samples` at each step. Its own value (micro
        x accumulation x DP size of this rank's replica) is the global batch only while every replica runs the same
        share."""
        plan = self.__dict__.get("batch_plan")  # None while DeepSpeed builds
        return plan.global_samples if plan is not None else super().train_batch_size()

    def _micro_count(self) -> int:
        return self.batch_plan.replicas[self.ntp_groups.replica].micro_steps

    def allreduce_gradients(self, *args, **kwargs):
        """DeepSpeed's reduction over the anchors, timed into `sync_wait_s`. When a peer's failure is already known it
        does not start: it would fail, and would have changed the gradients first (ZeRO scales them in place). Where
        nothing else has touched them since the backward, the step's gradients are then whole, and a recovery that
        keeps this replica may keep them (`resume`)."""
        if self.is_gradient_accumulation_boundary():  # (DeepSpeed calls this after every micro-batch's backward)
            if self._grads_held_back():
                self._whole_grads_step = self.global_steps + 1
                self._grads_proof = wire.outstanding(since=self._step_mark)
            wire.check_verdict(self.data_parallel_group, "the gradient reduction")
            self._whole_grads_step = None
        with self._waiting_on_replicas(), wire.waiting():
            return super().allreduce_gradients(*args, **kwargs)

    @contextlib.contextmanager
    def _waiting_on_replicas(self):
        """A wait on other replicas' gradients: its host time goes into `sync_wait_s` and, under CUDA, its span on
        the device into `device_waits` (the measured work leaves both out)."""
        start, first = time.perf_counter(), wire.timed_event()
        try:
            yield
        finally:
            self.sync_wait_s += time.perf_counter() - start
            if first is not None and self.device_waits is not None:
                self.device_waits.append((first, wire.timed_event()))

    def backward(self, loss, retain_graph=False, scale_wrt_gas=True):
        """Back-propagate the micro-batch's mean loss, weighted by its share of the global batch."""
        if self._loss_weight is None:
            raise RuntimeError("call engine(batch) with labels before engine.backward(loss)")
        self._phase(self.global_steps + 1, "backward")
        # DeepSpeed averages over the anchors' data-parallel group; the weights already sum to one over the step.
        scaled = loss * (self._loss_weight * len(self.ntp_groups.plan.anchors))
        self._loss_weight = None
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            self._phase(self.global_steps + 1, "grad_sync")
        if not self.is_anchor:
            hooks = self._outgoing.arm(self.named_shards()) if boundary and self._grads.outgoing else []
            try:
                self._contributor_backward(scaled, retain_graph)
            finally:
                for h in hooks:
                    h.remove()
            if hooks:
                with self._waiting_on_replicas():
                    self._outgoing.flush()
            return loss
        # The contributors' buckets are added as this backward produces each gradient: receives are posted now,
        # nothing waits for a contributor before the backward starts.
        hooks = self._incoming.arm(self.named_shards()) if boundary and self._grads.incoming else []
        # ZeRO 2 reduces inside the backward, in DeepSpeed's own collectives: a rank blocked there is waiting.
        reduces = self.zero_optimization_stage() == 2
        try:
            with wire.waiting() if reduces else contextlib.nullcontext():
                super().backward(scaled, retain_graph=retain_graph, scale_wrt_gas=False)
        finally:
            for h in hooks:
                h.remove()
        if hooks:
            with self._waiting_on_replicas():
                self._incoming.finish()
        return loss

    def _grads_held_back(self) -> bool:
        """Whether this anchor's accumulated gradients are all in its parameters' `.grad`, untouched by any reduction
        until DeepSpeed's boundary one: ZeRO 1 without overlap or gradient-accumulation attributes, and no
        contributor whose gradients were added in this backward."""
        zero = self.optimizer
        return (isinstance(zero, DeepSpeedZeroOptimizer) and not zero.partition_gradients and not zero.overlap_comm
                and not zero.use_grad_accum_attribute and not self._grads.incoming)

    def is_gradient_accumulation_boundary(self) -> bool:
        """The last micro-batch of this replica's share of the step, counted from when the plan took effect."""
        if "_step_start_micro" not in self.__dict__ or (self.is_anchor and (
                self._is_gradient_accumulation_boundary is not None or self.zenflow
                or not self.managed_gradient_accumulation())):
            return super().is_gradient_accumulation_boundary()  # while DeepSpeed builds, and its modes NTP never sets
        return (self.micro_steps - self._step_start_micro + 1) % self._micro_count() == 0

    def _contributor_backward(self, scaled, retain_graph: bool) -> None:
        """Plain autograd under DeepSpeed's engine-backward flag: a contributor has no optimizer and reduces nothing."""
        with self._running_engine_backward_lock:
            self._running_engine_backward_count += 1
            self._running_engine_backward = True
        try:
            scaled.backward(retain_graph=retain_graph)
        finally:
            with self._running_engine_backward_lock:
                self._running_engine_backward_count -= 1
                self._running_engine_backward = self._running_engine_backward_count > 0

    def step(self, lr_kwargs=None):
        """DeepSpeed's step between two votes over the gloo control group (synchronous on every backend: an NCCL
        all-reduce would only be enqueued). The ready vote: a failure before it leaves every rank's state as the
        last step left it. The commit vote: every rank has applied this step, so the redundant copies of the last
        one may be overwritten; a failure between the two votes leaves the step half applied, and recovery rolls
        it back from those copies (`Snapshot.mid_step`)."""
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            self._phase(self.global_steps + 1, "optimizer")
            if not self.is_anchor:
                self._outgoing.wait()  # every bucket has reached its anchor before anyone steps
            # A contributor's parameters no module used in this step's forward; with redundancy_overlap, the previous
            # step's copies, which travelled meanwhile.
            self.quiesce()
            self._before_step = (self.global_steps, self.global_samples, lr_state(self),
                                 state.optimizer_step(self) if self.is_anchor else 0)
            wire.vote(True, name="ready_vote")
            self.in_optimizer_step = True
        if self.is_anchor:
            with wire.waiting():  # DeepSpeed's step communicates (ZeRO's all-gather, its norms and overflow checks)
                super().step(lr_kwargs)
        elif boundary:
            for p in self.module.parameters():
                p.grad = None
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
        if boundary:
            # Every rank's device must have finished the step (ZeRO's all-gather included) before the commit: on
            # NCCL the host passes a collective once it is queued, and a death before it completes would leave a
            # half-applied step that recovery takes for committed.
            wire.settle_device()
            _, self.join_announced = wire.vote_with_notice(True, self.join_notice, name="commit_vote")
            self.join_notice = False
            self.in_optimizer_step = False
            self.refresh_copies()  # before the parameters: an anchor's messages to a contributor go in this order
            self._step_mark = wire.mark()  # what the next step's gradients may depend on is posted from here on
            self._copy_parameters()
        if not self.is_anchor:
            self.micro_steps += 1
        if boundary:
            self.kept_grads_step = None
        if boundary and self._plan_after_step is not None:
            plan, self._plan_after_step = self._plan_after_step, None
            self.set_batch_plan(plan)

    def clip_fp32_gradients(self):
        """Stage 0 in fp32: clip by the norm of the whole model, every element counted once (`engine.clipping`)."""
        self._global_grad_norm = clipping.clip_by_counted_norm(self.module.parameters(), self.gradient_clipping(),
                                                               self.ntp_groups.tp_group, self.ntp_groups.tp_rank)

    def _copy_parameters(self) -> None:
        """The anchors' updated parameters to the contributors: streamed into the next forward, or now."""
        if self.stream_parameters:
            params = {n: p.data for n, p in self.named_shards().items()}
            if self.is_anchor:
                self._params_out.post(params)
            else:
                self._params_in.post(params)
        elif self._params.outgoing or self._params.incoming:
            self.sync_parameters()

    # -- redundancy and recovery -------------------------------------------------------------------------------
    def optimizer_keys(self) -> tuple[str, ...]:
        return state.state_keys(self) if self.is_anchor else ()

    def refresh_copies(self, overlap: bool | None = None) -> None:
        """Send this rank's optimizer state to its buddies and take in the copies it keeps for others.

        By default the exchange completes here, so every completed step is recoverable. With `overlap` (default:
        `redundancy_overlap`) it travels during the next step and is adopted before that step's optimizer runs (or
        at a failure, which then finds the copies in flight incomplete).
        """
        if not (self.copies.targets or self.copies.owners):
            return
        keys = self.optimizer_keys()
        sources = state.flat_sources(self, keys) if self.is_anchor else None
        self._phase(self.global_steps, "refresh")  # as the copies of the step just applied set off
        self.copies.start(keys, state.optimizer_step(self) if self.is_anchor else 0, wire.device_of(), sources)
        overlap = self.job.ntp.redundancy_overlap if overlap is None else overlap
        # Host copies travel round by round, each round posted as the one two before it lands: on a lane of their
        # own only (on the data lane their rounds would interleave with the step's exchanges in another order on
        # each rank).
        if not overlap or (self.copies.on_host and not wire.has_copy_lane()):
            self.copies.finish()

    def release(self) -> None:
        """Drop every reference this engine holds (model, optimizer, process groups).

        Gloo closes a group's connections only when nothing references it; once closed, a live peer still waiting on
        this rank in a collective fails at once instead of at its timeout. The engine is unusable afterwards.
        """
        # DeepSpeed links each parameter to its optimizer partition with attributes (bound methods of the parameter
        # itself, its data-parallel group): a reference cycle per parameter that only a full garbage collection
        # would break, keeping the groups open until then.
        for p in self.module.parameters():
            p.__dict__.clear()
        if not dist.is_initialized() and hasattr(self.optimizer, "print_rank_0"):
            # The communicators were aborted (torch then keeps no default group) and ZeRO's destroy logs through
            # dist.get_rank(), which would raise before the hooks and buffers are let go.
            self.optimizer.print_rank_0 = lambda *args, **kwargs: None
        self.destroy()
        self.__dict__.clear()

    def detach(self) -> None:
        """Let go of the generation's process groups but keep every tensor, as a failure's recovery starts: the
        teardown can then close those groups (gloo closes one only once nothing references it, and a live peer still
        waiting on this rank in it fails at once). The recovery either moves the engine onto the next generation's
        groups (`rebind`) or releases it. The step under way is dropped: its gradients, DeepSpeed's reduction
        bookkeeping of it and the loss weight of a forward not yet back-propagated (the step is run again). An engine
        detached already (and not rebound since) is left as it is."""
        if self.ntp_groups is None:
            return
        self._drop_step(keep_grads=self._whole_grads_step == self.global_steps + 1)
        self.module.set_tp_group(None)
        self.mpu = self.data_parallel_group = self.seq_data_parallel_group = None
        zero = self.optimizer
        if isinstance(zero, DeepSpeedZeroOptimizer):
            zero.mpu = zero.model_parallel_group = zero.dp_process_group = None
            zero.real_dp_process_group[:] = [None] * len(zero.real_dp_process_group)
        for p in self.module.parameters():
            p.__dict__.pop("_dp_group", None)
        # The transfers of the generation's plan, with whatever they still had in flight (the snapshot kept what
        # arrived): `rebind` plans the next generation's.
        self.ntp_groups = self.copies = self._grads = self._params = None
        self._outgoing = self._incoming = self._params_out = self._params_in = None
        self._synced, self._grads_proof = [], []  # (they name the generation's groups)

    def _drop_step(self, keep_grads: bool = False) -> None:
        """Forget the step under way, as DeepSpeed leaves nothing of a step once it is applied; `keep_grads`: but for
        its whole gradients (`take_grads`)."""
        self._loss_weight = None
        self.in_optimizer_step = False
        self._whole_grads_step = self._plan_after_step = self.kept_grads_step = None
        self._grads_proof = []
        zero = self.optimizer
        if isinstance(zero, DeepSpeedZeroOptimizer):
            if not keep_grads:
                zero.zero_grad(set_to_none=True)
            for bucket in zero.ipg_buckets.values():
                bucket.clear()
                bucket.index = 0
            zero._release_ipg_buffers()
            zero.params_already_reduced[:] = [False] * len(zero.params_already_reduced)
            zero.previous_reduced_grads.clear()
            zero.extra_large_param_to_reduce.clear()
            zero.averaged_gradients, zero.all_grad_tensors, zero._muon_pending_momentum = {}, {}, {}
            zero.clear_backward_seen_flag()
        if not keep_grads:
            for p in self.module.parameters():
                p.grad = None

    def rebind(self, groups: ReplicaGroups, batch_plan: BatchPlan) -> None:
        """Carry a detached anchor's engine into the next generation: it keeps its replica's layout and its place in
        it, and `groups` are the new generation's. Its shard, optimizer and DeepSpeed's engine stay; the ZeRO
        partitions are cut again for the new data-parallel group (`recut.recut_zero`: new fp32 partitions with
        zeroed state, which the recovery then fills), and what follows from the plan is made anew: the batch, the
        transfers to and from contributors, the redundant copies. Like an engine a recovery builds, it makes no
        parameter copy to the contributors: their shards were assembled from live units, equal to the anchors'."""
        replica, tp_rank = groups.topology.locate(groups.rank)
        if not groups.plan.is_anchor(replica) or groups.layout != self.module.layout or tp_rank != self.module.tp_rank:
            raise ValueError(f"rank {groups.rank}: only an anchor keeping its layout and TP index is rebound")
        self.module.set_tp_group(groups.tp_group)
        recut_zero(self, NTPMpu(groups))  # (DeepSpeed's relink gives every parameter its data-parallel group again)
        self.ntp_groups, self.batch_plan, self._step_start_micro = groups, batch_plan, self.micro_steps
        self._configure_batch(batch_plan)
        self._plan_transfers()
        self._before_step = None

    def take_grads(self) -> dict[str, torch.Tensor]:
        """Detach the gradients kept through a `detach` from the parameters (a re-cut needs none) and return them by
        name; empty when the interrupted step's gradients were not whole."""
        grads = {n: p.grad for n, p in self.module.named_parameters() if p.grad is not None}
        for p in self.module.parameters():
            p.grad = None
        self._whole_grads_step = None
        return grads

    def resume(self, plan: BatchPlan, grads: dict[str, torch.Tensor], scale: float) -> None:
        """Run the rest of an interrupted step (`plan`, whose `kept` samples this replica's gradients hold, from
        `take_grads`) and then the generation's own plan. `scale`: the new anchors' count over the old, by which the
        gradients' loss weighting changes (each micro-batch's loss is scaled by the count of anchors that average
        it)."""
        after = self.batch_plan
        self.set_batch_plan(plan)
        self._plan_after_step = after
        self.kept_grads_step = self.global_steps + 1 if grads else None
        params = dict(self.module.named_parameters())
        with torch.no_grad():
            for name, grad in grads.items():
                params[name].grad = grad.mul_(scale) if scale != 1.0 else grad

    def snapshot(self) -> Snapshot:
        """Everything a survivor carries into recovery (views of live tensors: keep this engine until done)."""
        return take_snapshot(self)

    # -- DeepSpeed checkpoints and consolidated weights (`engine.checkpoint`) --------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True, exclude_frozen_parameters=False):
        """DeepSpeed's checkpoint, written by the anchors; a contributor's state is a copy of its anchor's."""
        return checkpoint.save(self, lambda tag: super(NTPEngine, self).save_checkpoint(
            save_dir, tag, client_state, save_latest, exclude_frozen_parameters), save_dir, tag)

    def _checkpoint_tag_validation(self, tag) -> None:
        """DeepSpeed's check that every rank saves under the same tag, along the control tree."""
        checkpoint.check_tag(self, tag)

    def load_checkpoint(self, load_dir, tag=None, **kwargs):
        """Load a checkpoint written by the same topology; contributors then copy their anchors' parameters."""
        return checkpoint.load(self, lambda tag: super(NTPEngine, self).load_checkpoint(load_dir, tag, **kwargs),
                               load_dir, tag)

    def consolidated_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Unsharded weights on TP rank 0 of the first anchor replica (None elsewhere): for tests and small
        models (`checkpoint.consolidated_state_dict`)."""
        return checkpoint.consolidated_state_dict(self)

    def save_pretrained(self, path) -> None:
        """Write the weights as a sharded HF directory, which `from_pretrained` loads (`checkpoint.save_pretrained`).
        Every rank calls it."""
        checkpoint.save_pretrained(self, path)


def deepspeed_batch(micro_sizes: tuple[int, ...], dp_size: int, anchor: bool) -> dict:
    """The batch fields of a replica's DeepSpeed config for its micro-batches: an anchor accumulates over them; a
    contributor accumulates on its own (`NTPEngine.is_gradient_accumulation_boundary`), so DeepSpeed must not scale
    its gradients by an accumulation count."""
    if not anchor:
        return {"train_micro_batch_size_per_gpu": max(micro_sizes), "gradient_accumulation_steps": 1,
                "train_batch_size": max(micro_sizes)}
    return {"train_micro_batch_size_per_gpu": max(micro_sizes), "gradient_accumulation_steps": len(micro_sizes),
            "train_batch_size": max(micro_sizes) * len(micro_sizes) * dp_size}
