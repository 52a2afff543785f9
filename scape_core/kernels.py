"""The step's passes over every coordinate, eager (the readable reference) or compiled into fused loops.

A sparse step touches every coordinate a few times: the residual takes the bucket's gradient,
the score reads ``m`` and the windows, every parameter is decayed and the mask's entries
updated; a dense AdamS step reads the parameters, gradients and ``m``. Eager, each of those is
several operators, each one pass over memory (``benchmarks/traffic_bench.py`` counts them).
``ScapeConfig(kernels="compiled")`` runs them as ``torch.compile``'d pure functions of the flat
buffers instead: inductor fuses each into one loop per tensor (C++ on the CPU, Triton on CUDA),
so each coordinate is read and written once per pass. Tensors a pass mutates are written in
place; where one graph would write a tensor through a temporary of its size, the work is split
into graphs of their own (:func:`decay_pass` and :func:`update_pass`, :func:`residual_pass`; the
buckets' zeroing stays an eager multi-tensor operator, see :func:`finish_pass`).

:class:`Kernels` holds the compiled passes; the eager code they replace is the reference the
tests compare them against. Compiled functions take lists of tensors and 0-dim tensors for every
value that changes between steps (the learning rate, the step), so a run compiles each pass
once per shape (once per mask density and bucket structure for the sparse passes), not per step.

What it costs: the first call of each pass compiles it (seconds to minutes on a CPU; see
``docs/benchmarks.md``), once per process; inductor caches the generated code on disk, so a
second run of the same model compiles faster. Where no compiler works (no C++ compiler, no
Triton) the first call raises, naming ``kernels="eager"`` as the fix: nothing falls back silently.
"""

from __future__ import annotations

import contextlib
import functools
import time
import types
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import Tensor

from scape_core import wire
from scape_core.buckets import positions_in_regions
from scape_core.layout import FlatLayout, MaskShape, row_of, short_group_index
from scape_core.masks import OVERDUE, excluded_key
from scape_core.wire import WirePlan

KERNELS = ("eager", "compiled")

Piece = tuple[int, int, int]  # a parameter's entries (ParamPiece: param, lo, hi)
Span = tuple[int, int, int]  # a region's entries (RegionSpan: region, lo, hi), at flat index + row shift


# inductor's own deterministic mode (torch >= 2.8): no choice between kernels that differ in numerics is made
# by timing them on the device, which could choose differently on each rank
INDUCTOR_OPTIONS = {"deterministic": True} if hasattr(torch._inductor.config, "deterministic") else {}


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    """torch's deterministic algorithms on for the duration, the caller's setting restored after.

    SCAPE's compiled passes compute replicated state (masks, ``m``, statistics, parameters), which must
    be bit-identical on every rank and run: each is compiled and run inside this, whatever the user set
    (inductor then lowers indexed writes to deterministic kernels and filters its reduction configs),
    and its graph's guard on the setting holds at every call. Uninitialized memory is not filled (the
    passes read none), so this costs no extra writes.
    """
    mode = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
        torch.utils.deterministic.fill_uninitialized_memory = fill


def compile_kernel(fn: Callable, name: str) -> Callable:
    """``torch.compile`` of one pass (the one place SCAPE compiles; benchmarks wrap it to count it),
    compiled and run under :func:`deterministic`.

    Each call compiles a fresh copy of ``fn``'s code: dynamo keeps its compiled graphs per code
    object, at most 8 (``recompile_limit``; past it ``fullgraph=True`` fails), so every state,
    density and bucket structure gets its own copy rather than sharing one across a process.
    """
    fresh = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    compiled = torch.compile(fresh, fullgraph=True, dynamic=False, options=dict(INDUCTOR_OPTIONS))
    state = {"ready": False}

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if state["ready"]:
            with deterministic():
                return compiled(*args, **kwargs)
        start = time.perf_counter()
        try:
            with deterministic():
                out = compiled(*args, **kwargs)
        except Exception as e:  # the first call compiles: say what failed and what to do
            raise RuntimeError(f"ScapeConfig(kernels='compiled'): torch.compile could not build SCAPE's {name} "
                               f"pass ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                               "use kernels='eager'") from e
        state["ready"] = True
        call.first_call_seconds = time.perf_counter() - start  # type: ignore[attr-defined]
        return out

    call.first_call_seconds = None  # type: ignore[attr-defined]
    return call


# ----- the passes, as pure functions -------------------------------------------------------
def adams_pass(params: list[Tensor], grads: list[Tensor], momenta: list[Tensor], lr: Tensor, decay: Tensor,
               beta1: float, beta2: float, eps: float) -> None:
    """One AdamS step per tensor (``decay = 1 - lr * weight_decay``): ``m`` and ``theta`` in one loop each."""
    for p, g, m in zip(params, grads, momenta):
        g32 = g.float()
        v = beta2 * m * m + (1 - beta2) * g32 * g32  # previous m, current gradient
        m.lerp_(g32, 1 - beta1)
        p.copy_(p.float() * decay - lr * m / (v.sqrt() + eps))


def age_score(m: Tensor, synced_at: Tensor, before: Tensor, due: Tensor | None) -> Tensor:
    """:func:`scape_core.masks.age_momentum_score` as one expression (a compiled pass writes it nowhere):
    ``|(synced_at - before) m|``, ``before = target - 1``, with ``|m|`` read as ``OVERDUE`` for a
    coordinate last exchanged before ``due = target - max_window`` (0-dim tensors)."""
    if due is not None:
        m = m.masked_fill(synced_at < due, OVERDUE)
    return ((synced_at - before) * m).abs()


def age_momentum_pass(m: Tensor, synced_at: Tensor, before: Tensor, due: Tensor | None, out: Tensor) -> Tensor:
    """The age score (:func:`age_score`) into ``out``."""
    return out.copy_(age_score(m, synced_at, before, due))


def best_in_groups(keys: Tensor) -> Tensor:
    """The position of the largest int32 key along the last dimension, ties to the lowest, as one max:
    each key widened to int64 with its reversed position in the low bits. Exact; in a compiled pass a
    max reduces faster than an argmax (no index carried), and the widened keys are never stored.

    Example:
        >>> best_in_groups(torch.tensor([[3, 7, 7], [-5, -5, -9]], dtype=torch.int32))
        tensor([1, 0])
    """
    width = keys.shape[-1]
    back = (width - 1) - torch.arange(width, device=keys.device)
    best = ((keys.long() << 32) | back).amax(-1)
    return (width - 1) - (best & 0xFFFFFFFF)


def pick_pass(m: Tensor, synced_at: Tensor, before: Tensor, due: Tensor | None, excluded: Tensor | None, k: int,
              short: tuple[Tensor, Tensor, Tensor] | None, widest: int,
              entry_rows: tuple[Tensor, Tensor, Tensor] | None,
              index_dtype: torch.dtype = torch.int64) -> tuple[Tensor, Tensor | None]:
    """``selection="groups"`` of the age score (:func:`age_score`) in one pass over ``m`` and the windows:
    the score, the exclusion and each group's best, without writing the score. As
    :func:`scape_core.masks.select_groups` (the same columns), for ``excluded`` (the mask being
    flushed, ``(rows, k)`` columns) ``None`` or a groups mask of the same ``k``: its column of group
    ``j`` lies in group ``j``, so the exclusion is a comparison in each group, not a scatter.

    ``short``: the shorter rows' ``(index in these rows, length, picks)``
    (:meth:`~scape_core.layout.MaskShape.short_rows`), cut into their own groups here (``widest``:
    the widest); ``entry_rows``: ``(full rows, short rows, short slots that are entries)`` to return
    the mask's entries too (every row selected), as ``index_dtype``. Returns ``(columns (rows, k) int16,
    entries or None)``.
    """
    rows, chunk = m.shape
    keys = age_score(m, synced_at, before, due).view(torch.int32)  # the bits order scores >= 0
    size, wider = divmod(chunk, k)  # the first `wider` groups hold size + 1 columns
    parts = []
    for lo, hi, first, n, width in ((0, wider * (size + 1), 0, wider, size + 1),
                                    (wider * (size + 1), chunk, wider, k - wider, size)):
        if not n:
            continue
        starts = torch.arange(lo, hi, width, device=m.device)
        part = keys[:, lo:hi].unflatten(1, (n, width))
        if excluded is not None:
            own = excluded[:, first:first + n].long() - starts  # each group's excluded offset
            hit = torch.arange(width, device=m.device) == own[..., None]
            part = torch.where(hit, excluded_key(part), part)
        parts.append(best_in_groups(part) + starts)
    cols = parts[0] if len(parts) == 1 else torch.cat(parts, 1)
    if short is not None:  # each shorter row: `count` groups over its `length`, computed here, not read
        local, length, count = short
        index = short_group_index(length, count, k, widest, chunk)
        short_keys = keys.index_select(0, local).gather(1, index.flatten(1)).view(index.shape)
        if excluded is not None:
            hit = index == excluded.index_select(0, local).long()[..., None]
            short_keys = torch.where(hit, excluded_key(short_keys), short_keys)
        picked = index.gather(2, best_in_groups(short_keys)[..., None]).squeeze(-1)
        cols = cols.index_copy(0, local, picked)
    entries = None
    if entry_rows is not None:  # Mask.flat: every full row's picks, then the shorter rows' counted ones
        full_rows, short_rows, short_slots = entry_rows
        full = (cols.index_select(0, full_rows) + full_rows[:, None] * chunk).view(-1)
        rest = (cols.index_select(0, short_rows) + short_rows[:, None] * chunk).view(-1).index_select(0, short_slots)
        entries = torch.cat([full, rest]).to(index_dtype)
    return cols.to(torch.int16), entries


def stage_pass(buffers: list[Tensor], residual: Tensor | None, entries: Tensor, row_shift: Tensor,
               spans: Sequence[Span], chunk: int) -> tuple[Tensor, Tensor]:
    """A sparse step's compact buffer from every bucket at once: ``g + e`` at the mask's entries (fp32,
    in entry order), NaN where this rank's bucket is not finite; returns it and the buckets' verdicts.
    ``spans``: :attr:`scape_core.buckets.Staging.spans`; ``row_shift``:
    :attr:`~scape_core.buckets.Buckets.row_shift`."""
    finite = torch.stack([torch.isfinite(b).all() for b in buffers])
    at = positions_in_regions(entries, row_shift, chunk)
    parts = []
    for j, lo, hi in spans:  # per span: in a graph, a per-entry mask (a cat of expanded verdicts) is 4x slower
        part = buffers[j].index_select(0, at[lo:hi]).float()
        if residual is not None:
            part = part + residual.view(-1).index_select(0, entries[lo:hi])
        parts.append(torch.where(finite[j], part, float("nan")))
    return torch.cat(parts), finite


def residual_pass(residuals: list[Tensor], grads: list[Tensor], keep: Tensor) -> None:
    """``e_r += g_r`` per parameter if the step went through (``keep``, 0-dim bool), in place: the
    non-finite drop and the add in one loop. ``residuals`` are views of one buffer that do not
    overlap, passed as inputs: the graph writes nothing else of that buffer, so each is written in
    place (``finish_pass``)."""
    for e, g in zip(residuals, grads):
        e.copy_(torch.where(keep, e + g.float(), e))


def finish_pass(buffers: list[Tensor], residual: Tensor | None, entries: Tensor, reduced: Tensor,
                kept: Tensor | None, ok: Tensor, row_shift: Tensor, spans: Sequence[Span], chunk: int) -> Tensor:
    """After the exchange, the residual's add of the gradients and the buckets' zeroing, every bucket
    at once: if the step went through (``ok``), the residual keeps ``kept`` (or 0) at the entries and
    every bucket gets the mean there; if not, the residual stays and the buckets hold zeros. Returns
    the means (fp32; 0 on a dropped step). As :func:`scape_core.exchange.finish`. ``entries`` may be
    int32 (a mask's narrow entries, :meth:`~scape_core.masks.Mask.flat`), as in every pass that takes them.

    The residual's add is a graph of its own (:func:`residual_pass`) and the zeroing an eager
    multi-tensor operator. In this graph an add into each parameter's slice of the residual (which
    it also writes at the entries) is functionalized into copies of the whole buffer (measured at
    10M parameters: 0.5-2 s a step instead of 20-35 ms; ``docs/benchmarks.md``), and a bucket zeroed
    and then written at the entries in one graph is written through a temporary of its size,
    copied back at the end (inductor's generated code).
    """
    mean = torch.where(ok, reduced, 0.0)
    if residual is not None:  # one write: several index_copy_ into one input would go through a copy of it
        flat, index = residual.view(-1), entries.long()  # index_copy_ takes int64 (converted as it reads)
        now = torch.zeros_like(mean) if kept is None else kept
        flat.index_copy_(0, index, torch.where(ok, now, flat.index_select(0, index)))
    at = positions_in_regions(entries, row_shift, chunk)
    for j, lo, hi in spans:
        buffers[j].index_copy_(0, at[lo:hi], mean[lo:hi].to(buffers[j].dtype))
    return mean.float()


def within_parameters(entries: Tensor, row_start: Tensor, chunk: int) -> Tensor:
    """Each flat entry's index in its own parameter (``row_start``: :attr:`~scape_core.layout.FlatLayout.row_start`)."""
    return entries - row_start.index_select(0, row_of(entries, chunk))


def gather_pass(grads: list[Tensor], entries: Tensor, row_start: Tensor, chunk: int,
                pieces: Sequence[Piece]) -> Tensor:
    """The gradient at every mask entry (fp32), read from each tensor where its entries fall
    (``pieces``: :class:`~scape_core.layout.ParamPiece`): one index per parameter's piece."""
    at = within_parameters(entries, row_start, chunk)
    return torch.cat([grads[i].reshape(-1).index_select(0, at[lo:hi]).float() for i, lo, hi in pieces])


def decay_pass(params: list[Tensor], decay: list[Tensor | None]) -> None:
    """``theta *= decay`` per tensor (``None``: no decay), in place: one multi-tensor multiply per factor
    (a parameter group's)."""
    by_factor: list[tuple[Tensor, list[Tensor]]] = []
    for p, d in zip(params, decay):
        if d is None:
            continue
        same = next((members for factor, members in by_factor if factor is d), None)
        if same is None:
            by_factor.append((d, [p]))
        else:
            same.append(p)
    for d, members in by_factor:
        torch._foreach_mul_(members, d)


def update_pass(params: list[Tensor], entries: Tensor, u: Tensor, scale: list[Tensor], row_start: Tensor,
                chunk: int, pieces: Sequence[Piece]) -> None:
    """``theta[j] += scale * u[j]`` at the entries, in place (``scale * u`` once per parameter group's
    scale, then one indexed add per parameter's piece).

    A pass of its own, not the decay's: in one graph, an in-place multiply and then an indexed add
    into the same tensor is compiled into a copy of the whole tensor written back at the end
    (seen in inductor's generated code: 8 B/param more), each alone is in place.
    """
    at = within_parameters(entries, row_start, chunk)
    scaled: list[tuple[Tensor, Tensor]] = []  # (a group's scale, u times it)
    for i, lo, hi in pieces:
        step = next((v for s, v in scaled if s is scale[i]), None)
        if step is None:
            step = u * scale[i]
            scaled.append((scale[i], step))
        p = params[i].view(-1)
        p.index_add_(0, at[lo:hi], step[lo:hi].to(p.dtype))


def masked_update_pass(rule: Any, momentum: Tensor, statistics: dict[str, Tensor], windows: Tensor | None,
                       local: Tensor, s: Tensor, applied: Tensor, step: Tensor, beta1: float, beta2: float,
                       eps: float) -> Tensor:
    """The update rule on the mask's entries (``local``: their flat indices in the state's buffers, which
    may be given flat): reads ``m``, the statistics and the windows there, writes them back where
    ``applied``, marks the entries exchanged at ``step``; returns ``u`` (0 where not applied). As
    ``ScapeAdamS``'s eager path."""
    local = local.long()  # index_copy_ takes int64 (a no-op for int64 entries)
    if windows is not None:
        windows = _flat(windows)
        last = windows.index_select(0, local)
        windows.index_copy_(0, local, torch.where(applied, step, last))
        n = step - last
    else:
        n = torch.ones_like(s)
    momentum = _flat(momentum)
    m = momentum.index_select(0, local)
    flats = {k: _flat(b) for k, b in statistics.items()}
    stats = {k: b.index_select(0, local) for k, b in flats.items()}
    u, m_new, stats_new = rule.update(s, n, m, stats, beta1=beta1, beta2=beta2, eps=eps)
    momentum.index_copy_(0, local, torch.where(applied, m_new, m))
    for key, value in stats_new.items():
        flats[key].index_copy_(0, local, torch.where(applied, value, stats[key]))
    return u.masked_fill(~applied, 0.0)


def _flat(buffer: Tensor) -> Tensor:
    """``buffer`` as 1-D (itself if it is: an eager caller passes the views it keeps)."""
    return buffer if buffer.dim() == 1 else buffer.view(-1)


def sparse_step_pass(rule: Any, params: list[Tensor], grads: list[Tensor], momentum: Tensor,
                     statistics: dict[str, Tensor], windows: Tensor | None, entries: Tensor, applied: Tensor,
                     step: Tensor, decay: list[Tensor | None], row_start: Tensor, chunk: int,
                     pieces: Sequence[Piece], beta1: float, beta2: float, eps: float) -> Tensor:
    """A replicated sparse step's optimizer half but the update: the window sums read from ``p.grad``
    (:func:`gather_pass`), the rule (:func:`masked_update_pass`) and the decay (:func:`decay_pass`);
    returns ``u`` for :func:`update_pass`. (A skipped step's exchanged values went back into the
    residual in :func:`finish_pass`.)"""
    s = gather_pass(grads, entries, row_start, chunk, pieces)
    u = masked_update_pass(rule, momentum, statistics, windows, entries, s, applied, step, beta1, beta2, eps)
    decay_pass(params, decay)
    return u


def wire_send_pass(plan: WirePlan, values: Tensor) -> tuple[Tensor, Tensor]:
    """An encoded wire's first stage: ``values`` (``(entries,)`` fp32) padded, cut into segments and
    encoded; returns ``(bytes to send, (W, row_bytes); what the encoding rounded away, (entries,))``."""
    segments = wire.pad(plan, values)
    send, decoded = wire.encode_decoded(plan, segments)
    return send, segments.sub_(decoded).view(-1)[:plan.entries]


def wire_own_pass(plan: WirePlan, received: Tensor, kept: Tensor) -> Tensor:
    """The owner's stage: the mean of every rank's copy of its segment, encoded; returns the encoded
    mean and adds ``W`` times what that encoding rounded away to ``kept`` (this rank's share of the
    send buffer's rounding, its segment's entries: the owner's residual keeps it), in place."""
    mean = wire.owner_mean(plan, received)
    own, decoded = wire.encode_decoded(plan, mean)
    rounded = mean.sub_(decoded).mul_(plan.world).view(-1)
    kept.add_(rounded[:kept.numel()])
    return own


def wire_decode_pass(plan: WirePlan, gathered: Tensor) -> Tensor:
    """Every owner's encoded mean (``(W, row_bytes)``) decoded: the step's means, ``(entries,)``."""
    return wire.decode(plan, gathered).view(-1)[:plan.entries]


class CompiledWire:
    """:class:`scape_core.wire.WireBuffers`'s stages as the compiled passes (:func:`wire_send_pass`,
    :func:`wire_own_pass`, :func:`wire_decode_pass`), the same interface."""

    def __init__(self, kernels: "Kernels", plan: WirePlan, rank: int, device: torch.device) -> None:
        self.kernels, self.plan = kernels, plan
        self.received = torch.empty(plan.world, plan.row_bytes, dtype=torch.uint8, device=device)
        self.gathered = torch.empty(plan.world * plan.row_bytes, dtype=torch.uint8, device=device)
        self.lo = rank * plan.segment  # the owner's segment among the entries
        self.hi = max(self.lo, min(self.lo + plan.segment, plan.entries))
        self._kept: Tensor | None = None

    def send(self, values: Tensor) -> tuple[Tensor, Tensor]:
        sent, self._kept = self.kernels._fn("wire", wire_send_pass, self.plan)(self.plan, values)
        return sent, self._kept

    def own_mean(self) -> Tensor:
        kept = self._kept[self.lo:self.hi]
        return self.kernels._fn("wire_own", wire_own_pass, (self.plan, kept.numel()))(self.plan, self.received, kept)

    def decode_gathered(self) -> Tensor:
        gathered = self.gathered.view(self.plan.world, self.plan.row_bytes)
        return self.kernels._fn("wire_decode", wire_decode_pass, self.plan)(self.plan, gathered)


class Kernels:
    """SCAPE's passes over every coordinate, eager or compiled (:data:`KERNELS`).

    Example:
        >>> kernels = Kernels("eager")
        >>> codec = kernels.wire(WirePlan("int8", entries=4, world=1, block=4), rank=0, device=torch.device("cpu"))
        >>> sent, kept = codec.send(torch.tensor([1.0, -2.0, 0.5, 0.0]))
        >>> _ = codec.received.copy_(sent), codec.gathered.copy_(codec.own_mean())  # as the collectives would
        >>> codec.decode_gathered()             # 127 steps of max / 127
        tensor([ 1.0079, -2.0000,  0.5039,  0.0000])
        >>> kernels.compiled, kernels.built
        (False, ())
    """

    def __init__(self, mode: str = "eager") -> None:
        if mode not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {mode!r}")
        self.mode = mode
        self.compiled = mode == "compiled"
        self._fns: dict[str, Callable] = {}
        self._scalars: dict[tuple[str, torch.device], Tensor] = {}  # scalar() and constant()
        self._wire: tuple[Any, Any] | None = None  # wire(): the last plan's stages

    @property
    def built(self) -> tuple[str, ...]:
        """The compiled passes that ran so far (each compiled at its first call), in that order."""
        return tuple(dict.fromkeys(slot.split(":")[0] for slot in self._fns)) if self.compiled else ()

    @property
    def compile_seconds(self) -> dict[str, float]:
        """Seconds the first calls of each compiled pass took (its compiles, or loads from inductor's
        cache; summed over its copies: one per density, bucket structure or wire plan)."""
        out: dict[str, float] = {}
        for slot, f in self._fns.items():
            if getattr(f, "first_call_seconds", None) is not None:
                name = slot.split(":")[0]
                out[name] = out.get(name, 0.0) + f.first_call_seconds
        return out

    def _fn(self, name: str, fn: Callable, key: Any = None) -> Callable:
        """The pass ``name`` (one compiled copy per ``key``: what its baked-in constants depend on)."""
        slot = name if key is None else f"{name}:{key}"
        if slot not in self._fns:
            self._fns[slot] = compile_kernel(fn, name) if self.compiled else fn
        return self._fns[slot]

    def scalar(self, key: str, value: float, device: torch.device, dtype: torch.dtype = torch.float64) -> Tensor:
        """A 0-dim tensor holding ``value`` (one per key, refilled): a compiled pass reads it, not a constant."""
        slot = self._scalars.get((key, device))
        if slot is None:
            slot = self._scalars[(key, device)] = torch.zeros((), dtype=dtype, device=device)
        return slot.fill_(value)

    def constant(self, value: float, device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
        """A 0-dim tensor holding ``value``, made once and never written: an operand of ``torch.where``
        that costs no operator per call (a Python number there is made into a tensor each time)."""
        key = (f"constant:{value}", device)
        if key not in self._scalars:
            self._scalars[key] = torch.full((), value, dtype=dtype, device=device)
        return self._scalars[key]

    # compiled only: their eager forms are the callers' own code (AdamS's foreach step, the
    # selector's score and picks, the hook's per-bucket staging and finish)
    def adams(self, params: list[Tensor], grads: list[Tensor], momenta: list[Tensor], *, lr: float, beta1: float,
              beta2: float, eps: float, weight_decay: float) -> None:
        """One AdamS step, one fused loop per tensor (eager: :func:`scape_core.adams.adams_foreach`)."""
        if params:
            cpu = torch.device("cpu")
            # one compiled copy per set of shapes and dtypes (e.g. per parameter group): dynamo keeps at most 8
            # graphs per copy, so layer-wise learning rates over many groups would exhaust a single one
            key = tuple((tuple(p.shape), p.dtype, g.dtype) for p, g in zip(params, grads))
            self._fn("AdamS", adams_pass, hash(key))(params, grads, momenta, self.scalar("lr", lr, cpu),
                                                     self.scalar("decay", 1 - lr * weight_decay, cpu), beta1, beta2,
                                                     eps)

    def age_steps(self, target: int, max_window: int | None) -> tuple[Tensor, Tensor | None]:
        """The age score's 0-dim inputs for the mask of ``target``: ``target - 1`` and, with a
        ``max_window``, ``target - max_window`` (fp32, exact: windows are fp32 steps)."""
        cpu = torch.device("cpu")
        due = None if max_window is None else self.scalar("due", target - max_window, cpu, torch.float32)
        return self.scalar("before", target - 1, cpu, torch.float32), due

    def age_momentum(self, m: Tensor, synced_at: Tensor, target: int, max_window: int | None, out: Tensor) -> Tensor:
        """The age score into ``out`` in one pass (eager: :func:`scape_core.masks.age_momentum_score`)."""
        before, due = self.age_steps(target, max_window)
        key = (tuple(m.shape), due is None)  # the CPU's blocks
        return self._fn("score", age_momentum_pass, key)(m, synced_at, before, due, out)

    def pick(self, m: Tensor, synced_at: Tensor, target: int, max_window: int | None, excluded: Tensor | None,
             layout: FlatLayout, shape: MaskShape, rows: slice, entries: bool) -> tuple[Tensor, Tensor | None]:
        """:func:`pick_pass` for rows ``rows`` of ``layout`` (``m`` and ``synced_at`` hold those rows): the
        mask of step ``target`` (compiled only; one compiled copy per density, rows and exclusion)."""
        before, due = self.age_steps(target, max_window)
        short = shape.short_rows(rows.start, rows.stop)
        entry_rows = (layout.full_rows, layout.partial_rows, shape.partial_index) if entries else None
        key = (tuple(m.shape), shape.density, rows.start, rows.stop, excluded is None, entries, due is None)
        return self._fn("pick", pick_pass, key)(m, synced_at, before, due, excluded, shape.k, short, shape.widest,
                                                entry_rows, layout.index_dtype)

    def stage(self, buffers: list[Tensor], residual: Tensor | None, entries: Tensor, row_shift: Tensor,
              spans: Sequence[Span], chunk: int) -> tuple[Tensor, Tensor]:
        """:func:`stage_pass`: the step's compact buffer and each bucket's verdict (compiled only)."""
        return self._fn("stage", stage_pass, hash(spans))(buffers, residual, entries, row_shift, spans, chunk)

    def residual(self, residuals: list[Tensor], grads: list[Tensor], keep: Tensor, key: Any) -> None:
        """:func:`residual_pass` (compiled only; ``key``: the bucket structure, one compiled copy each)."""
        self._fn("residual", residual_pass, key)(residuals, grads, keep)

    def finish(self, buffers: list[Tensor], residual: Tensor | None, entries: Tensor, reduced: Tensor,
               kept: Tensor | None, ok: Tensor, row_shift: Tensor, spans: Sequence[Span], chunk: int) -> Tensor:
        """:func:`finish_pass` (compiled only)."""
        return self._fn("finish", finish_pass, hash(spans))(buffers, residual, entries, reduced, kept, ok,
                                                            row_shift, spans, chunk)

    # the optimizer's, compiled only but masked_update (eager: the same function, run as torch operators)
    def sparse_step(self, rule: Any, params: list[Tensor], grads: list[Tensor], momentum: Tensor,
                    statistics: dict[str, Tensor], windows: Tensor | None, entries: Tensor, applied: Tensor,
                    step: int, decay: list[Tensor | None], scale: list[Tensor], layout: FlatLayout,
                    pieces: Sequence[Piece], **hp: float) -> None:
        """:func:`sparse_step_pass` and :func:`update_pass` (replicated state, every parameter with a
        gradient)."""
        at = self.scalar("step", step, entries.device, torch.float32)  # windows are fp32
        run = self._fn("sparse_step", sparse_step_pass, hash(pieces))
        u = run(rule, params, grads, momentum, statistics, windows, entries, applied, at, decay, layout.row_start,
                layout.chunk, pieces, hp["beta1"], hp["beta2"], hp["eps"])
        self._fn("update", update_pass, hash(pieces))(params, entries, u, scale, layout.row_start, layout.chunk,
                                                      pieces)

    def masked_update(self, rule: Any, momentum: Tensor, statistics: dict[str, Tensor], windows: Tensor | None,
                      local: Tensor, s: Tensor, applied: Tensor, step: int, **hp: float) -> Tensor:
        """:func:`masked_update_pass` (``step``: the one being applied); eager, a rule's fused form where it has
        one that runs here (the linear rule's C loop on the CPU, see :class:`~scape_core.update_rules.LinearUpdate`)."""
        fused = getattr(rule, "fused", None)
        if not self.compiled and fused is not None and windows is not None:
            u = fused(momentum, statistics, windows, local, s, applied, step, **hp)
            if u is not None:
                return u
        at = self.scalar("step", step, local.device, torch.float32)  # windows are fp32
        run = self._fn("masked_update", masked_update_pass, (local.numel(), applied.dim()))
        return run(rule, momentum, statistics, windows, local, s, applied, at, hp["beta1"], hp["beta2"], hp["eps"])

    def wire(self, plan: WirePlan, rank: int, device: torch.device) -> "wire.WireBuffers | CompiledWire":
        """The encoded wire's stages for ``plan`` on rank ``rank``: on buffers made once (eager,
        :class:`~scape_core.wire.WireBuffers`) or the compiled passes (:class:`CompiledWire`). The last
        plan's is kept (a ramp's denser plans are dropped once the density changes)."""
        key = (plan, rank, device)
        if self._wire is None or self._wire[0] != key:
            codec = CompiledWire(self, plan, rank, device) if self.compiled else wire.WireBuffers(plan, rank, device)
            self._wire = (key, codec)
        return self._wire[1]
