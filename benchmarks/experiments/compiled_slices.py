"""Why SCAPE's compiled finish pass leaves the residual's add to an eager multi-tensor add.

An in-place add into each parameter's slice of one flat buffer, inside a ``torch.compile``'d
graph, is functionalized into copies of the whole buffer; the same adds on the slices passed in
as separate tensors, or as one eager ``torch._foreach_add_``, touch each value once.

    python benchmarks/experiments/compiled_slices.py     # 100 slices of 100k values: compile and best-of-3 call times
"""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch import Tensor

SLICES, SIZE = 100, 100_000


def add_into_slices(flat: Tensor, grads: Tensor, keep: Tensor, spans: tuple[tuple[int, int], ...]) -> None:
    for start, numel in spans:
        flat[start:start + numel].add_(torch.where(keep, grads[start:start + numel], 0.0))
    grads.zero_()


def add_into_views(residuals: list[Tensor], grads: list[Tensor], keep: Tensor) -> None:
    for e, g in zip(residuals, grads):
        e.add_(torch.where(keep, g, 0.0))
        g.zero_()


def timed(fn: Callable, *args: object) -> tuple[float, float]:
    """(seconds of the first call, best of the next three in ms)."""
    t0 = time.perf_counter()
    fn(*args)
    first = time.perf_counter() - t0
    best = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn(*args)
        best.append(time.perf_counter() - t0)
    return first, 1e3 * min(best)


def main() -> None:
    torch.set_num_threads(1)
    flat, grads, keep = torch.zeros(SLICES * SIZE), torch.randn(SLICES * SIZE), torch.tensor(True)
    spans = tuple((i * SIZE, SIZE) for i in range(SLICES))
    compiled = torch.compile(add_into_slices, fullgraph=True, dynamic=False)
    print("slices of one buffer, compiled: first call %.1f s, then %.1f ms" % timed(compiled, flat, grads, keep, spans))
    residuals = [flat[s:s + n] for s, n in spans]
    views = [grads[s:s + n] for s, n in spans]
    compiled = torch.compile(add_into_views, fullgraph=True, dynamic=False)
    print("views as inputs, compiled:      first call %.1f s, then %.1f ms" % timed(compiled, residuals, views, keep))
    eager = timed(lambda: (torch._foreach_add_(residuals, views), grads.zero_()))[1]
    print(f"eager _foreach_add_ + zero_:    {eager:.1f} ms")


if __name__ == "__main__":
    main()
