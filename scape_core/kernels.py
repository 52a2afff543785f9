"""The compile machinery of SCAPE's passes: each pass eager (its reference) or ``torch.compile``'d.

A sparse step touches every coordinate a few times: the residual takes the bucket's gradient,
the score reads ``m`` and the windows, every parameter is decayed and the mask's entries
updated; a dense AdamS step reads the parameters, gradients and ``m``. Eager, each of those is
several operators, each one pass over memory (``benchmarks/traffic_bench.py`` counts them).
``ScapeConfig(kernels="compiled")`` runs them as ``torch.compile``'d pure functions of the flat
buffers instead: inductor fuses each into one loop per tensor (C++ on the CPU, Triton on CUDA),
so each coordinate is read and written once per pass.

Each pass lives beside the eager code it stands for, as torch's ``adam.py`` keeps its single-tensor,
multi-tensor and fused steps beside one another: AdamS's in :mod:`scape_core.adams`, the score and
the pick in :mod:`scape_core.masks`, the exchange's in :mod:`scape_core.exchange`, the optimizer's
in :mod:`scape_core.optimizer` and :mod:`scape_core.update_rules`, the wire's in
:mod:`scape_core.wire`. This module holds what they share: :class:`Kernels` (a state's mode, its
compiled copies, the 0-dim tensors they read) and :func:`compile_kernel` (the one place SCAPE compiles,
under :func:`deterministic`). Compiled functions take lists of tensors and 0-dim tensors for every
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
from typing import Any, Callable, Iterator

import torch
from torch import Tensor

KERNELS = ("eager", "compiled")

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


class Kernels:
    """SCAPE's passes over every coordinate, eager or compiled (:data:`KERNELS`).

    Example:
        >>> kernels = Kernels("eager")
        >>> double = kernels.get("double", lambda x: x * 2)       # eager: the function itself
        >>> double(torch.tensor([1.0, 2.0])), kernels.compiled, kernels.built
        (tensor([2., 4.]), False, ())
    """

    def __init__(self, mode: str = "eager") -> None:
        if mode not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {mode!r}")
        self.mode = mode
        self.compiled = mode == "compiled"
        self._fns: dict[str, Callable] = {}
        self._scalars: dict[tuple[str, torch.device], Tensor] = {}  # scalar() and constant()
        self._last: dict[str, tuple[Any, Any]] = {}  # last(): per slot, the key and what was made for it

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

    def get(self, name: str, fn: Callable, key: Any = None) -> Callable:
        """The pass ``name``, the pure function ``fn``: compiled (one copy per ``key``: what its baked-in
        constants depend on, compiled at its first call), or ``fn`` itself in eager mode."""
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

    def last(self, slot: str, key: Any, make: Callable[[], Any]) -> Any:
        """What ``make()`` made for ``key``, kept under ``slot`` until a call with another key (a ramp's
        denser wire plans are dropped once the density changes)."""
        found = self._last.get(slot)
        if found is None or found[0] != key:
            found = self._last[slot] = (key, make())
        return found[1]
