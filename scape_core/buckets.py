"""The regions a step's gradients are synchronized in, and the record of one step: the hand-off
from the hooks to the optimizer.

- :class:`Buckets`: each region resolved once (its parameters' gradient views, their views of the
  state's staging buffer, and where a flat coordinate sits in the region's buffer). A region is a
  DDP bucket (rebuilt when DDP rebuilds its buckets) or an FSDP2 parameter group's reduce-scatter
  output.
- :class:`Exchange`: one region's part of a sparse exchange (its buffer, the future DDP waits on).
- :class:`StepRecord`: one exchange (:mod:`scape_core.exchange`), and what the hooks did during
  the current backward (which gradients they synchronized, the finiteness verdicts, the exchanged
  means), read by the optimizer to apply the step.

Who writes what: the hooks (through :mod:`scape_core.exchange`, on the hook's thread) write
``send``, ``values``, ``finite``, the regions' buffers and the residual during the backward; the
optimizer reads the record and ``p.grad``, and returns to the residual what it did not apply
(:meth:`StepRecord.return_unapplied`); the state replaces the record at the end of the step. A
dense step's completion callbacks (gloo's thread) only append verdicts.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from scape_core import fused, wire
from scape_core.layout import FlatLayout, MaskShape, gather_spans, row_of, scatter_spans
from scape_core.masks import Mask


@dataclass
class BucketPlan:
    """One DDP bucket, resolved once: its parameters and their views in the bucket and in SCAPE's buffers."""

    names: tuple[str, ...]
    grads: list[Tensor]  # flat views of each parameter's gradient in the bucket buffer
    offsets: tuple[int, ...] = ()  # where each parameter's gradient starts in the bucket buffer
    residual_views: list[Tensor] | None = None  # the same parameters' residual views, once the residual exists
    staging_views: list[Tensor] | None = None  # and their views of the state's staging buffer

    def residuals(self, layout: FlatLayout, residual: Tensor) -> list[Tensor]:
        """This bucket's parameters' views of ``residual`` (resolved once per residual buffer)."""
        if self.residual_views is None:
            self.residual_views = layout.views(residual, list(self.names))
        return self.residual_views

    def staging(self, layout: FlatLayout, staging: Tensor) -> list[Tensor]:
        """This bucket's parameters' flat views of the state's staging buffer (resolved once)."""
        if self.staging_views is None or self.staging_views[0].untyped_storage().data_ptr() != staging.data_ptr():
            self.staging_views = layout.views(staging, list(self.names))
        return self.staging_views


class Buckets:
    """The hook's per-bucket plans, each parameter's gradient view in its bucket, and the wire plans."""

    def __init__(self, layout: FlatLayout, names: dict[int, str], wire_name: str, world_size: int,
                 wire_block: int, dtype: torch.dtype = torch.float32) -> None:
        self.layout, self.names = layout, names
        self.dtype = dtype  # the native wire's: the gradients' (fp32 if parameters mix dtypes)
        self.wire_name, self.world_size, self.wire_block = wire_name, world_size, wire_block
        self.plans: dict[tuple[int, int], BucketPlan] = {}
        self.views: dict[str, Tensor] = {}  # each parameter's gradient view in its DDP bucket
        # flat index of a coordinate + the shift of its row = its position in its bucket's buffer
        self.row_shift = torch.zeros(layout.rows, dtype=torch.long, device=layout.device)
        self._wire_plans: dict[int, wire.WirePlan] = {}
        self._staging: dict[tuple, Staging] = {}
        self._tables: dict[tuple[int, ...], tuple[tuple[BucketPlan, ...], fused.RowTable]] = {}

    def plan(self, bucket: dist.GradBucket) -> BucketPlan:
        """The bucket's plan, built at its first sight (and again after DDP rebuilds its buckets)."""
        buffer = bucket.buffer()
        key = (bucket.index(), buffer.data_ptr())
        found = self.plans.get(key)
        if found is not None:
            return found
        if buffer.is_sparse or not buffer.is_floating_point():
            names = [self.names[id(p)] for p in bucket.parameters()]
            kind = "sparse" if buffer.is_sparse else buffer.dtype
            raise TypeError(f"scape_hook needs dense floating-point gradients; {names} have {kind} gradients "
                            "(use nn.Embedding(sparse=False))")
        names = [self.names[id(p)] for p in bucket.parameters()]
        grads = list(bucket.gradients())
        offsets = [g.storage_offset() - buffer.storage_offset() for g in grads]  # where each starts in the bucket
        return self.region(key, names, grads, offsets)

    def region(self, key: tuple[int, int], names: list[str], grads: list[Tensor], offsets: list[int]) -> BucketPlan:
        """Resolve a region: parameters ``names`` whose gradients ``grads`` (views shaped like each
        parameter's, or its local shard's) start at ``offsets`` in the region's flat buffer.
        ``key``: the region's index and its buffer's address (a plan overlapping it is dropped)."""
        found = self.plans.get(key)
        if found is not None:
            return found
        rows, shifts = [], []
        layout = self.layout
        for name, g, offset in zip(names, grads, offsets):
            self.views[name] = g  # shaped like the parameter: the optimizer reads and writes through it
            first = layout.first_row[name]
            rows.append(torch.arange(first, first + layout.nrows[name]))
            shifts.append(torch.full((layout.nrows[name],), offset - first * layout.chunk))
        self.row_shift.index_copy_(0, torch.cat(rows).to(self.row_shift.device),
                                   torch.cat(shifts).to(self.row_shift.device))
        for stale in [k for k, old in self.plans.items() if not set(old.names).isdisjoint(names)]:
            del self.plans[stale]  # rebuilt (DDP's buckets, FSDP's new output): the old plan would keep it alive
        found = self.plans[key] = BucketPlan(tuple(names), [g.view(-1) for g in grads], tuple(offsets))
        return found

    def repoint(self, plan: BucketPlan, grads: list[Tensor]) -> None:
        """``plan``'s region moved to a new buffer with the same parameters at the same offsets: only
        its gradient views change (shaped like each parameter's, or its local shard's)."""
        plan.grads = [g.view(-1) for g in grads]
        self.views.update(zip(plan.names, grads))

    def staging(self, plans: tuple[BucketPlan, ...], shape: MaskShape,
                base: list[tuple[int, int]] | None = None) -> "Staging":
        """The plan of an exchange whose regions are ``plans`` (in hook order), at ``shape``'s density;
        ``base``: the exchange's spans of the mask's entries (``None``: all of them)."""
        key = (tuple(id(p) for p in plans), shape.density, None if base is None else tuple(base))
        if key not in self._staging:
            self._staging = {k: v for k, v in self._staging.items() if k[0] == key[0] or k[2] != key[2]}  # rebuilt
            self._staging[key] = Staging(self.layout, plans, shape, base)
        return self._staging[key]

    def row_table(self, plans: tuple[BucketPlan, ...]) -> fused.RowTable:
        """Where each layout row sits among ``plans``' gradient views, in order (built once per set of plans)."""
        found = self._tables.get(tuple(id(p) for p in plans))
        if found is None or any(a is not b for a, b in zip(found[0], plans)):
            found = (plans, fused.RowTable.of(self.layout, [n for p in plans for n in p.names]))
            self._tables = {tuple(id(p) for p in plans): found}  # the buckets of one step: DDP's current ones
        return found[1]

    def positions(self, entries: Tensor) -> Tensor:
        """Where the flat ``entries`` sit in their buckets' buffers (:func:`positions_in_regions`)."""
        return positions_in_regions(entries, self.row_shift, self.layout.chunk)

    def wire_plan(self, entries: int) -> wire.WirePlan:
        """The shape of a compact buffer of ``entries`` values on this run's encoded wire (built once)."""
        if entries not in self._wire_plans:
            self._wire_plans[entries] = wire.WirePlan(self.wire_name, entries, self.world_size, self.wire_block)
        return self._wire_plans[entries]

    def forget_residual_views(self) -> None:
        """The residual buffer was replaced (a loaded state): views are resolved again at the next step."""
        for plan in self.plans.values():
            plan.residual_views = None


def positions_in_regions(entries: Tensor, row_shift: Tensor, chunk: int) -> Tensor:
    """Where flat ``entries`` sit in their regions' buffers: each plus its row's shift
    (:attr:`Buckets.row_shift`), int64. Torch operators only: the compiled passes call it too.

    Example:
        >>> positions_in_regions(torch.tensor([1, 9], dtype=torch.int32), torch.tensor([5, -8]), chunk=8)
        tensor([6, 1])
    """
    return entries.long() + row_shift.index_select(0, row_of(entries, chunk))


class RegionSpan(NamedTuple):
    """Entries ``[lo, hi)`` of an exchange sit in region ``region`` (an index into its regions); each at
    its flat index plus its row's shift (:attr:`Buckets.row_shift`)."""

    region: int
    lo: int
    hi: int


class Staging:
    """Which region every entry of an exchange sits in, for the compiled passes
    (:func:`scape_core.exchange.stage_pass`, :func:`scape_core.exchange.finish_pass`).

    ``spans``: :class:`RegionSpan` in entry order, adjacent ones of a region merged (a DDP bucket's
    parameters are neighbours in the layout: its full rows are one span, its shorter rows another),
    so a pass indexes each region a few times, not once per parameter. ``base``: the exchange's
    spans of the mask's entries (``None``: every entry, in mask order). Built once per region
    structure and density; plain ints, so a compiled pass bakes them in.

    Example:
        >>> layout = FlatLayout({"w": torch.zeros(20), "b": torch.zeros(3)}, chunk=8)
        >>> plans = (BucketPlan(("b", "w"), [], (0, 3)),)        # one bucket: b first, then w
        >>> Staging(layout, plans, layout.mask_shape(0.25)).spans  # w's full rows, then both short rows
        (RegionSpan(region=0, lo=0, hi=6),)
    """

    def __init__(self, layout: FlatLayout, plans: tuple[BucketPlan, ...], shape: MaskShape,
                 base: list[tuple[int, int]] | None = None) -> None:
        pieces = sorted((local(base, lo), j, local(base, lo) + hi - lo) for j, plan in enumerate(plans)
                        for lo, hi in shape.ranges(plan.names))
        covered = sum(hi - lo for lo, _, hi in pieces)
        total = shape.entries if base is None else sum(hi - lo for lo, hi in base)
        if covered != total:  # every synchronized parameter is in exactly one region
            raise RuntimeError(f"the regions hold {covered} of the exchange's {total} entries")
        spans: list[RegionSpan] = []
        for lo, j, hi in pieces:
            if spans and spans[-1].region == j and spans[-1].hi == lo:
                spans[-1] = RegionSpan(j, spans[-1].lo, hi)
            else:
                spans.append(RegionSpan(j, lo, hi))
        self.spans: tuple[RegionSpan, ...] = tuple(spans)


def local(base: list[tuple[int, int]] | None, at: int) -> int:
    """Where entry ``at`` of the mask sits in an exchange of the mask's spans ``base`` (``None``: all).

    Example:
        >>> local([(2, 4), (10, 12)], 11), local(None, 11)
        (3, 11)
    """
    if base is None:
        return at
    offset = 0
    for lo, hi in base:
        if lo <= at < hi:
            return offset + at - lo
        offset += hi - lo
    raise ValueError(f"entry {at} is outside the exchange's spans {base}")


@dataclass
class Exchange:
    """One region's part of a sparse step's exchange: its buffer, and the future DDP waits on."""

    bucket: BucketPlan
    buffer: Tensor  # the region's buffer (holds the mean on the mask, zeros elsewhere, once the exchange finished)
    future: torch.futures.Future


@dataclass
class StepRecord:
    """One sparse exchange and what the hooks recorded during the current step's backward, for the
    optimizer step (DDP: the step's one exchange of every bucket; FSDP2: the step, each parameter
    group's exchange absorbed)."""

    buckets: Buckets
    synced: set[str] = field(default_factory=set)
    finite: list[Tensor] = field(default_factory=list)  # 0-dim bools: each exchange's (dense bucket's) means finite
    local: list[Tensor] = field(default_factory=list)  # sparse: 0-dim bools, this rank's gradients were finite
    values: Tensor | None = None  # sparse: the mean exchanged at each entry (0 where an exchange was not finite)
    send: Tensor | None = None  # sparse: a_r = g_r + e_r at each entry (fp32), what this rank sends
    exchanges: list[Exchange] = field(default_factory=list)  # sparse: one per region
    entries: Tensor | None = None  # sparse: the flat indices of the exchange's entries
    rows: tuple[int, int] | None = None  # sparse: the layout rows the exchange's regions cover (None: every row)
    staging: Staging | None = None  # sparse, compiled kernels: where the entries sit in the regions
    regions: tuple[list[Tensor], fused.RowTable] | None = None  # sparse, eager on the CPU: what the C loops walk
    applied_names: list[str] = field(default_factory=list)  # parameters with a gradient at the optimizer step
    density: float | None = None  # sparse: the mask's
    base: list[tuple[int, int]] | None = None  # the exchange's spans of the mask's entries (None: every entry)
    dtype: torch.dtype | None = None  # the native wire's (None: the buckets')
    returns_skipped: bool = True  # its finish returns a skipped step's means (one exchange per step)
    # the step's hook calls, values and bytes (ScapeStateBase.count): the counters take them when it completes
    counts: Counter = field(default_factory=Counter)
    # what a second sync before the optimizer step says: a template of {name}, or a function of the name
    already: str | Callable[[str], str] = (
        "scape_hook synchronized the same gradients twice without ScapeAdamS.step() in between (e.g. {name!r}): "
        "every sync flushes residuals that only the SCAPE optimizer applies. Use ScapeAdamS, and accumulate "
        "gradients under ddp.no_sync().")

    def open(self, mask: Mask, layout: FlatLayout, base: list[tuple[int, int]] | None = None,
             narrow: bool = False, rows: tuple[int, int] | None = None) -> None:
        """The exchange's entries are known: ``mask``'s, or its spans ``base`` of them, in the layout
        rows ``rows`` (``None``: every row); ``narrow``: the entries as the compiled passes read them
        (:meth:`~scape_core.masks.Mask.flat`). Once per exchange."""
        if self.entries is None:
            self.density, self.base, self.rows = mask.density, base, rows
            every = mask.flat(layout, narrow)
            self.entries = every if base is None else gather_spans(every, base)

    def add_region(self, plan: BucketPlan, buffer: Tensor) -> Exchange:
        """A region joins the exchange (its gradients are in ``buffer``); its future completes when the
        exchange finished (:func:`scape_core.exchange.run`)."""
        device = buffer.device
        future = torch.futures.Future(devices=[device]) if device.type == "cuda" else torch.futures.Future()
        part = Exchange(plan, buffer, future)
        self.exchanges.append(part)
        return part

    def grads_and_staging(self, layout: FlatLayout, staging: Tensor) -> tuple[list[Tensor], list[Tensor]]:
        """Every region's flat gradient views, and the same parameters' views of the ``staging`` buffer."""
        grads: list[Tensor] = []
        views: list[Tensor] = []
        for x in self.exchanges:
            grads += x.bucket.grads
            views += x.bucket.staging(layout, staging)
        return grads, views

    def absorb(self, part: "StepRecord", spans: list[tuple[int, int]], entries: Tensor) -> None:
        """A region exchanged on its own (FSDP2: each parameter group in its hook) joins the step:
        its spans become ``spans`` of the mask's ``entries``; a skipped step's means then go back
        in the optimizer (:meth:`return_unapplied`), once every region's verdict is known."""
        self.returns_skipped = False
        if self.values is None:
            self.entries = entries
            self.values = torch.zeros(entries.numel(), device=entries.device)
        scatter_spans(self.values, spans, part.values)
        self.exchanges += part.exchanges
        self.finite += part.finite
        self.local += part.local

    def sync(self, names: tuple[str, ...]) -> None:
        """A bucket's gradients are being synchronized (a hook call, counted in :attr:`counts`); refuses
        a second sync before the optimizer step."""
        again = self.synced.intersection(names)
        if again:
            name = sorted(again)[0]
            raise RuntimeError(self.already(name) if callable(self.already) else self.already.format(name=name))
        self.synced.update(names)
        self.counts["hook_calls"] += 1

    def count(self, values: int, nbytes: int, dense_bytes: int) -> None:
        """Add a collective of the step (its values and bytes, and the bytes dense DDP would have sent):
        the state's counters take :attr:`counts` when the step completes, so an interrupted step (an error
        between backward and the optimizer step) is not counted."""
        self.counts["values_sent"] += values
        self.counts["bytes_sent"] += nbytes
        self.counts["dense_bytes"] += dense_bytes

    def return_unapplied(self, residual: Tensor | None, entries: Tensor, applied: Tensor) -> None:
        """Exchanged values not applied go back into ``residual``: nothing sent is lost. ``applied``:
        bool, 0-dim or per entry (the optimizer's: entries of parameters that had no gradient at
        the step; on a skipped DDP step nothing was exchanged that counts, see
        :func:`scape_core.exchange.finish`)."""
        if self.values is not None and residual is not None:
            residual.view(-1).index_add_(0, entries, self.values.masked_fill(applied, 0.0))
