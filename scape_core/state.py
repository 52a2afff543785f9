"""ScapeState: SCAPE's per-rank state (residual, windows, masks, counters) in flat buffers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from scape_core import inflight
from scape_core.config import ScapeConfig
from scape_core.diagnose import DDPWatch
from scape_core.layout import FlatLayout, Shard, gather_spans, scatter_spans
from scape_core.masks import Mask, age_momentum_score, momentum_residual_score, select, strided
from scape_core.wire import WirePlan

_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_forward_module.")


def parameter_names(model: nn.Module) -> dict[str, Tensor]:
    """Trainable parameters by name, with DDP / torch.compile / Fabric wrapper prefixes removed."""
    named = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        while name.startswith(_WRAPPER_PREFIXES):
            name = name.split(".", 1)[1]
        named[name] = p
    return named


def _check_model(model: nn.Module) -> None:
    """SCAPE replaces DDP's gradient all-reduce: refuse models it cannot serve, at setup."""
    inner = getattr(model, "_orig_mod", model)  # torch.compile wrapper
    if not isinstance(inner, nn.parallel.DistributedDataParallel):
        raise TypeError(
            f"ScapeState needs the DistributedDataParallel-wrapped model, got {type(inner).__name__} "
            "(FSDP and DeepSpeed shard gradients themselves and are not supported)"
        )
    for name, module in inner.module.named_modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
            raise TypeError(f"{name or 'the model'} is an embedding with sparse=True; SCAPE needs dense "
                            "gradients: build it with sparse=False")


@dataclass
class _Step:
    """What the hook recorded during the current step's backward."""

    synced: set[str] = field(default_factory=set)
    finite: list[Tensor] = field(default_factory=list)  # one 0-dim bool per bucket: its reduced values are finite
    values: Tensor | None = None  # sparse: the mean exchanged at each mask entry (0 where a bucket was not finite)
    applied_names: list[str] = field(default_factory=list)  # parameters with a gradient at the optimizer step
    exchanges: list[tuple[Tensor, Tensor, list[tuple[int, int]]]] = field(default_factory=list)  # sparse, per
    # bucket: its buffer, the positions of its entries there, and where they sit among the mask's entries


class ScapeState:
    """State of the SCAPE communication hook, shared with its :class:`ScapeAdamS` optimizer.

    Register it with the hook, then build the optimizer from it::

        state = ScapeState(ddp, sparsity=0.99)          # or config=ScapeConfig(...)
        ddp.register_comm_hook(state, scape_hook)
        opt = ScapeAdamS(ddp.parameters(), state, lr=3e-4, weight_decay=0.1)

    Tuning (see ``docs/benchmarks.md`` for the measurements behind the defaults):

    - ``sparsity``: the share of a dense fp32 exchange's bytes a sparse step does not send:
      bytes per step are about ``(1 - sparsity)`` of dense DDP's (values only: with the default
      score every rank computes the mask itself). With native values that is the share of
      coordinates not exchanged; an encoded ``wire`` spends the bytes on ``32 / bits`` times the
      coordinates. Quality cost grows with sparsity: measure before 0.99.
    - ``warmup_steps``: dense steps first. They fill the momentum the first mask is scored
      from and outlive DDP's bucket rebuild after iteration 1. Tens to hundreds of steps.
    - ``ramp_steps``: after the warm-up, denser masks for a while (25%, 6.25%, 1.6% density),
      as DGC's sparsity warm-up; the measured largest gain after the update rule.
    - ``update``: the masked update rule; ``"linear"`` (default) applies each coordinate's whole
      synchronized sum, ``"lazy"`` (the contract's first reading) one AdamS step per selection.
    - ``mask_delay``: 1 (default) selects each mask a whole step before it is used (off the
      critical path); 0 selects it at the end of the step before (ablation).
    - ``mask_refresh``: steps between new masks; larger saves selection time.
    - ``chunk_size``: masks pick the same share of every row of this many coordinates.
    - Build DDP with ``gradient_as_bucket_view=True`` where you can: the optimizer reads and
      writes the synchronized gradients in DDP's buckets; otherwise it first copies every
      ``p.grad`` back into them (the Lightning strategies set it).
    - ``shard_optimizer``: ``True`` keeps ``m``, the rule's statistics and the windows only for
      this rank's block of ``ceil(rows / W)`` rows (ZeRO-1, the paper's distributed optimizer):
      ``4 + 12 / W`` bytes of state per parameter instead of 16. Each rank selects the mask of
      its block and the blocks are all-gathered, a step ahead (overlapped); a sparse step
      all-reduces the same compact buffer, each owner runs the rule on its entries and the
      owners' steps ``u`` are all-gathered; a dense step updates the block and all-gathers the
      parameters. Same masks and bit-identical parameters as the replicated mode; the price is
      bytes (at 99%, 1.75x the replicated mode's per sparse step at W = 2, 1.38x at W = 4; dense
      steps 1.5x DDP's). Choose it when optimizer memory, not bandwidth, limits the model.
    - ``wire``: how a sparse step's values travel. ``"native"`` sends the gradients' dtype in one
      all-reduce; ``"bfloat16"``, ``"int8"``, ``"int4"`` send 16, 8 or 4 bits per value (integers
      with one fp32 scale per ``wire_block`` values) in two collectives (an all-to-all to each
      segment's owner, which sums in fp32, and an all-gather of the means), every rank keeping
      its rounding in its residual. Fewer bits per value buy more coordinates at equal bytes,
      which is what quality follows: ``sparsity=0.99, wire="int4"`` exchanges 7.5% of the
      coordinates for the bytes of 1% in fp32, and measured far better (``docs/benchmarks.md``).
      ``"auto"`` (default): int4 from ``sparsity=0.97``, int8 from 0.95, native below and with
      ``shard_optimizer``.

    The residual and the windows are flat ``(rows, chunk)`` buffers (:mod:`scape_core.layout`)
    with a view per parameter name: checkpoints stay keyed by name, never by DDP bucket, so the
    bucket rebuild, several buckets, ``gradient_as_bucket_view``, ``static_graph`` and
    ``no_sync`` are safe and :meth:`state_dict` resumes bit-for-bit. Memory over AdamS: one fp32
    residual and one fp32 window per parameter (the window of 1/W of them when sharded), plus
    the masks (int16, ``k`` per row).

    Non-finite gradients: a rank with a NaN/inf in a bucket poisons that bucket's exchange, so
    every rank sees a non-finite reduction and all skip the optimizer step together (counted in
    ``skipped_steps``), decided on the device. A poisoned bucket drops the step's gradient; values
    exchanged in clean buckets go back into the residuals, so nothing sent is lost and ``m``,
    parameters and residuals stay as they were.

    Args:
        model: the DistributedDataParallel-wrapped model (optionally under torch.compile).
        sparsity: shorthand for ``ScapeConfig.sparsity``.
        config: a full :class:`ScapeConfig`; other keyword arguments override its fields.
        process_group: the group to communicate over (default: the world).

    Example:
        >>> state = ScapeState(ddp, sparsity=0.99, warmup_steps=20)
        >>> state.config.sparsity, state.step, state.is_dense(0)
        (0.99, 0, True)
        >>> ScapeState(ddp, sparsity=0.99, shard_optimizer=True).shard.rows <= state.layout.rows
        True
    """

    def __init__(
        self,
        model: nn.Module,
        sparsity: float | None = None,
        *,
        config: ScapeConfig | None = None,
        process_group: dist.ProcessGroup | None = None,
        **fields: Any,
    ) -> None:
        if config is not None and not isinstance(config, ScapeConfig):
            raise TypeError(f"config must be a ScapeConfig, got {type(config).__name__}")
        if sparsity is not None:
            fields["sparsity"] = sparsity
        self.config = (config or ScapeConfig()).replace(**fields)
        self.schedule = self.config.schedule
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ScapeState needs torch.distributed initialized (dist.init_process_group)")
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        _check_model(model)
        self.watch = DDPWatch(model, self)  # says what happened when gradients arrive unsynchronized
        self.params = parameter_names(model)
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        for name, p in self.params.items():
            if not p.is_contiguous():
                raise ValueError(f"parameter {name!r} is not contiguous (e.g. channels_last): SCAPE keeps flat "
                                 "views of every parameter; make it contiguous before wrapping the model in DDP")
        self.names = {id(p): n for n, p in self.params.items()}
        self.layout = FlatLayout(self.params, self.config.chunk_size)
        own = self.layout.shard(self.rank, self.world_size)
        self.partition = slice(own.start, own.stop)  # rows this rank scores when selection is partitioned
        self.sharded = self.config.shard_optimizer
        # rows whose m, rule statistics and windows this rank keeps: its partition, or every row
        self.shard = own if self.sharded else Shard(self.layout, 0, self.layout.rows)
        self._shard_plans: dict[float, _ShardPlan] = {}
        for density in self.schedule.densities():  # built now: their first use reads the device once
            self.layout.mask_shape(density)
            if self.sharded:
                self._shard_plan(density)
        for rows in {(0, self.layout.rows), (self.partition.start, self.partition.stop)}:
            self.layout.partial_rows_in(*rows)
        self.step = 0  # optimizer steps taken (skipped ones included)
        self._sparse = False
        self.residual_buffer: Tensor | None = None  # (rows, chunk) fp32, this rank's unsent gradient: from the first sparse step
        # (shard rows, chunk) fp32 (exact to 2^24 steps; the score computes in fp32 anyway): the step each
        # coordinate was last exchanged at
        self.window_buffer: Tensor | None = None
        self.masks: dict[int, Mask] = {}  # step -> mask used at that step
        self._strided: dict[float, Mask] = {}
        self._pending: tuple[int, Any, Tensor] | None = None  # (step, work, gathered columns)
        self._current = _Step()
        self._skipped = torch.zeros((), dtype=torch.long, device=self.layout.device)
        self._scratch: Tensor | None = None  # the CPU's score buffer (see _workspace)
        self.row_shift = torch.zeros(self.layout.rows, dtype=torch.long, device=self.layout.device)
        self.buckets: dict[tuple[int, int], Any] = {}  # the hook's per-bucket plans
        self._wire_plans: dict[int, WirePlan] = {}
        self.bucket_views: dict[str, Tensor] = {}  # each parameter's gradient view in its DDP bucket
        self.optimizer: Any = None
        # shard_bytes: the sharded mode's all-gathers of updates and parameters (also in bytes_sent)
        self.counters = dict(steps=0, hook_calls=0, values_sent=0, bytes_sent=0, mask_bytes=0, dense_bytes=0,
                             shard_bytes=0)

    # ----- schedule -------------------------------------------------------------------
    def is_dense(self, step: int) -> bool:
        """Whether ``step`` exchanges every coordinate (warm-up or ``sparsity == 0``)."""
        return self.schedule.is_dense(step)

    def current_mask(self) -> Mask | None:
        """Mask of the step in progress; ``None`` on a dense step."""
        if self.is_dense(self.step):
            return None
        if self.step not in self.masks:
            self._finish_pending()
            if self.step not in self.masks:
                if self.step >= self.schedule.first_selected():  # a step existed that should have picked it
                    raise RuntimeError(f"no SCAPE mask is scheduled for step {self.step}: was "
                                       "ScapeAdamS.step() skipped, or the state reloaded without its masks?")
                self.masks[self.step] = self._strided_mask(self.schedule.density_at(self.step))
        return self.masks[self.step]

    def _strided_mask(self, density: float) -> Mask:
        """Evenly spaced picks: the mask of sparse steps no earlier step could select for."""
        if density not in self._strided:
            self._strided[density] = strided(self.layout, self.layout.mask_shape(density))
        return self._strided[density]

    # ----- buffers and named views ----------------------------------------------------
    @property
    def sparse_started(self) -> bool:
        """Whether the buffers of sparse steps exist (the first sparse step, or a loaded state, made them)."""
        return self._sparse

    def start_sparse(self) -> None:
        """Allocate the residual (and the windows) before the first sparse exchange."""
        self._sparse = True
        if self.residual_buffer is None and self.config.error_feedback:
            self.residual_buffer = self.layout.zeros()
        if self.window_buffer is None and self.config.keeps_windows:  # the warm-up exchanged everything
            self.window_buffer = self.shard.zeros().fill_(self.step - 1)

    def residual(self, name: str) -> Tensor:
        """This rank's fp32 residual of ``name`` (flat; zeros before the first sparse step)."""
        if self.residual_buffer is None:
            return torch.zeros(self.layout.numel[name], device=self.layout.device)
        return self.layout.view(self.residual_buffer, name)

    @property
    def residuals(self) -> dict[str, Tensor]:
        """Every parameter's residual view by name (empty before the first sparse step)."""
        if self.residual_buffer is None:
            return {}
        return {n: self.layout.view(self.residual_buffer, n) for n in self.params}

    def window(self, name: str) -> Tensor | None:
        """The step each coordinate of ``name`` was last exchanged at (``None`` before the first sparse step).

        Sharded: only the coordinates of this rank's shard (``shard.span[name]`` of them).
        """
        return None if self.window_buffer is None else self.shard.view(self.window_buffer, name)

    # ----- hook side ------------------------------------------------------------------
    def record_sync(self, names: list[str]) -> None:
        """Called once per bucket per backward; refuses a second sync before the optimizer step."""
        again = self._current.synced.intersection(names)
        if again:
            raise RuntimeError(
                "scape_hook synchronized the same gradients twice without ScapeAdamS.step() in "
                f"between (e.g. {sorted(again)[0]!r}): every sync flushes residuals that only the "
                "SCAPE optimizer applies. Use ScapeAdamS, and accumulate gradients under ddp.no_sync()."
            )
        self._current.synced.update(names)
        self.counters["hook_calls"] += 1

    def step_values(self, entries: int) -> Tensor:
        """The step's buffer of exchanged means, one per mask entry (the hook fills it bucket by bucket)."""
        if self._current.values is None:
            self._current.values = torch.zeros(entries, device=self.layout.device)
        return self._current.values

    def record_finite(self, finite: Tensor) -> None:
        """A bucket's verdict (0-dim bool on the device; list appends are safe from gloo's thread)."""
        self._current.finite.append(finite)

    def record_exchange(self, buffer: Tensor, positions: Tensor, spans: list[tuple[int, int]]) -> None:
        """A sparse bucket's buffer, its entries' positions there, and their place among the mask's entries."""
        self._current.exchanges.append((buffer, positions, spans))

    def wire_plan(self, entries: int) -> WirePlan:
        """The shape of a compact buffer of ``entries`` values on this run's encoded wire (built once)."""
        if entries not in self._wire_plans:
            self._wire_plans[entries] = WirePlan(self.config.resolved_wire, entries, self.world_size, self.config.wire_block)
        return self._wire_plans[entries]

    def count(self, values: int, nbytes: int, dense_bytes: int) -> None:
        self.counters["values_sent"] += values
        self.counters["bytes_sent"] += nbytes
        self.counters["dense_bytes"] += dense_bytes

    # ----- optimizer side -------------------------------------------------------------
    def begin_step(self, names_with_grad: list[str]) -> tuple[Mask | None, Tensor]:
        """Check the hook synchronized every gradient; returns ``(mask or None, skip)``.

        ``skip`` is a 0-dim bool on the device: True when any bucket's exchange was not finite.
        """
        missing = [n for n in names_with_grad if n not in self._current.synced]
        if missing:
            raise RuntimeError(self.watch.explain(missing))
        self._current.applied_names = names_with_grad
        finite = self._current.finite
        skip = ~torch.stack(finite).all() if finite else torch.zeros((), dtype=torch.bool, device=self.layout.device)
        return (None if self.is_dense(self.step) else self.masks[self.step]), skip

    def gather_gradients(self, params: list[Tensor], entries: int) -> Tensor:
        """The synchronized gradient at every mask entry, read from ``p.grad`` (fp32).

        Reads ``p.grad``, not what the hook received, so gradient clipping or scaling between
        backward and step applies. A ``p.grad`` that is not its bucket's own memory
        (``gradient_as_bucket_view=False``, or replaced) is first copied into the bucket.
        """
        elsewhere = [(self.bucket_views[self.names[id(p)]], p.grad) for p in params
                     if p.grad.data_ptr() != self.bucket_views[self.names[id(p)]].data_ptr()]
        if elsewhere:
            torch._foreach_copy_([v for v, _ in elsewhere], [g for _, g in elsewhere])
        values = torch.empty(entries, device=self.layout.device)
        for buffer, positions, spans in self._current.exchanges:
            scatter_spans(values, spans, buffer.index_select(0, positions))
        return values

    def scatter_update(self, update: Tensor) -> None:
        """Write ``update`` (one value per mask entry) into the bucket buffers, zeros elsewhere: each
        parameter's bucket view (:attr:`bucket_views`) then holds its dense update."""
        for buffer, positions, spans in self._current.exchanges:
            buffer.zero_()
            buffer.index_copy_(0, positions, gather_spans(update, spans).to(buffer.dtype))

    def restore_gradients(self, values: Tensor) -> None:
        """Put the synchronized gradient back into the buckets (``p.grad`` when it is the bucket's view)."""
        for buffer, positions, spans in self._current.exchanges:
            buffer.index_copy_(0, positions, gather_spans(values, spans).to(buffer.dtype))

    def entries_with_grad(self, params: list[Tensor], entries: Tensor, keep: Tensor) -> Tensor:
        """Per mask entry: applied this step (``keep``, and its parameter has a gradient)."""
        with_grad = {self.names[id(p)] for p in params}
        rows = torch.ones(self.layout.rows, dtype=torch.bool, device=self.layout.device)
        for name in self.params:
            if name not in with_grad:  # rare (unused parameters): one fill each
                first = self.layout.first_row[name]
                rows[first:first + self.layout.nrows[name]] = False
        owner = torch.div(entries, self.layout.chunk, rounding_mode="floor")
        return rows.index_select(0, owner) & keep

    def return_unapplied(self, entries: Tensor, applied: Tensor) -> None:
        """Exchanged values the optimizer did not apply (a skipped step, a parameter without
        gradient) go back into the residual: nothing sent is lost. ``applied``: bool, 0-dim or per entry."""
        values = self._current.values
        if values is not None and self.residual_buffer is not None:
            self.residual_buffer.view(-1).index_add_(0, entries, values.masked_fill(applied, 0.0))

    def mark_exchanged(self, entries: Tensor, applied: Tensor) -> Tensor | None:
        """The window length of each entry (steps since its last exchange, >= 1); marks them exchanged now."""
        if self.window_buffer is None:
            return None
        flat = self.window_buffer.view(-1)
        last = flat.index_select(0, entries)
        flat.index_copy_(0, entries, torch.where(applied, self.step, last))
        return last.neg_().add_(self.step)

    def end_step(self, momentum: Tensor, beta1: float, skip: Tensor) -> None:
        """Close the step, then select the masks of upcoming steps from ``momentum`` (``(rows, chunk)``)."""
        self._skipped += skip
        self.watch.stepped(self._current.applied_names)  # after the optimizer wrote into the buckets
        self._current = _Step()
        done, self.step = self.step, self.step + 1
        self.counters["steps"] += 1
        if self.schedule.dense:
            return
        self._finish_pending()
        target = self.schedule.target_after(done)
        if self.schedule.selects(target):
            self._select(target, momentum, beta1)
        elif not self.is_dense(target):
            self.masks[target] = self.masks.get(target - 1) or self._strided_mask(self.schedule.density_at(target))
        if self.config.mask_delay == 0:
            self._finish_pending()
        self.masks = {s: m for s, m in self.masks.items() if s >= self.step}
        if self._strided and self.step > self.schedule.first_selected():  # every later mask is selected
            self._strided.clear()

    def _select(self, target: int, momentum: Tensor, beta1: float) -> None:
        """Score and pick the mask of ``target``: all of it (replicated score and state) or this rank's rows.

        ``momentum`` is the optimizer's ``(shard rows, chunk)`` buffer: every row, or only this
        rank's partition when sharded (then it alone can score those rows).
        """
        shape = self.layout.mask_shape(self.schedule.density_at(target))
        scheduled = self.masks.get(target - 1) if self.config.mask_delay else None  # being flushed: not twice
        kind = self.config.resolved_score
        whole = self.config.replicated_score and not self.sharded
        rows = slice(0, self.layout.rows) if whole else self.partition
        m = momentum if self.sharded or whole else momentum[rows]
        if kind == "momentum_residual":
            residual = None if self.residual_buffer is None else self.residual_buffer[rows]
            score = momentum_residual_score(m, residual, beta1)
        elif kind == "age_momentum":
            windows = self.window_buffer if self.window_buffer is None or self.sharded else self.window_buffer[rows]
            score = age_momentum_score(m, windows, target, out=self._workspace(m.shape[0]))
        else:
            score = torch.abs(m, out=self._workspace(m.shape[0]))
        own = select(score, self.layout, shape, scheduled, rows)
        if whole:  # every rank selected the whole mask itself: nothing to exchange
            self.masks[target] = Mask(shape.density, own)
            return
        most = self.layout.block(self.world_size)  # rows of a partition (the last ones may have fewer)
        payload = torch.zeros(most, shape.k, dtype=torch.int16, device=own.device)
        payload[:own.shape[0]] = own
        wire = payload.view(torch.uint8)  # as bytes: gloo has no int16
        out = wire.new_empty(self.world_size * most, wire.shape[1])
        work = inflight.hold(dist.all_gather_into_tensor(out, wire, group=self.process_group, async_op=True))
        nbytes = payload.numel() * payload.element_size()
        self.counters["mask_bytes"] += nbytes
        self.counters["bytes_sent"] += nbytes
        self._pending = (target, work, out)

    def _workspace(self, rows: int) -> Tensor:
        """A ``(rows, chunk)`` fp32 scratch buffer for the score. Kept on the CPU, where a fresh buffer
        this size costs more (page faults) than the arithmetic; on a GPU the caching allocator reuses one."""
        if self.layout.device.type != "cpu":
            return torch.empty(rows, self.layout.chunk, device=self.layout.device)
        if self._scratch is None or self._scratch.shape[0] != rows:
            self._scratch = torch.zeros(rows, self.layout.chunk, device=self.layout.device)
        return self._scratch

    def wait(self) -> None:
        """Finish SCAPE's in-flight collectives; call before ``dist.destroy_process_group()``.

        A mask all-gather may be in flight (scores that read the residual), and gloo finishes
        each all-reduce's callback on its own thread; tearing the process group down (or
        exiting) under either can abort the process (gloo: "terminate called without an active
        exception").
        """
        self._finish_pending()
        inflight.finish_all()

    def _finish_pending(self) -> None:
        if self._pending is None:
            return
        target, work, out = self._pending
        work.wait()
        cols = out.view(torch.int16)[:self.layout.rows]  # equal blocks: the ranks' rows in layout order
        self.masks[target] = Mask(self.schedule.density_at(target), cols)
        self._pending = None

    # ----- sharded optimizer state: what the owners exchange ---------------------------
    def own_entries(self, mask: Mask) -> tuple[Tensor | None, Tensor]:
        """The mask's entries whose optimizer state this rank keeps: ``(their positions among the
        mask's entries, or None for all of them; their flat indices into the shard's buffers)``."""
        entries = mask.flat(self.layout)
        if not self.sharded:
            return None, entries
        positions = self._shard_plan(mask.density).positions
        return positions, entries.index_select(0, positions).sub_(self.shard.start * self.layout.chunk)

    def gather_updates(self, own: Tensor, density: float) -> Tensor:
        """Every owner's values for its entries of a mask of ``density``, all-gathered (collective),
        in the mask's entry order: what each rank needs to apply the update everywhere."""
        plan = self._shard_plan(density)
        send = torch.nn.functional.pad(own, (0, plan.most - own.numel()))
        out = send.new_empty(self.world_size * plan.most)
        dist.all_gather_into_tensor(out, send, group=self.process_group)
        self._count_shard(send)
        return out.index_select(0, plan.order)

    def gather_parameters(self) -> None:
        """After a dense step updated this rank's shard of every parameter, give every rank all the
        new values: one all-gather of the shards in fp32 (collective; exact for bf16 parameters)."""
        send = self.shard.zeros()
        own = self.shard.names
        torch._foreach_copy_([self.shard.view(send, n) for n in own],
                             [self.shard.part(self.params[n].detach(), n) for n in own])
        full = self.unshard(send)
        self._count_shard(send)
        torch._foreach_copy_([p.detach().view(-1) for p in self.params.values()],
                             self.layout.views(full, list(self.params)))

    def unshard(self, buffer: Tensor) -> Tensor:
        """The whole ``(rows, chunk)`` buffer from every rank's shard of it (collective when sharded;
        ``buffer`` itself when not). For checkpoints and tests, not for the training step."""
        if not self.sharded:
            return buffer
        block, chunk = self.layout.block(self.world_size), self.layout.chunk
        if buffer.shape[0] != block:
            buffer = torch.cat([buffer, buffer.new_zeros(block - buffer.shape[0], chunk)])
        out = buffer.new_empty(self.world_size * block, chunk)
        dist.all_gather_into_tensor(out, buffer.contiguous(), group=self.process_group)
        return out[:self.layout.rows]

    def _shard_plan(self, density: float) -> "_ShardPlan":
        if density not in self._shard_plans:
            self._shard_plans[density] = _ShardPlan(self.layout, density, self.rank, self.world_size)
        return self._shard_plans[density]

    def _count_shard(self, sent: Tensor) -> None:
        nbytes = sent.numel() * sent.element_size()
        self.count(sent.numel(), nbytes, 0)
        self.counters["shard_bytes"] += nbytes

    # ----- reporting and checkpoints --------------------------------------------------
    @property
    def skipped_steps(self) -> int:
        """Steps skipped for non-finite gradients so far (reads the device: call it between steps)."""
        return int(self._skipped)

    def stats(self) -> dict[str, float]:
        """Communication so far on this rank: steps, values/bytes sent, dense bytes, compression, skipped steps.

        Reads the device's count of skipped steps (a host synchronization): call it between
        steps, not inside one.
        """
        c: dict[str, float] = dict(self.counters)
        c["skipped_steps"] = self.skipped_steps
        c["compression"] = c["dense_bytes"] / c["bytes_sent"] if c["bytes_sent"] else 1.0
        return c

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: step, scheduled masks, residual and windows by name, counters."""
        from scape_core.checkpoint import state_dict

        return state_dict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (this rank) or :func:`gather_state_dict` (all ranks).

        A gathered state at the same world size gives each rank its own residual back; at
        another world size every rank gets the old ranks' mean (keeping the global unsent
        gradient) with a warning. Everything is validated before anything is changed.
        """
        from scape_core.checkpoint import load_state_dict

        load_state_dict(self, state)

    def check_loadable(self, state: dict[str, Any]) -> dict[str, Tensor]:
        """Validate a saved state against this run (raises ValueError); returns this rank's residual."""
        from scape_core.checkpoint import check_loadable

        return check_loadable(self, state)


class _ShardPlan:
    """Where the entries of a mask of one density sit when each rank owns a block of rows: this
    rank's among the mask's entries, and every rank's in an all-gather of the owners' values
    (each owner's full-row entries, then its shorter rows', padded to the largest owner's count)."""

    def __init__(self, layout: FlatLayout, density: float, rank: int, world: int) -> None:
        shape = layout.mask_shape(density)
        spans = [shape.rows_spans(s.start, s.stop) for s in (layout.shard(r, world) for r in range(world))]
        self.most = max(sum(hi - lo for lo, hi in own) for own in spans)
        index = torch.int32 if world * self.most < 2 ** 31 else torch.long  # half the memory where it fits
        order = torch.empty(shape.entries, dtype=index)
        for r, own in enumerate(spans):
            at = r * self.most
            for lo, hi in own:
                order[lo:hi] = torch.arange(at, at + hi - lo)
                at += hi - lo
        self.order = order.to(layout.device)  # gathered position of each of the mask's entries
        self.positions = torch.cat([torch.arange(lo, hi, dtype=index) for lo, hi in spans[rank]]).to(layout.device)

