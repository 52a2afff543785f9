"""ScapeState: SCAPE's per-rank state (configuration, layout, residual and window buffers, counters)."""

from __future__ import annotations

import logging
import math
import os
import warnings
import weakref
from typing import Any, Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn

from scape_core import checkpoint, exchange, inflight, join
from scape_core.buckets import Buckets, StepRecord
from scape_core.buffers import Buffers
from scape_core.communicator import Communicator
from scape_core.config import OUT_OF_REACH, ScapeConfig, check_max_steps, unread_environment
from scape_core.diagnose import DDPWatch
from scape_core.kernels import Kernels
from scape_core.layout import FlatLayout, Shard
from scape_core.masks import Mask
from scape_core.model import check_ddp_model, parameter_names
from scape_core.replicas import ReplicaGuard, Replicated
from scape_core.schedule import MaskSchedule
from scape_core.selection import MaskSelector
from scape_core.sharding import ShardExchange
from scape_core.step_times import StepTimes, summary_line
from scape_core.streak import STREAK_CHECK_EVERY, SkipStreak

SINGLE_PROCESS = ("SCAPE: world size 1, nothing to communicate: SCAPE is inactive as a saving (stats() reports 0 "
                  "bytes sent, compression 1.0), but its sparse steps still update only each step's mask, which "
                  "is not AdamS. For a one-process run train with scape_core.AdamS (or sparsity=0), as "
                  "accelerate_scape.ScapePlugin does")


PADDED_LAYOUT = 2.0  # the start of a run warns when the flat layout is this many times the parameters...
PADDED_VALUES = 2**20  # ...and its padding this many values (4 MiB a buffer) or more
# what adapters log
LOGGED = ("bytes_sent", "dense_bytes", "compression", "step_compression", "skipped_steps", "skipped_streak",
          "step_seconds_dense", "step_seconds_sparse")
log = logging.getLogger("scape_core")  # the start-of-run line (ScapeStateBase.announce)
log.setLevel(logging.INFO)
if not logging.getLogger().hasHandlers():  # as Lightning's logger: shown (stderr) without any logging setup
    log.addHandler(logging.StreamHandler())
    log.propagate = False


def all_true(verdicts: list[Tensor], device: torch.device) -> Tensor:
    """Whether every 0-dim bool of ``verdicts`` is true (a 0-dim bool on the device; true for none).

    Example:
        >>> all_true([torch.tensor(True), torch.tensor(False)], torch.device("cpu"))
        tensor(False)
    """
    if not verdicts:
        return torch.ones((), dtype=torch.bool, device=device)
    return verdicts[0] if len(verdicts) == 1 else torch.stack(verdicts).all()


def scape_metrics(stats: dict[str, float]) -> dict[str, float]:
    """``scape/<counter>`` for the counters the adapters log (:meth:`ScapeState.stats`: cumulative
    on this rank since the run began, but ``step_compression``, the last step's).

    Example:
        >>> metrics = scape_metrics(dict(bytes_sent=8, dense_bytes=80, compression=10.0, step_compression=99.0,
        ...                              skipped_steps=0, skipped_streak=0, step_seconds_dense=0.5,
        ...                              step_seconds_sparse=0.25))
        >>> metrics["scape/compression"], metrics["scape/step_seconds_sparse"]
        (10.0, 0.25)
    """
    return {f"scape/{name}": float(stats[name]) for name in LOGGED}


class ScapeStateBase:
    """What every SCAPE state (:class:`ScapeState` for DDP, :class:`~scape_core.fsdp.ScapeFSDPState`
    for FSDP2) keeps and does: the configuration, the flat layout, the scheduled masks, the step's
    record (:class:`~scape_core.buckets.StepRecord`, the hooks' hand-off to the optimizer), the
    buffers made at the first sparse step (the residual, every row; the windows, the rows of
    :attr:`shard`, whose optimizer state this rank keeps), the counters, and a step's begin and end.

    Who writes what: the hooks (:mod:`scape_core.exchange`) write the residual and the record; the
    optimizer writes ``m``, its statistics and the windows (at the mask's entries); :meth:`end_step`
    advances the step and has the selector choose the next masks; :meth:`restore` writes a loaded
    state. A subclass sets the attributes below in its ``__init__``.
    """

    config: ScapeConfig
    buffers: Buffers  # the layout, the residual, m and the statistics, the windows, the staging scratch
    comm: Communicator  # the group, this rank, the counters
    exchanger: exchange.Exchanger  # what the hooks' exchanges read and write (the buffers, regions, kernels, comm)
    selector: MaskSelector
    schedule: MaskSchedule
    kernels: Kernels
    buckets: Buckets
    record: StepRecord  # the step in progress: made at its start, filled by the hooks, taken by the optimizer
    shards: ShardExchange
    sharded: bool
    params: dict[str, Tensor]
    step: int
    skipped: Tensor
    streak: SkipStreak
    _sparse: bool
    max_steps: int | None  # the run's optimizer steps, if known (the start-of-run line's warning)
    announced: bool  # the start-of-run line was said (announce)
    last_step_bytes: tuple[int, int]  # stats()'s step_compression
    step_times: StepTimes  # stats()'s step_seconds_dense and step_seconds_sparse

    def _configure(self, sparsity: float | None, config: ScapeConfig | None, fields: dict[str, Any],
                   max_steps: int | None = None) -> None:
        """``config`` (or the defaults) with ``sparsity`` and ``fields`` over it; the run's length if known."""
        if config is not None and not isinstance(config, ScapeConfig):
            raise TypeError(f"config must be a ScapeConfig, got {type(config).__name__}")
        if sparsity is not None:
            fields["sparsity"] = sparsity
        self.config = (config or ScapeConfig()).replace(**fields)
        unread = unread_environment(self.config, os.environ)
        if unread and not (dist.is_initialized() and dist.get_rank() != 0):
            warnings.warn(unread, stacklevel=3)
        self.schedule = self.config.schedule
        self.max_steps = check_max_steps(max_steps)
        self.announced = False

    def _build(self, params: dict[str, Tensor], local: dict[str, Tensor], dtype: torch.dtype,
               group: dist.ProcessGroup | None) -> None:
        """The layout of ``local`` (each parameter's tensor on this rank, by name), its buffers, the
        communicator over ``group``, the kernels, the selector, the regions and the exchanger; ``dtype``: the
        native wire's."""
        self.params = params
        self.names = {id(p): n for n, p in params.items()}
        self.buffers = Buffers(FlatLayout(local, self.config.chunk_size))
        self.comm = Communicator(group, dist.get_rank(group), dist.get_world_size(group))
        self.kernels = Kernels(self.config.kernels)  # the passes over every coordinate, eager or compiled
        self.sharded = self.config.shard_optimizer
        # both build their plans now: their first use reads the device once
        self.selector = MaskSelector(self.layout, self.config, kernels=self.kernels, **self.comm.group_kwargs())
        self.shards = ShardExchange(self.layout, sharded=self.sharded, densities=self.schedule.densities(),
                                    **self.comm.group_kwargs())
        self.buckets = Buckets(self.layout, self.names, self.config.resolved_wire, self.comm.world_size,
                               self.config.wire_block, dtype=dtype)
        # the reference's functions or the compiled ones, and what they read and write
        self.exchanger = exchange.Exchanger(exchange.path(self.config.kernels), self.buffers, self.buckets,
                                            self.kernels, self.comm)
        self.record = self.new_record()
        self.last_step_bytes = (0, 0)  # (bytes sent, dense bytes) of the last completed step
        self.step_times = StepTimes(self.config)  # the wall time of dense and sparse steps, on the host
        self._counted_before = (0, 0)  # bytes_sent and dense_bytes when that step began
        self.step = 0  # optimizer steps taken (skipped ones included)
        self._sparse = False
        self.skipped = torch.zeros((), dtype=torch.long, device=self.layout.device)  # on the device: no host read
        self.streak = SkipStreak(self.config.skip_streak_warning, self.comm.rank, self.layout.device)
        self.guard = ReplicaGuard(self.config.replica_check_every)  # every rank holds the same replicated state
        self.optimizer: Any = None

    @property
    def layout(self) -> FlatLayout:
        """The flat layout of this rank's parameters (:attr:`buffers`')."""
        return self.buffers.layout

    def local_params(self) -> dict[str, Tensor]:
        """Each parameter's tensor on this rank, by name (under FSDP2, its local shard)."""
        return {n: getattr(p, "_local_tensor", p) for n, p in self.params.items()}

    @property
    def shard(self) -> Shard:
        """The rows whose ``m``, rule statistics and windows this rank keeps (every row unless sharded)."""
        return self.shards.shard

    def is_dense(self, step: int) -> bool:
        """Whether ``step`` exchanges every coordinate (warm-up or ``sparsity == 0``)."""
        return self.schedule.is_dense(step)

    @property
    def masks(self) -> dict[int, Mask]:
        """The scheduled masks by the step that uses them."""
        return self.selector.masks

    def current_mask(self) -> Mask | None:
        """Mask of the step in progress; ``None`` on a dense step."""
        return self.selector.mask_for(self.step)

    @property
    def sparse_started(self) -> bool:
        """Whether the buffers of sparse steps exist (the first sparse step, or a loaded state, made them)."""
        return self._sparse

    def start_sparse(self) -> None:
        """Allocate the residual (and the windows) before the first sparse exchange."""
        self._sparse = True
        if self.buffers.residual is None and self.config.error_feedback:
            self.buffers.residual = self.layout.zeros()
        if self.buffers.windows is None and self.config.keeps_windows:  # the warm-up exchanged everything
            self.buffers.windows = self.shard.zeros().fill_(self.step - 1)

    def reset_sparse(self, started: bool) -> None:
        """Drop the sparse buffers (a state is being loaded) and make them anew, zeroed, if ``started``."""
        self.buffers.drop()
        self._sparse = False
        self.buckets.forget_residual_views()
        if started:
            self.start_sparse()
            for buffer in (self.buffers.residual, self.buffers.windows):
                if buffer is not None:
                    buffer.zero_()

    def restore(self, *, masks: dict[int, Mask], step: int, sparse_started: bool, counters: dict[str, int],
                skipped: int, residual: dict[str, Tensor] | Tensor | None,
                windows: dict[str, Tensor] | Tensor | None) -> None:
        """Take a loaded state (validated by the caller): the masks, the step, the sparse buffers
        (``residual`` by name, flat, or the whole buffer; ``windows`` by name as this rank's part of
        each parameter, or the whole shard buffer), the counters and the skipped steps."""
        self.selector.load(masks)
        self.step = int(step)
        self.guard.loaded = True  # the next step compares the ranks' states
        self.reset_sparse(sparse_started)
        for buffer, saved, view in ((self.buffers.residual, residual, self.layout.view),
                                    (self.buffers.windows, windows, self.shard.view)):
            if buffer is None or saved is None:
                continue
            if isinstance(saved, Tensor):
                buffer.copy_(saved.to(buffer.device).view_as(buffer))
            else:
                for name, v in saved.items():
                    view(buffer, name).copy_(v.reshape(-1))
        self.skipped.fill_(int(skipped))
        self.comm.counters.update(counters)
        counted = self.comm.counters
        self.last_step_bytes, self._counted_before = (0, 0), (counted["bytes_sent"], counted["dense_bytes"])
        self.step_times.restart()  # the time until the next step is the load's, not a step's

    def announce(self, total_steps: int | None = None, sources: Mapping[str, str] | None = None) -> None:
        """Say once, on global rank 0, how this run communicates (:meth:`ScapeConfig.describe_run`, logged
        to the ``scape_core`` logger), and warn when the run's optimizer steps (``total_steps``, else
        ``max_steps``) end before the target density. Adapters call it at setup with what they know
        (the run's length, where each setting came from); otherwise the first optimizer step does.

        Example:
            >>> state = ScapeState(ddp, sparsity=0.99, warmup_steps=20, max_steps=10)  # doctest: +SKIP
            >>> state.announce()                                                      # doctest: +SKIP
            SCAPE: sparsity=0.99, warmup_steps=20 (the rest default); steps 0-19 dense (warm-up), ...
        """
        if self.announced:
            return
        self.announced = True
        total = check_max_steps(total_steps) if total_steps is not None else self.max_steps
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        sent = self.sent_share()
        log.info(self.config.describe_run(total, sources, sent=sent))
        warning = self.config.short_run_warning(total) if total is not None else None
        if warning:
            warnings.warn(warning, stacklevel=2)
        if sent is not None and sent > OUT_OF_REACH * (1 - self.config.sparsity):
            warnings.warn(f"SCAPE: sparsity={self.config.sparsity} is out of reach with chunk_size="
                          f"{self.config.chunk_size} on this model: every row (and every parameter's last row) "
                          f"exchanges at least one coordinate, so a sparse step sends {sent * 100:.3g}% of dense "
                          f"bytes. Raise chunk_size (at most 32768) or lower sparsity", stacklevel=2)
        cost = self.layout_cost()
        if cost:
            warnings.warn(cost, stacklevel=2)

    def layout_cost(self) -> str | None:
        """What the flat layout costs when it is much larger than the parameters (many small tensors, each
        starting its own row of ``chunk_size``), and a ``chunk_size`` that packs them; ``None`` otherwise.

        Example:
            >>> ScapeState(ddp_of_600_small_tensors, sparsity=0.99).layout_cost()   # doctest: +SKIP
            'SCAPE: the flat layout holds 2,457,600 values for 315,000 parameters (7.8x): ...'
        """
        numel, chunk = sum(self.layout.numel.values()), self.layout.chunk
        laid = self.layout.rows * chunk
        if laid <= PADDED_LAYOUT * numel or laid - numel <= PADDED_VALUES:
            return None
        floor = 1 << max(4, math.ceil(math.log2(1 / (1 - self.config.sparsity)))) if not self.config.dense else 16
        sizes = {c: sum(-(-n // c) for n in self.layout.numel.values()) * c for c in
                 (chunk >> i for i in range(1, 12)) if c >= floor}
        packed = max((c for c in sizes if sizes[c] <= 1.5 * numel), default=None)  # the largest that packs them
        packed = packed or min(sizes, key=sizes.get, default=chunk)
        mib = (laid - numel) * 4 / 2**20
        return (f"SCAPE: the flat layout holds {laid:,} values for {numel:,} parameters ({laid / numel:.1f}x): each of "
                f"the {len(self.layout.numel)} tensors starts its own row of chunk_size={chunk}, so each of SCAPE's "
                f"fp32 buffers (the residual, m, the rule's statistics, the windows, the staging) carries {mib:,.1f} "
                f"MiB of padding. chunk_size={packed} lays them out in {sizes.get(packed, laid):,} values "
                f"({sizes.get(packed, laid) / numel:.1f}x); every row sends at least one coordinate, so keep "
                "chunk_size above 1 / (1 - sparsity)")

    def sent_share(self) -> float | None:
        """The share of dense bytes a sparse step at the target density sends on this layout (``None``
        when every step is dense)."""
        if self.config.dense:
            return None
        shape = self.layout.mask_shape(self.schedule.density)
        return self.config.bytes_share(shape.entries / sum(self.layout.numel.values()))

    # ----- the optimizer step ---------------------------------------------------------
    def begin_step(self, names_with_grad: list[str]) -> tuple[Mask | None, Tensor]:
        """Check the hooks synchronized every gradient; returns ``(mask or None, skip)``.

        ``skip`` is a 0-dim bool on the device, the same on every rank: True when any region's
        exchange was not finite.
        """
        missing = [n for n in names_with_grad if n not in self.record.synced]
        if missing:
            raise RuntimeError(self.unsynchronized(missing))
        if not self.announced:
            self.announce()
        self.record.applied_names = names_with_grad
        skip = ~all_true(self.record.finite, self.layout.device)
        return (None if self.is_dense(self.step) else self.masks[self.step]), self.agree(skip)

    def unsynchronized(self, missing: list[str]) -> str:
        """What to say when the gradients of ``missing`` reached the optimizer unsynchronized."""
        return f"gradients of {missing[:3]} were not synchronized by SCAPE's hook before the optimizer step"

    def agree(self, skip: Tensor) -> Tensor:
        """The step's skip verdict as every rank that shares its parameters must see it (DDP: already)."""
        return skip

    def end_step(self, momentum: Tensor, beta1: float, skip: Tensor) -> None:
        """Close the step, then select the masks of upcoming steps from ``momentum`` (the shard's rows)."""
        self.skipped += skip
        own = self.record.local  # this rank's own verdicts (sparse steps only)
        self.streak.count(skip, ~all_true(own, skip.device) if own else torch.zeros_like(skip), self.step)
        self.stepped()
        for name, n in self.record.counts.items():  # the step's hook calls and bytes, now that it completed
            self.comm.counters[name] += n
        self.record = self.new_record()
        done, self.step = self.step, self.step + 1
        self.comm.counters["steps"] += 1
        self.selector.after_step(done, momentum, self.buffers.residual, self.buffers.windows, beta1)
        if self.schedule.ramp_densities:
            ahead = self.schedule.densities_from(self.step)
            self.layout.keep_shapes(ahead)
            if self.sharded:
                self.shards.keep_plans(ahead)
        now = (self.comm.counters["bytes_sent"], self.comm.counters["dense_bytes"])  # its mask all-gather included
        self.last_step_bytes = (now[0] - self._counted_before[0], now[1] - self._counted_before[1])
        self._counted_before = now
        if self.step % STREAK_CHECK_EVERY == 0:
            self.streak.poll()
        if self.guard.due(self.step):
            self.check_replicas()
        self.step_times.tick(done)  # on the host, where the step already waits: no device synchronization

    def replicated(self) -> Replicated:
        """What every rank of the group holds alike, for the replica guard: the step, the parameters, the
        optimizer's ``m``, statistics and windows (not when sharded: each rank keeps its own rows) and the
        scheduled masks."""
        buffers: dict[str, Tensor] = {}
        own = self.buffers
        if own.m is not None and not self.sharded:
            buffers["m"] = own.m
            buffers.update({f"statistic {k!r}": b for k, b in own.statistics.items()})
            if own.windows is not None:
                buffers["windows"] = own.windows
        return Replicated(self.step, self.layout, self.local_params(), buffers,
                          {step: mask.cols for step, mask in self.masks.items()}, self.buffers.staging_buffer)

    def check_replicas(self) -> None:
        """Compare every rank's replicated state (:mod:`scape_core.replicas`; collective: every rank calls it)."""
        self.guard.check(self.replicated(), self.comm)

    def drop_step(self) -> None:
        """The backward's synchronized step is not taken (``ScapeAdamS.zero_grad()`` without ``step()``,
        on every rank): on a sparse step the means exchanged go back into each rank's residual, so the
        step's gradient is applied later and nothing is lost; a dense step's are dropped, as a plain DDP
        step skipped. The schedule does not advance: the next backward uses the same mask."""
        record = self.record
        if record.values is not None and record.entries is not None:
            record.return_unapplied(self.buffers.residual, record.entries,
                                    torch.zeros((), dtype=torch.bool, device=self.layout.device))
        self.stepped()
        self.record = self.new_record()
        self.step_times.restart()  # the next step's time holds two backwards

    def stepped(self) -> None:
        """The optimizer has written this step into the regions (before the record is replaced)."""

    def new_record(self) -> StepRecord:
        """The record of the next step."""
        return StepRecord(self.buckets)

    def wait(self) -> None:
        """Finish SCAPE's in-flight collectives (a mask all-gather, gloo's callbacks); call before
        ``dist.destroy_process_group()``, which under either can abort the process on gloo."""
        self.selector.finish_pending()
        inflight.finish_all()

    # ----- reporting ------------------------------------------------------------------
    @property
    def skipped_steps(self) -> int:
        """Steps skipped for non-finite gradients so far (reads the device: call it between steps)."""
        return int(self.skipped)

    def stats(self) -> dict[str, float]:
        """Communication so far on this rank, over the completed optimizer steps: steps, hook calls,
        values/bytes sent, dense bytes, ``compression`` (dense bytes / bytes sent, since the run began),
        ``step_compression`` (the same for the last step alone: about ``1 / (1 - sparsity)`` on a
        sparse step at the target density), skipped steps and the current streak of consecutive skipped
        steps (``skipped_streak``), and ``step_seconds_dense`` and ``step_seconds_sparse``: the median wall
        time from one optimizer step to the next over the dense warm-up and over the sparse steps at the
        target density, each phase's first few steps and the ramp left out (:mod:`scape_core.step_times`;
        0.0 until measured; on the host's clock). ``shard_optimizer`` adds the all-gathers of the owners' rows to
        ``bytes_sent`` (``shard_bytes``), so compression can fall below 1 on a small model. Reads the
        device: call it between steps, not inside one; it also warns of a long streak (:meth:`check_streak`).
        At world size 1 nothing travels: every byte counter is 0 and both compressions 1.0.
        """
        c: dict[str, float] = dict(self.comm.counters)
        sent, dense = self.last_step_bytes
        if self.comm.world_size == 1:  # a collective over one rank moves nothing
            c.update(values_sent=0, bytes_sent=0, mask_bytes=0, dense_bytes=0, shard_bytes=0)
            sent = 0
        c["skipped_steps"] = self.skipped_steps
        c["skipped_streak"] = self.streak.current()
        c["compression"] = c["dense_bytes"] / c["bytes_sent"] if c["bytes_sent"] else 1.0
        c["step_compression"] = dense / sent if sent else 1.0
        c["step_seconds_dense"] = self.step_times.median("dense")
        c["step_seconds_sparse"] = self.step_times.median("sparse")
        self.check_streak()
        return c

    def summary(self) -> str:
        """One line on whether SCAPE paid in this run so far, from :meth:`stats` (this rank's): the sparse
        steps' time against the dense warm-up's, the bytes sent against dense DDP's, and, where the
        sparse steps are not faster, the settings that would help (:func:`~scape_core.step_times.summary_line`).

        Example:
            >>> state.summary()  # doctest: +SKIP
            'SCAPE: sparse steps 0.41 s against 1.20 s for the dense warm-up: 2.9x faster; 308 MB sent instead of ...'
        """
        return summary_line(self.stats(), self.config, self.comm.world_size)

    def log_summary(self) -> None:
        """Say :meth:`summary` on global rank 0 (the ``scape_core`` logger, as the start-of-run line); the
        adapters call it at the end of training. Reads the device: call it between steps."""
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        log.info(self.summary())

    def check_streak(self) -> None:
        """Warn (rank 0, once per streak) of ``config.skip_streak_warning`` consecutive skipped steps;
        reads the device (:meth:`stats` calls it). See :class:`~scape_core.streak.SkipStreak`."""
        self.streak.check()


class ScapeState(ScapeStateBase):
    """State of the SCAPE communication hook, shared with its :class:`ScapeAdamS` optimizer.

    Register it with the hook, then build the optimizer from it::

        state = ScapeState(ddp, sparsity=0.99)          # or config=ScapeConfig(...)
        ddp.register_comm_hook(state, scape_hook)
        opt = ScapeAdamS(ddp.parameters(), state, lr=3e-4, weight_decay=0.1)

    Tuning (:class:`ScapeConfig` fields; ``docs/benchmarks.md`` has the measurements):

    - ``sparsity``: the share of a dense fp32 exchange's bytes a sparse step does not send
      (values only: with the default score every rank computes the mask itself). Quality cost
      grows with sparsity: measure before 0.99. From 0.95 up the default ``wire`` spends the
      bytes on int8 / int4 values for 4-7.5x the coordinates, which is what quality follows.
    - ``warmup_steps``: dense steps first. They fill the momentum the first mask is scored
      from and outlive DDP's bucket rebuild after iteration 1. Tens to hundreds of steps.
    - ``ramp_steps``: after the warm-up, denser masks for a while (25%, 6.25%, 1.6% density),
      as DGC's sparsity warm-up: a few hundred steps cost little and help quality most.
    - ``update``: ``"linear"`` (default) applies each coordinate's whole synchronized sum,
      ``"lazy"`` (the contract's first reading) one AdamS step per selection.
    - ``mask_delay``: 1 (default) selects each mask a whole step before it is used (off the
      critical path); 0 selects it at the end of the step before (ablation).
    - ``mask_refresh``: steps between new masks; larger saves selection time, but a mask then
      serves several steps' gradients. Keep 1 unless selection shows in the step's time.
    - ``shard_optimizer``: ZeRO-1: ``m``, statistics and windows for this rank's block of rows
      only, for more bytes per step; bit-identical to the replicated mode.
    - ``kernels``: ``"compiled"`` runs the passes over every coordinate as ``torch.compile``'d
      fused loops (:mod:`scape_core.kernels`): fewer passes over memory (what a sparse step costs
      on a GPU), for a compile in the first steps. Either way a sparse step
      dispatches a fixed number of operators whatever the tensors and buckets.
    - ``replica_check_every``: steps between checks that every rank holds the same replicated state
      (:mod:`scape_core.replicas`); 100 by default, 0 never.
    - Build DDP with ``gradient_as_bucket_view=True`` where you can: ``p.grad`` is then the
      bucket's memory, which the hook writes, and DDP skips copying every bucket into ``p.grad``.

    The residual and the windows are flat ``(rows, chunk)`` fp32 buffers (:mod:`scape_core.layout`)
    with a view per parameter name: checkpoints stay keyed by name, never by DDP bucket.
    Non-finite gradients on any rank make every rank skip the step (``skipped_steps``), decided
    on the device; the step is dropped whole (every residual as before it).

    Pieces: :attr:`buffers` holds the layout, the residual, ``m`` and the windows (:mod:`scape_core.buffers`),
    :attr:`comm` the group and the counters (:mod:`scape_core.communicator`), :attr:`selector` chooses
    the masks (:mod:`scape_core.selection`), :attr:`buckets` and :attr:`record` are the hook's
    (:mod:`scape_core.buckets`), :attr:`exchanger` what its exchanges read and write
    (:mod:`scape_core.exchange`), :attr:`shards` the sharded mode's collectives
    (:mod:`scape_core.sharding`), :mod:`scape_core.checkpoint` the saved form.

    Args:
        model: the DistributedDataParallel-wrapped model (optionally under torch.compile).
        sparsity: shorthand for ``ScapeConfig.sparsity``.
        config: a full :class:`ScapeConfig`; other keyword arguments override its fields.
        process_group: the group to communicate over (default: the DDP model's).
        max_steps: the run's optimizer steps, if known: the start-of-run line (logged on rank 0 at the
            first step, :meth:`announce`) then warns when they end before the target density.

    Example:
        >>> state = ScapeState(ddp, sparsity=0.99, warmup_steps=20)
        >>> state.config.sparsity, state.step, state.is_dense(0)
        (0.99, 0, True)
        >>> ScapeState(ddp, sparsity=0.99, shard_optimizer=True).shard.rows <= state.layout.rows
        True
    """

    def __init__(self, model: nn.Module, sparsity: float | None = None, *, config: ScapeConfig | None = None,
                 process_group: dist.ProcessGroup | None = None, max_steps: int | None = None,
                 **fields: Any) -> None:
        self._configure(sparsity, config, fields, max_steps)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ScapeState needs torch.distributed initialized (dist.init_process_group)")
        ddp = check_ddp_model(model)
        if process_group is None and ddp.process_group is not dist.group.WORLD:
            process_group = ddp.process_group  # the group DDP itself synchronizes over
        self.watch = DDPWatch(model, self)  # says what happened when gradients arrive unsynchronized
        self._ddp = weakref.ref(ddp)
        join.extend_join_hook(ddp, self)  # ddp.join(): a rank out of data takes the others' SCAPE step
        params = parameter_names(model)
        if not params:
            raise ValueError("the model has no trainable parameters")
        dtypes = {p.dtype for p in params.values()}
        self._build(params, params, dtypes.pop() if len(dtypes) == 1 else torch.float32, process_group)
        if self.comm.world_size == 1:
            warnings.warn(SINGLE_PROCESS, stacklevel=2)

    # ----- named views --------------------------------------------------------------
    def residual(self, name: str) -> Tensor:
        """This rank's fp32 residual of ``name`` (flat; zeros before the first sparse step)."""
        if self.buffers.residual is None:
            return torch.zeros(self.layout.numel[name], device=self.layout.device)
        return self.layout.view(self.buffers.residual, name)

    @property
    def residuals(self) -> dict[str, Tensor]:
        """Every parameter's residual view by name (empty before the first sparse step)."""
        if self.buffers.residual is None:
            return {}
        return {n: self.layout.view(self.buffers.residual, n) for n in self.params}

    def unsynchronized(self, missing: list[str]) -> str:
        return self.watch.explain(missing)

    def begin_step(self, names_with_grad: list[str]) -> tuple[Mask | None, Tensor]:
        ddp = self._ddp()
        if ddp is not None and ddp.find_unused_parameters and join.in_join(ddp):  # every rank, at its first step
            raise RuntimeError(join.UNUSED_IN_JOIN)
        return super().begin_step(names_with_grad)

    def stepped(self) -> None:
        self.watch.stepped(self.record.applied_names)  # after the optimizer wrote into the buckets

    def new_record(self) -> StepRecord:
        return StepRecord(self.buckets, already=self.watch.unapplied)  # a second sync says why

    def drop_step(self) -> None:
        if self.watch.through_another_model():  # not a skipped step: another model's loss went through this one
            raise RuntimeError(self.watch.unapplied(sorted(self.record.synced)[0]))
        super().drop_step()

    # ----- checkpoints ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's state: step, scheduled masks, residual and windows by name, counters."""
        return checkpoint.state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (this rank) or :func:`~scape_core.gather_state_dict` (all ranks).

        A gathered state at the same world size gives each rank its own residual back; at
        another world size every rank gets the old ranks' mean (keeping the global unsent
        gradient) with a warning. Everything is validated before anything is changed.
        """
        checkpoint.load_state_dict(self, state)
