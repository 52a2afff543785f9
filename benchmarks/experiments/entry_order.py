"""Does the order of a mask's columns inside a row matter for the per-entry index operators?

``torch.topk(..., sorted=False)`` returns each row's picks in no particular order, so every
index operation over a sparse step's entries (about 15 per step in the eager path: gathers and
scatters of ``g + e``, the residual, ``m``, ``sq``, the windows, the buckets) jumps around
inside each row. Sorting the columns once per mask would make those accesses ascending. This
measures both sides on one thread: an ``index_select`` and an ``index_copy_`` over the entries
(ascending or topk's order) against a dense in-place pass over the same buffer, and what sorting
the ``(rows, k)`` columns costs.

    python benchmarks/experiments/entry_order.py                  # 25M values (6,144 rows of 4,096), k = 41 and 308
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere
from benchmarks.bench_common import median_ms  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=6144)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--ks", default="41,308", help="picks per row (1%% and int4's 7.5%% of 4,096)")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rows, chunk = args.rows, args.chunk
    buffer = torch.randn(rows * chunk)
    print(f"{rows * chunk / 1e6:.1f}M fp32 values, one thread; medians of 5, ms")
    print(f"dense in-place pass (mul_): {median_ms(lambda: buffer.mul_(1.0), warm=True):.1f}")
    print("| k | index_select, topk order | ascending | index_copy_, topk order | ascending | sort the columns |")
    print("|---|---|---|---|---|---|")
    base = torch.arange(rows)[:, None] * chunk
    for k in (int(x) for x in args.ks.split(",")):
        cols = torch.rand(rows, chunk).topk(k, dim=1, sorted=False).indices
        ordered = cols.sort(dim=1).values
        entries, ascending = (base + cols).view(-1), (base + ordered).view(-1)
        values = torch.randn(entries.numel())
        small = cols.to(torch.int16)
        row = [median_ms(fn, warm=True) for fn in (
            lambda: buffer.index_select(0, entries), lambda: buffer.index_select(0, ascending),
            lambda: buffer.index_copy_(0, entries, values), lambda: buffer.index_copy_(0, ascending, values),
            lambda: small.sort(dim=1))]
        print(f"| {k} | " + " | ".join(f"{x:.1f}" for x in row) + " |")


if __name__ == "__main__":
    main()
