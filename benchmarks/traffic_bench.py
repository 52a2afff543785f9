"""Memory traffic of one training step per method: bytes read and written by every aten operator.

Machine-independent: no timing, only what each operator of a step must move, counted by a
``TorchDispatchMode`` (:class:`TrafficCounter`). A method's cost is its step minus a forward +
backward of the same model under DDP's plain all-reduce with no optimizer: the bytes per parameter
and the operators that the method adds. On a GPU each byte per parameter is one more pass over the
model's size in memory; each operator one more kernel launch.

The operator model (what one call of an operator counts):

    views, free         operators whose result aliases their input (``view``, ``reshape``'s view,
                        ``as_strided``, ``t``, ``transpose``, ``expand``, ``select``, ``slice``,
                        ``split``, ``alias``, ``detach``, ... every ``OpOverload.is_view``),
                        ``_unsafe_view``, and allocations (``empty``, ``empty_like``, ``new_empty``,
                        ...): 0 bytes, not an operator (``views`` counts them)
    elementwise and     every other operator: reads the bytes of each tensor argument (lists
    reductions          flattened: foreach and fused operators read every tensor of every list),
    (the default)       writes the bytes of each fresh output, and of each argument its schema marks
                        mutated (``Tensor(a!)``: in-place and ``out=`` operators). A tensor's bytes
                        are the elements it addresses (a broadcast 0-stride dimension counts once)
                        times the element size. So ``x.add_(y)`` on n fp32 values reads 8n and
                        writes 4n, ``torch.add(x, y)`` the same, ``x.sum()`` reads 4n and writes 4.
                        ``masked_fill_`` is elementwise here: torch's kernel reads and writes every
                        element whatever the mask holds.
    write-only          ``zero_``, ``fill_``, ``copy_`` (its destination), the random fills
    arguments           (``normal_``, ``uniform_``, ...), ``_foreach_zero_`` / ``_foreach_copy_``,
                        and ``out=`` arguments are written, not read
    index operators     count the elements they touch, not the tensor they index:
                        ``index_select`` / ``embedding`` / ``index.Tensor`` read the index and the
                        selected slices and write the output; ``gather`` and ``take`` read the index
                        and ``index.numel()`` elements; ``index_copy_`` / ``index_fill_`` /
                        ``index_put_`` / ``scatter_`` write only the touched slices (and read their
                        source and the index); the accumulating ones (``index_add_``,
                        ``scatter_add_``, ``scatter_reduce_``, ``index_put_(accumulate=True)``) also
                        read the touched slices
    SCAPE's C loops     ``scape::fused_gather`` and ``scape::linear_update`` as index operators (the
                        entries' elements); ``scape::fused_stage`` reads every gradient (its finiteness)
                        and the residual at the entries; the others (``fused_finish``, ``fused_update``,
                        the top-k's picks) as elementwise operators: every tensor they are handed
    fused optimizers    ``_fused_adam_`` / ``_fused_adamw_``: their schema marks the gradients
                        mutated, but the kernel writes them only when it unscales (``grad_scale``)
    host reads          ``_local_scalar_dense`` (``.item()``, ``bool(t)``, ``float(t)``): counted
                        apart (``host_reads``), not as traffic; ``host_syncs`` also counts the
                        operators whose output shape the host must wait for (``nonzero``,
                        ``masked_select``, ``unique``, ...), which are also counted as traffic
    collectives         ``c10d`` operators: counted as operators; the bytes of their tensors go to
                        ``collective_bytes``, not to the traffic (at world size 1 they move nothing)
    compiled code       inductor's kernels are not aten operators, so a dispatch mode sees nothing
                        inside a compiled function. Wrap it in :func:`count_compiled`: each call is
                        one operator ``compiled:<name>`` that reads the bytes of its tensor
                        arguments and writes those of its returned tensors and of the arguments
                        whose ``_version`` changed (mutated). That is the graph's boundary, not its
                        kernels' own accounting: intermediate buffers a graph writes and reads back
                        between its kernels are not seen (a lower bound: what one fused kernel of
                        the graph would move), and tensors it reads from closures or module
                        attributes rather than arguments are not counted.

The ops dispatched on gloo's callback thread (a DDP comm hook's ``fut.then(...)``) are outside a
dispatch mode, which is thread-local; :func:`synchronous_collectives` waits for each collective
where it is issued, so its future is complete and the callback runs inline on the counting thread.

World size 1 (gloo, one thread, a file store): ``ScapeState`` has no special case there; a sparse
step runs the hook's whole path (compact, the native all-reduce or the int4 wire's all-to-all and
all-gather, the write-back), and the bench checks that the counted step was sparse and not skipped.

    python benchmarks/traffic_bench.py                            # every method, ~1.8M GPT
    python benchmarks/traffic_bench.py --methods "SCAPE 99% native" --out /tmp/t.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import json
import math
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes, _get_current_dispatch_mode_stack
from torch.utils._pytree import tree_leaves

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.bench_common import (  # noqa: E402
    GPT,
    RESULTS,
    batches,
    core_version,
    count_params,
    machine,
    shakespeare,
)

METHODS = ("DDP + AdamW fused", "DDP + AdamS", "SCAPE 99% default", "SCAPE 99% native", "SCAPE 90%",
           "SCAPE 99% default staging", "SCAPE 99% native staging", "SCAPE 90% staging", "DDP + AdamS compiled",
           "SCAPE 99% default compiled", "SCAPE 99% native compiled", "SCAPE 90% compiled")
SCAPE_WARM = 5  # steps before the counted one: 2 dense (warm-up), 3 sparse (masks selected by the state's own score)

FREE = {"_unsafe_view", "lift_fresh", "empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided",
        "resize_", "set_", "_reshape_alias", "detach"}
WRITE_ONLY = {"zero_": "self", "fill_": "self", "copy_": "self", "normal_": "self", "uniform_": "self",
              "random_": "self", "bernoulli_": "self", "exponential_": "self", "_foreach_zero_": "self",
              "_foreach_copy_": "self"}
HOST_SYNCS = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim",
              "unique_consecutive", "equal", "repeat_interleave"}


# ----- the operator model ------------------------------------------------------------------
def nbytes(t: Any) -> int:
    """Bytes a tensor addresses (a 0-stride, broadcast dimension once); lists summed; 0 for anything else."""
    if isinstance(t, (list, tuple)):
        return sum(nbytes(x) for x in t)
    if not isinstance(t, Tensor):
        return 0
    return math.prod(n for n, s in zip(t.shape, t.stride()) if s != 0) * t.element_size() if t.numel() else 0


def _slices(t: Tensor, dim: int, k: int) -> int:
    """Bytes of ``k`` slices of ``t`` along ``dim``."""
    if t.dim() == 0:
        return k * t.element_size()
    return k * (t.numel() // max(t.shape[dim], 1)) * t.element_size()


def _indexed(self: Tensor, indices: list[Tensor | None]) -> int:
    """Elements of ``self`` that advanced indexing with ``indices`` touches (boolean masks: their true ones)."""
    shapes, covered = [], 0
    for idx in indices:
        if idx is None:
            covered += 1
            continue
        if idx.dtype == torch.bool:
            shapes.append((int(idx.count_nonzero()),))
            covered += idx.dim()
        else:
            shapes.append(tuple(idx.shape))
            covered += 1
    positions = math.prod(torch.broadcast_shapes(*shapes)) if shapes else 1
    untouched_dims = [n for i, n in enumerate(self.shape) if i >= covered or indices[i] is None]
    return positions * math.prod(untouched_dims)


def _index_model(name: str, a: dict[str, Any], out: Any) -> tuple[int, int] | None:
    """(read, written) of the index operators (see the module docstring); None for every other operator."""
    self = a.get("self")
    if name in ("index_select", "embedding"):
        src, dim, index = (a["weight"], 0, a["indices"]) if name == "embedding" else (self, a["dim"], a["index"])
        return _slices(src, dim, index.numel()) + nbytes(index), nbytes(out)
    if name == "index":
        return nbytes(out) + nbytes([i for i in a["indices"] if i is not None]), nbytes(out)
    if name in ("index_copy_", "index_fill_", "index_add_"):
        touched = _slices(self, a["dim"], a["index"].numel())
        source = nbytes(a.get("source"))
        return source + nbytes(a["index"]) + (touched if name == "index_add_" else 0), touched
    if name in ("index_put_", "_index_put_impl_"):
        touched = _indexed(self, list(a["indices"])) * self.element_size()
        read = nbytes(a["values"]) + nbytes([i for i in a["indices"] if i is not None])
        return read + (touched if a.get("accumulate") else 0), touched
    if name == "gather":
        return nbytes(a["index"]) + a["index"].numel() * self.element_size(), nbytes(out)
    if name == "take":  # self as 1-D, at the index
        return nbytes(a["index"]) + a["index"].numel() * self.element_size(), nbytes(out)
    if name == "fused_gather":  # scape_core.fused: the tensors read at the entries (and the rows' table)
        return nbytes(a["entries"]) + nbytes(a["ranges"]) + 4 * a["entries"].numel(), nbytes(out)
    if name == "fused_stage":  # every gradient read (its finiteness), the residual at the entries
        at = 4 * a["entries"].numel() * (a["residual"] is not None)
        return nbytes(a["tensors"]) + nbytes(a["entries"]) + nbytes(a["ranges"]) + at, nbytes(out)
    if name == "linear_update":  # m, sq and the windows read and written at the entries
        touched = 3 * 4 * a["at"].numel()
        return nbytes(a["at"]) + nbytes(a["s"]) + nbytes(a["applied"]) + touched, touched + nbytes(out)
    if name in ("scatter_", "scatter_add_", "scatter_reduce_"):
        touched = a["index"].numel() * self.element_size()
        src = a["index"].numel() * a["src"].element_size() if isinstance(a.get("src"), Tensor) else 0
        accumulates = name != "scatter_" or a.get("reduce") is not None
        return nbytes(a["index"]) + src + (touched if accumulates else 0), touched
    return None


def traffic(func: Any, args: tuple, kwargs: dict, out: Any) -> tuple[int, int]:
    """(bytes read, bytes written) of one call of an aten operator, by the module docstring's model."""
    schema = func._schema
    a = dict(zip((x.name for x in schema.arguments), args))
    a.update(kwargs)
    name = func._opname
    special = _index_model(name, a, out)
    if special is not None:
        return special
    read = written = 0
    for arg in schema.arguments:
        value = a.get(arg.name)
        mutated = arg.alias_info is not None and arg.alias_info.is_write
        if name in ("_fused_adam_", "_fused_adamw_") and arg.name == "grads":
            mutated = a.get("grad_scale") is not None  # the kernel writes the gradients only to unscale them
        if not (arg.is_out or WRITE_ONLY.get(name) == arg.name):
            read += nbytes(value)
        if mutated:
            written += nbytes(value)
    fresh = [o for o, r in zip(out if isinstance(out, tuple) else (out,), schema.returns) if r.alias_info is None]
    return read, written + sum(nbytes(o) for o in tree_leaves(fresh))


class TrafficCounter(TorchDispatchMode):
    """Counts, per aten operator, calls and bytes read and written while active (thread-local).

    Example::

        counter = TrafficCounter()
        with counter:
            x.add_(y)
        counter.totals()  # {'operators': 1, 'read': 8 * n, 'written': 4 * n, ...} for n fp32 values
    """

    def __init__(self, sites: str | None = None) -> None:
        super().__init__()
        self.ops: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # name -> [calls, read, written]
        self.views = self.host_reads = self.host_syncs = self.collective_bytes = 0
        self.sites = sites  # a package directory name: also count per innermost function of it that called
        self.by_site: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])

    def record(self, name: str, read: int, written: int) -> None:
        rows = [self.ops[name]] + ([self.by_site[f"{self._site()}: {name}"]] if self.sites else [])
        for row in rows:
            row[0] += 1
            row[1] += read
            row[2] += written

    def _site(self) -> str:
        """``module.function`` of the innermost frame in the ``sites`` package (``"outside"``: none)."""
        frame = sys._getframe(2)
        marker = f"{os.sep}{self.sites}{os.sep}"
        while frame is not None:
            if marker in frame.f_code.co_filename:
                return f"{Path(frame.f_code.co_filename).stem}.{frame.f_code.co_name}"
            frame = frame.f_back
        return "outside"

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._opname
        if func.namespace == "profiler":
            return out
        if name in HOST_SYNCS:
            self.host_syncs += 1
        if name == "_local_scalar_dense":
            self.host_reads += 1
        elif func.namespace == "c10d":
            self.record(f"c10d.{name}", 0, 0)
            self.collective_bytes += nbytes(tree_leaves((args, kwargs)))
        elif func.is_view or name in FREE:
            self.views += 1
        else:
            self.record(name, *traffic(func, args, kwargs, out))
        return out

    def totals(self) -> dict[str, Any]:
        """Operators (views and allocations aside), bytes read and written, host reads and syncs, views."""
        return {"operators": sum(r[0] for r in self.ops.values()), "read": sum(r[1] for r in self.ops.values()),
                "written": sum(r[2] for r in self.ops.values()), "host_reads": self.host_reads,
                "host_syncs": self.host_syncs, "views": self.views, "collective_bytes": self.collective_bytes,
                "by_op": {k: list(v) for k, v in self.ops.items()},
                **({"by_site": {k: list(v) for k, v in self.by_site.items()}} if self.sites else {})}


def count_compiled(fn: Callable, name: str | None = None,
                   model: Callable[[tuple, dict, Any], tuple[int, int]] | None = None) -> Callable:
    """``fn`` (e.g. a ``torch.compile``'d function) counted by its graph's boundary in any active TrafficCounter.

    Each call is one operator ``compiled:<name>``: reads its tensor arguments, writes its returned
    tensors and the arguments whose ``_version`` changed. What runs inside is not seen by the counter.
    ``model(args, kwargs, out) -> (read, written)`` replaces that boundary count where a function is
    known to touch less (an argument it only writes, one it only indexes).

    Example::

        step = count_compiled(torch.compile(pure_step), "residual_pass")
    """
    label = f"compiled:{name or getattr(fn, '__name__', 'fn')}"

    @functools.wraps(fn)
    def counted(*args: Any, **kwargs: Any) -> Any:
        counters = [m for m in _get_current_dispatch_mode_stack() if isinstance(m, TrafficCounter)]
        if not counters:
            return fn(*args, **kwargs)
        inputs = list({id(t): t for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}.values())
        versions = [t._version for t in inputs]
        with _disable_current_modes():  # the compiled code's own aten calls (extern kernels) are inside the count
            out = fn(*args, **kwargs)
        ids = {id(t) for t in inputs}
        returned = [t for t in tree_leaves(out) if isinstance(t, Tensor) and id(t) not in ids]
        mutated = [t for t, v in zip(inputs, versions) if t._version != v]
        read, written = nbytes(inputs), nbytes(returned) + nbytes(mutated)
        if model is not None:
            read, written = model(args, kwargs, out)
        for counter in counters:
            counter.record(label, read, written)
        return out

    return counted


def _score_traffic(args: tuple, kwargs: dict, out: Any) -> tuple[int, int]:
    m, synced_at, before, due, dest = args  # ``out`` is only written; ``due``: the overdue rows' flags, or None
    return nbytes([m, synced_at, before, due]), nbytes(dest)


def _gather_traffic(args: tuple, kwargs: dict, out: Any) -> tuple[int, int]:
    grads, entries, row_start, _, pieces = args  # reads the index (its rows' starts: a table) and the values only
    picked = sum((hi - lo) * grads[i].element_size() for i, lo, hi in pieces)
    return nbytes(entries) + nbytes(row_start) + picked, nbytes(out)


def _masked_update_traffic(args: tuple, kwargs: dict, out: Any) -> tuple[int, int]:
    _, momentum, statistics, windows, local, s, applied, step, *_ = args  # the state's buffers at the entries only
    touched = [b for b in (momentum, *statistics.values(), windows) if b is not None]
    at = local.numel() * sum(b.element_size() for b in touched)
    return nbytes([local, s, applied, step]) + at, at + nbytes(out)


def _update_traffic(args: tuple, kwargs: dict, out: Any) -> tuple[int, int]:
    params, entries, u, scale, row_start, _, pieces = args  # the entries of the parameters read and written
    picked = sum((hi - lo) * params[i].element_size() for i, lo, hi in pieces)
    return nbytes([entries, u, row_start, *scale]) + picked, picked


def _decay_traffic(params: list[torch.Tensor], decay: list[torch.Tensor | None]) -> tuple[int, int]:
    decayed = nbytes([p for p, d in zip(params, decay) if d is not None])  # read and written
    return decayed + nbytes([d for d in decay if d is not None]), decayed


def _stage_traffic(args: tuple, kwargs: dict, out: Any) -> tuple[int, int]:
    buffers, residual, entries, row_shift, *_ = args  # every bucket read (its finiteness), the residual at the entries
    at = entries.numel() * (residual.element_size() if residual is not None else 0)
    # the index is read twice; the rows' shifts are a table of the layout's rows, read once (cache-resident)
    return nbytes(buffers) + nbytes(entries) * 2 + at + nbytes(row_shift), nbytes(out)


def _sparse_step_traffic(args: tuple, kwargs: dict, out: Any) -> tuple[int, int]:
    _, params, grads, momentum, statistics, windows, entries, applied, step, decay, row_start, chunk, pieces, *_ = args
    # the gather and the rule, each at what it touches, and the decay; returns u
    gather = _gather_traffic((grads, entries, row_start, chunk, pieces), {}, torch.empty(0))[0]
    touched = [b for b in (momentum, *statistics.values(), windows) if b is not None]
    state = entries.numel() * sum(b.element_size() for b in touched)
    decay_read, decay_written = _decay_traffic(params, decay)
    return gather + state + decay_read + nbytes([applied, step]), state + decay_written + nbytes(out)


def _finish_traffic(args: tuple, kwargs: dict, out: Any) -> tuple[int, int]:
    buffers, residual, entries, reduced, kept, ok, row_shift, spans, _ = args  # the entries touched
    at = 0 if residual is None else entries.numel() * residual.element_size()
    small = nbytes([entries, reduced, ok, row_shift] + ([kept] if kept is not None else []))
    picked = sum((hi - lo) * buffers[j].element_size() for j, lo, hi in spans)
    return small + nbytes(entries) + at, at + picked + nbytes(out)


# the rest: their boundary (every tensor argument read, returned and mutated ones written)
COMPILED_TRAFFIC = {"score": _score_traffic, "masked_update": _masked_update_traffic,
                    "update": _update_traffic, "stage": _stage_traffic, "sparse_step": _sparse_step_traffic,
                    "finish": _finish_traffic}


def counted_kernels() -> None:
    """SCAPE's compiled passes (``ScapeConfig(kernels="compiled")``) counted by :func:`count_compiled`
    (by their boundary, but where a pass only writes an argument or only indexes it, by what it touches:
    :data:`COMPILED_TRAFFIC`)."""
    from scape_core import kernels

    if not getattr(kernels.compile_kernel, "counted", False):
        build = kernels.compile_kernel

        def compile_counted(fn: Callable, name: str) -> Callable:
            return count_compiled(build(fn, name), name, COMPILED_TRAFFIC.get(name))

        compile_counted.counted = True  # type: ignore[attr-defined]
        kernels.compile_kernel = compile_counted


@contextlib.contextmanager
def synchronous_collectives() -> Iterator[None]:
    """Wait for each collective where it is issued, so a comm hook's ``.then`` callback runs inline
    (on the counting thread, inside its dispatch mode) instead of on gloo's thread."""
    names = ("all_reduce", "all_to_all_single", "all_gather_into_tensor", "all_gather_single", "all_gather",
             "broadcast")
    saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}  # all_gather_single: torch >= 2.13

    def waited(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            work = fn(*args, **kwargs)
            if work is not None:
                work.wait()  # returns after the work's future has completed
            return work
        return call

    try:
        for n, fn in saved.items():
            setattr(dist, n, waited(fn))
        yield
    finally:
        for n, fn in saved.items():
            setattr(dist, n, fn)


# ----- the methods -----------------------------------------------------------------------
def build(method: str, base: nn.Module,
          bucket_view: bool = False) -> tuple[nn.Module, torch.optim.Optimizer | None, Any]:
    """``(ddp, optimizer, scape_state)``; method ``"baseline"``: DDP's plain all-reduce, no optimizer."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from scape_core import AdamS, ScapeAdamS, ScapeState, scape_hook

    hp = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    ddp = DDP(copy.deepcopy(base), gradient_as_bucket_view=bucket_view)
    if method == "baseline":
        return ddp, None, None
    if method == "DDP + AdamW fused":
        return ddp, torch.optim.AdamW(ddp.parameters(), fused=True, **hp), None
    kernels = "compiled" if method.endswith(" compiled") else "eager"
    if method.startswith("DDP + AdamS"):
        return ddp, AdamS(ddp.parameters(), kernels=kernels, **hp), None
    sparsity = 0.99 if "99%" in method else 0.9
    wire = {"wire": "native"} if " native" in method else {}
    state = ScapeState(ddp, sparsity=sparsity, warmup_steps=2, ramp_steps=0, kernels=kernels, **wire)
    # count a GPU's selection: the whole layout in one pass (the CPU's blocks of rows move the same bytes
    # in more operators; tests/test_masks.py checks that both choose the same masks)
    state.selector.block_rows = state.layout.rows
    ddp.register_comm_hook(state, scape_hook)
    return ddp, ScapeAdamS(ddp.parameters(), state, **hp), state


def train_step(ddp: nn.Module, opt: torch.optim.Optimizer | None, x: Tensor, y: Tensor) -> None:
    ddp(x, y).backward()
    if opt is not None:
        opt.step()
    ddp.zero_grad(set_to_none=True)


def measure(method: str, base: nn.Module, data: Iterator[tuple[Tensor, Tensor]],
            bucket_view: bool = False) -> dict[str, Any]:
    """The totals of one counted step of ``method`` (after its warm-up steps: SCAPE's are sparse); a method
    ending in " staging" runs the staging buffer's operators and a mask's entries in torch's (as off the CPU) with
    the C pick, one ending in
    " torch" no C kernel at all (a CPU without a C compiler)."""
    from scape_core import fused, masks, native
    from scape_core.update_rules import UPDATE_RULES

    if method.endswith(" staging"):  # the C pick kept, the step's loops as off the CPU: the staging buffer's path
        linear, runs_here, c_entries = UPDATE_RULES["linear"], fused.runs_here, masks.c_entries
        fused.runs_here, linear.fused = (lambda *args: False), (lambda *args, **kwargs: None)
        masks.c_entries = lambda cols: False  # a mask's entries in torch's operators, as off the CPU
        try:
            return measure(method[:-len(" staging")], base, data, bucket_view)
        finally:
            fused.runs_here, masks.c_entries = runs_here, c_entries
            del linear.fused  # the class's method again
    if method.endswith(" torch"):
        saved, native._library, native._unavailable = (native._library, native._unavailable), None, "torch"
        try:
            return measure(method[:-len(" torch")], base, data, bucket_view)
        finally:
            native._library, native._unavailable = saved
    ddp, opt, state = build(method, base, bucket_view)
    with synchronous_collectives():
        for _ in range(SCAPE_WARM if state is not None else 2):
            train_step(ddp, opt, *next(data))
        counter = TrafficCounter(sites="scape_core")
        x, y = next(data)
        with counter:
            train_step(ddp, opt, x, y)
    row = counter.totals()
    if state is not None:
        state.wait()
        row["sparse"] = not state.is_dense(state.step - 1)
        row["skipped_steps"] = state.stats()["skipped_steps"]
        row["wire"] = state.config.resolved_wire
    return row


def _diff(row: dict[str, list[int]], base: dict[str, list[int]], params: int) -> dict[str, dict[str, float]]:
    """Per key: calls and bytes per parameter of ``row`` minus ``base``, sorted by bytes added."""
    out = {}
    for key in set(row) | set(base):
        c, r, w = (a - b for a, b in zip(row.get(key, [0, 0, 0]), base.get(key, [0, 0, 0])))
        if c or r or w:
            out[key] = {"calls": c, "bytes_per_param": (r + w) / params, "read": r / params, "written": w / params}
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["bytes_per_param"]))


def added(row: dict[str, Any], base: dict[str, Any], params: int) -> dict[str, Any]:
    """A method's step minus the baseline's, per parameter; per operator name and per calling site."""
    read, written = (row[k] - base[k] for k in ("read", "written"))
    return {"bytes_per_param": (read + written) / params, "read_per_param": read / params,
            "written_per_param": written / params, "operators": row["operators"] - base["operators"],
            "by_op": _diff(row["by_op"], base["by_op"], params),
            "by_site": _diff(row["by_site"], base["by_site"], params)}


def init_single_rank(store_dir: str) -> None:
    """A 1-rank gloo group on a file store (nothing listens on a port)."""
    store = dist.FileStore(os.path.join(store_dir, "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)


def run(methods: list[str], params: float, layers: int, context: int, batch: int,
        bucket_view: bool = False) -> dict[str, Any]:
    """Every method's counted step and what it adds to the baseline, on one seeded GPT (world size 1)."""
    torch.set_num_threads(1)
    counted_kernels()
    text, vocab = shakespeare()
    torch.manual_seed(0)
    base = GPT.sized(params, vocab, context, layers=layers)
    n = count_params(base)
    baseline = measure("baseline", base, batches(text, batch, context, seed=0), bucket_view)
    out = {"params": n, "tensors": len(list(base.parameters())), "batch": [batch, context],
           "gradient_as_bucket_view": bucket_view, "baseline": baseline,
           "methods": {}}
    for method in methods:
        row = measure(method, base, batches(text, batch, context, seed=0), bucket_view)
        row["added"] = added(row, baseline, n)
        out["methods"][method] = row
    return out


def _top(rows: list[tuple[str, dict[str, float]]], top: int) -> tuple[list, list]:
    """The ``top`` largest rows and anything that saves more than 0.05 B/param; the rest."""
    shown = rows[:top] + [kv for kv in rows[top:] if kv[1]["bytes_per_param"] < -0.05]
    return shown, [kv for kv in rows[top:] if kv[1]["bytes_per_param"] >= -0.05]


def report(res: dict[str, Any], top: int = 16) -> str:
    """Markdown: added bytes per parameter, operators and host reads per method; where each method's bytes go,
    by operator and (SCAPE) by the core's function that issued them."""
    lines = [f"GPT {res['params'] / 1e6:.2f}M parameters ({res['tensors']} tensors), world size 1, batch "
             f"{res['batch'][0]} x {res['batch'][1]}, gradient_as_bucket_view={res['gradient_as_bucket_view']}; "
             f"added = the step minus a forward + backward under DDP's plain all-reduce, no optimizer (baseline: "
             f"{res['baseline']['operators']} operators, "
             f"{(res['baseline']['read'] + res['baseline']['written']) / res['params']:.0f} B/param)\n",
             "| method | added B/param | read | written | added operators | host reads / step | counted step |",
             "|---|---|---|---|---|---|---|"]
    for name, r in res["methods"].items():
        a = r["added"]
        kind = "" if "sparse" not in r else (f"sparse, {r['wire']}" if r["sparse"] and not r["skipped_steps"]
                                             else "NOT a sparse step")
        lines.append(f"| {name} | {a['bytes_per_param']:.1f} | {a['read_per_param']:.1f} | "
                     f"{a['written_per_param']:.1f} | {a['operators']} | {r['host_reads']} | {kind} |")
    for name, r in res["methods"].items():
        shown, rest = _top(list(r["added"]["by_op"].items()), top)
        lines += [f"\n{name}: added bytes by operator (B/param, read + written; calls)\n",
                  "| operator | B/param | calls |", "|---|---|---|"]
        lines += [f"| {k} | {v['bytes_per_param']:.2f} | {v['calls']} |" for k, v in shown]
        if rest:
            lines.append(f"| {len(rest)} others | {sum(v['bytes_per_param'] for _, v in rest):.2f} | "
                         f"{sum(v['calls'] for _, v in rest)} |")
        if "sparse" not in r:
            continue
        sites: dict[str, dict[str, Any]] = defaultdict(lambda: {"bytes_per_param": 0.0, "calls": 0, "ops": []})
        for key, v in r["added"]["by_site"].items():
            site, op = key.split(": ", 1)
            sites[site]["bytes_per_param"] += v["bytes_per_param"]
            sites[site]["calls"] += v["calls"]
            sites[site]["ops"].append(f"{op} {v['bytes_per_param']:.1f}")
        lines += [f"\n{name}: added bytes by the scape_core function that issued them (\"outside\": DDP, the "
                  "model; against the baseline)\n", "| function | B/param | calls | operators (B/param) |",
                  "|---|---|---|---|"]
        for site, v in sorted(sites.items(), key=lambda kv: -kv[1]["bytes_per_param"]):
            lines.append(f"| {site} | {v['bytes_per_param']:.2f} | {v['calls']} | {', '.join(v['ops'][:6])}"
                         f"{', ...' if len(v['ops']) > 6 else ''} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default=",".join(METHODS),
                   help="comma-separated, from: " + ", ".join(METHODS).replace("%", "%%"))
    p.add_argument("--params", type=float, default=1.9e6)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--bucket-view", action="store_true", help="DDP(gradient_as_bucket_view=True) for every method")
    p.add_argument("--out", default=str(RESULTS / "traffic_bench.json"))
    args = p.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = {m for m in methods if m.removesuffix(" staging").removesuffix(" torch") not in METHODS}
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}; choose from {METHODS}, a SCAPE eager one may end in "
                         "' staging' (the staging buffer's operators) or ' torch' (no C kernel)")
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        init_single_rank(tmp)
        try:
            res = run(methods, args.params, args.layers, args.context, args.batch, args.bucket_view)
        finally:
            dist.destroy_process_group()
    res["seconds"] = round(time.time() - t0, 1)
    text = report(res)
    print(text)
    given = sys.argv[1:] if argv is None else argv
    summary = {"command": " ".join(["python", "benchmarks/traffic_bench.py"] + given),
               "machine": machine(), "core": core_version(), "report": text, **res}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=1))
    print(f"\n{res['seconds']}s; {core_version()}; wrote {args.out}")
    return summary


if __name__ == "__main__":
    main()
