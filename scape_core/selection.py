"""Which coordinates each sparse step exchanges: the schedule's lookup, the score, the top-k and,
when a rank can score only its rows, the partitioned all-gather of the masks, a step ahead.

:class:`MaskSelector` is the one job of choosing masks. ``ScapeState`` holds one and feeds it
the optimizer's momentum, the rank's residual and the windows after every step;
``benchmarks/simulator.py`` subclasses it for its virtual ranks (:meth:`MaskSelector.choose`).
The mask used at step ``T`` is chosen at the end of step ``T - 1 - mask_delay``
(:class:`~scape_core.schedule.MaskSchedule`), the mask being flushed meanwhile excluded.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from scape_core import inflight
from scape_core.compat import all_gather_into_tensor
from scape_core.config import ScapeConfig
from scape_core.kernels import Kernels
from scape_core.layout import FlatLayout, MaskShape
from scape_core.masks import (
    SELECTIONS,
    Mask,
    age_momentum_compiled,
    age_momentum_score,
    momentum_residual_score,
    pick_compiled,
    select_age,
    strided,
)

# the CPU scores and picks 1M values at a time: where a score is stored (groups, the residual's score), a 4 MB
# scratch at any model size instead of 4 B per parameter, and no slower than the whole layout at once
CPU_SCORE_VALUES = 2 ** 20


def partition(layout: FlatLayout, rank: int, world: int) -> slice:
    """The rows rank ``rank`` of ``world`` scores when selection is partitioned (its equal block).

    Example:
        >>> partition(FlatLayout({"w": torch.zeros(5, 8)}, chunk=8), 1, 2)
        slice(3, 5, None)
    """
    own = layout.shard(rank, world)
    return slice(own.start, own.stop)


def score(kind: str, m: Tensor, residual: Tensor | None, windows: Tensor | None, target: int, beta1: float,
          out: Tensor | None = None, kernels: Kernels | None = None, max_window: int | None = None,
          late: Tensor | None = None) -> Tensor:
    """The score of the coordinates of ``m`` (any rows) for the mask of step ``target``.

    ``kind`` is a :attr:`ScapeConfig.resolved_score`: ``"age_momentum"`` (``|m| (n - 1)``, a window past
    ``max_window`` first: :func:`~scape_core.masks.age_momentum_score`), ``"momentum"`` (``|m|``) or
    ``"momentum_residual"`` (``|beta1 m + (1 - beta1) e_r|``). ``out``, ``late``: scratch buffers.

    Example:
        >>> score("momentum", torch.tensor([[-2.0, 1.0]]), None, None, target=5, beta1=0.9)
        tensor([[2., 1.]])
    """
    if kind == "momentum_residual":
        return momentum_residual_score(m, residual, beta1)
    if kind == "age_momentum":
        if kernels is not None and kernels.compiled and windows is not None:  # one fused pass
            return age_momentum_compiled(kernels, m, windows, target, max_window,
                                         out if out is not None else torch.empty_like(m))
        return age_momentum_score(m, windows, target, max_window, out=out, late=late)
    return torch.abs(m, out=out)


class MaskSelector:
    """The masks of upcoming sparse steps, chosen from replicated statistics (or this rank's rows).

    With a replicated score and replicated state every rank selects the whole mask itself and
    nothing is exchanged. Otherwise (a score that reads the residual, or sharded state) rank r
    selects the rows of its partition and one asynchronous all-gather of the int16 columns,
    waited for one step later, makes the mask common. On the CPU the rows are scored and selected
    in blocks of ``CPU_SCORE_VALUES`` values (a bounded score buffer; the same masks).

    Example:
        >>> layout = FlatLayout({"w": torch.zeros(4, 8)}, chunk=8)
        >>> config = ScapeConfig(sparsity=0.75, warmup_steps=2, ramp_steps=0, selection="groups")
        >>> selector = MaskSelector(layout, config)
        >>> m = torch.arange(32.0).view(4, 8)
        >>> selector.after_step(0, m, None, None, beta1=0.9)    # step 0 ended: selects step 2's mask
        >>> selector.mask_for(2).cols[0].tolist()     # the largest |m| of each group of 4 columns
        [3, 7]
        >>> selector.after_step(1, m, None, None, beta1=0.9)    # step 3's, without step 2's (being flushed)
        >>> sorted(selector.masks), selector.masks[3].cols[0].tolist()
        ([2, 3], [2, 6])
    """

    def __init__(self, layout: FlatLayout, config: ScapeConfig, *, rank: int = 0, world_size: int = 1,
                 process_group: dist.ProcessGroup | None = None, counters: dict[str, int] | None = None,
                 kernels: Kernels | None = None) -> None:
        self.layout, self.config, self.schedule = layout, config, config.schedule
        self.kernels = kernels  # the score's pass (None: eager)
        self.rank, self.world_size, self.process_group = rank, world_size, process_group
        self.partition = partition(layout, rank, world_size)  # rows this rank scores when partitioned
        self.whole = config.replicated_score and not config.shard_optimizer  # every rank selects everything
        self.counters = counters if counters is not None else {"mask_bytes": 0, "bytes_sent": 0}
        self.masks: dict[int, Mask] = {}  # step -> mask used at that step
        self._strided: dict[float, Mask] = {}
        self._pending: tuple[int, Any, Tensor] | None = None  # (step, work, gathered columns)
        self.scratch: Tensor | None = None  # the CPU's score buffer, one block of rows (see workspace)
        self.late_scratch: Tensor | None = None  # and the overdue term's
        self.block_rows = max(1, CPU_SCORE_VALUES // layout.chunk) if layout.device.type == "cpu" else layout.rows
        for density in self.schedule.densities():  # built now: their first use reads the device once
            layout.mask_shape(density)
        for rows in {(0, layout.rows), (self.partition.start, self.partition.stop)}:
            layout.partial_rows_in(*rows)
            for block in self.blocks(slice(*rows)):
                layout.partial_rows_in(block.start, block.stop)

    # ----- lookup ---------------------------------------------------------------------
    def mask_for(self, step: int) -> Mask | None:
        """The mask of ``step`` (``None`` on a dense step); waits for its all-gather if in flight."""
        if self.schedule.is_dense(step):
            return None
        if step not in self.masks:
            self.finish_pending()
            if step not in self.masks:
                if step >= self.schedule.first_selected():  # a step existed that should have picked it
                    raise RuntimeError(f"no SCAPE mask is scheduled for step {step}: was "
                                       "ScapeAdamS.step() skipped, or the state reloaded without its masks?")
                self.masks[step] = self.strided_mask(self.schedule.density_at(step))
        return self.masks[step]

    def strided_mask(self, density: float) -> Mask:
        """Evenly spaced picks: the mask of sparse steps no earlier step could select for."""
        if density not in self._strided:
            self._strided[density] = strided(self.layout, self.layout.mask_shape(density))
        return self._strided[density]

    def load(self, masks: dict[int, Mask]) -> None:
        """Replace the scheduled masks (a checkpoint's); an all-gather in flight is finished first."""
        self.finish_pending()
        self.masks = dict(masks)

    # ----- selection ------------------------------------------------------------------
    def after_step(self, done: int, momentum: Tensor, residual: Tensor | None, windows: Tensor | None,
                   beta1: float) -> None:
        """Step ``done`` ended: choose the mask it schedules, drop the masks of past steps.

        ``momentum`` and ``windows`` are the optimizer's ``(rows, chunk)`` buffers of the rows whose
        state this rank keeps (every row, or its partition when sharded); ``residual`` is this
        rank's, every row (``None`` before the first sparse step).
        """
        if self.schedule.dense:
            return
        self.finish_pending()
        target = self.schedule.target_after(done)
        if self.schedule.selects(target):
            shape = self.layout.mask_shape(self.schedule.density_at(target))
            scheduled = self.masks.get(target - 1) if self.config.mask_delay else None  # being flushed: not twice
            chosen = self.choose(target, shape.density, scheduled, momentum, residual, windows, beta1)
            if chosen is not None:
                self.masks[target] = chosen
        elif not self.schedule.is_dense(target):
            self.masks[target] = self.masks.get(target - 1) or self.strided_mask(self.schedule.density_at(target))
        if self.config.mask_delay == 0:
            self.finish_pending()
        self.masks = {s: m for s, m in self.masks.items() if s > done}
        if self._strided and done + 1 > self.schedule.first_selected():  # every later mask is selected
            self._strided.clear()

    def choose(self, target: int, density: float, scheduled: Mask | None, momentum: Tensor,
               residual: Tensor | None, windows: Tensor | None, beta1: float) -> Mask | None:
        """Score and pick the mask of ``target``: all of it, or this rank's rows (then ``None``: the
        partitions' all-gather is in flight and :meth:`finish_pending` completes the mask)."""
        shape = self.layout.mask_shape(density)
        rows = slice(0, self.layout.rows) if self.whole else self.partition
        sharded = self.config.shard_optimizer
        m = momentum if sharded or self.whole else momentum[rows]
        e = residual if residual is None or self.whole else residual[rows]
        w = windows if windows is None or sharded or self.whole else windows[rows]
        groups = self.config.selection == "groups"
        if self.fusable(shape, scheduled, w):  # one compiled pass: score, exclusion, picks (and the entries)
            excluded = None if scheduled is None else scheduled.cols[rows]
            own, entries = pick_compiled(self.kernels, m, w, target, self.window_limit(shape), excluded, self.layout,
                                         shape, rows, entries=self.whole)
        else:
            own, entries = self.pick(rows, shape, scheduled, m, e, w, target, beta1), None
        if self.whole:  # every rank selected the whole mask itself: nothing to exchange
            return Mask(shape.density, own, groups=groups, _narrow=entries)  # the pick's entries: the passes' dtype
        most = self.layout.block(self.world_size)  # rows of a partition (the last ones may have fewer)
        payload = torch.zeros(most, shape.k, dtype=torch.int16, device=own.device)
        payload[:own.shape[0]] = own
        wire = payload.view(torch.uint8)  # as bytes: gloo has no int16
        out = wire.new_empty(self.world_size * most, wire.shape[1])
        work = inflight.hold(all_gather_into_tensor(out, wire, group=self.process_group, async_op=True))
        nbytes = payload.numel() * payload.element_size()
        self.counters["mask_bytes"] += nbytes
        self.counters["bytes_sent"] += nbytes
        self._pending = (target, work, out)
        return None

    def fusable(self, shape: MaskShape, scheduled: Mask | None, windows: Tensor | None) -> bool:
        """Whether the compiled pick (:func:`~scape_core.masks.pick_compiled`) chooses this mask: compiled
        kernels, one pick per group of the age-weighted score, and the mask being flushed (if any) a
        groups mask of the same density. Otherwise (the first masks, a ramp's change of density, after
        a resume) :meth:`pick` does, with the same columns."""
        return (self.kernels is not None and self.kernels.compiled and self.config.selection == "groups"
                and self.config.resolved_score == "age_momentum" and windows is not None
                and (scheduled is None or (scheduled.groups and scheduled.density == shape.density)))

    def pick(self, rows: slice, shape: MaskShape, scheduled: Mask | None, m: Tensor, residual: Tensor | None,
             windows: Tensor | None, target: int, beta1: float) -> Tensor:
        """The ``(rows, k)`` int16 columns chosen for ``rows`` of the layout, whose ``m``, ``residual``
        and ``windows`` are given (those rows only): scored and selected a block at a time."""
        picked = []
        limit = self.window_limit(shape)  # None for a score without windows: no overdue scratch either
        kind = self.config.resolved_score
        fused = self.config.selection == "topk" and kind in ("age_momentum", "momentum")  # the C pick scores, CPU
        blocks = self.blocks(rows)  # one but on the CPU
        for block in blocks:
            at = slice(block.start - rows.start, block.stop - rows.start)  # the block's rows in the buffers given
            part = (lambda t: t) if len(blocks) == 1 else (lambda t: t[at])  # no view of all of them
            e = None if residual is None else part(residual)
            w = None if windows is None else part(windows)
            if fused:
                cols = select_age(part(m), w if kind == "age_momentum" else None, target, limit, self.layout, shape,
                                  scheduled, block)
                if cols is not None:
                    picked.append(cols)
                    continue
            s = score(kind, part(m), e, w, target, beta1,
                      out=self.workspace(block.stop - block.start), kernels=self.kernels,
                      max_window=limit, late=None if limit is None else self.workspace(block.stop - block.start, True))
            picked.append(SELECTIONS[self.config.selection](s, self.layout, shape, scheduled, block))
        return picked[0] if len(picked) == 1 else torch.cat(picked)

    def window_limit(self, shape: MaskShape) -> int | None:
        """The longest window at ``shape``'s density before a coordinate is overdue
        (:meth:`ScapeConfig.window_limit`)."""
        return self.config.window_limit(self.layout.chunk, shape.k)

    def finish_pending(self) -> None:
        """Wait for the partitions' all-gather in flight (if any) and file its mask."""
        if self._pending is None:
            return
        target, work, out = self._pending
        work.wait()
        cols = out.view(torch.int16)[:self.layout.rows]  # equal blocks: the ranks' rows in layout order
        self.masks[target] = Mask(self.schedule.density_at(target), cols, groups=self.config.selection == "groups")
        self._pending = None

    def blocks(self, rows: slice) -> list[slice]:
        """``rows`` cut into the blocks scored one at a time: all of them on a GPU, blocks of
        :data:`CPU_SCORE_VALUES` values on the CPU (the score's scratch is one block, not the layout).

        Example:
            >>> layout = FlatLayout({"w": torch.zeros(1500, 1024)}, chunk=1024)   # 1500 rows
            >>> MaskSelector(layout, ScapeConfig(sparsity=0.99)).blocks(slice(0, 1500))   # 1024 rows a block
            [slice(0, 1024, None), slice(1024, 1500, None)]
        """
        size = max(1, self.block_rows)
        return [slice(lo, min(lo + size, rows.stop)) for lo in range(rows.start, rows.stop, size)] or [rows]

    def workspace(self, rows: int, late: bool = False) -> Tensor | None:
        """A ``(rows, chunk)`` fp32 scratch buffer for the score (``rows`` at most one block; ``late``: a
        second one, for the overdue term). Kept on the CPU, where a fresh buffer this size costs more
        (page faults) than the arithmetic: 100 ms against 31 for 25M scores; on a GPU the caching
        allocator reuses a transient one."""
        if self.layout.device.type != "cpu":
            return None
        scratch = self.late_scratch if late else self.scratch
        if scratch is None or scratch.shape[0] < rows:
            scratch = torch.zeros(rows, self.layout.chunk, device=self.layout.device)
            if late:
                self.late_scratch = scratch
            else:
                self.scratch = scratch
        return scratch if scratch.shape[0] == rows else scratch[:rows]
