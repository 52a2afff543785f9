"""A negative result, kept runnable: an exact per-row top-k through a sampled threshold, on the CPU.

Wanted: a cheaper exact selection where ``torch.topk`` is slow. The route tried here:
take a fixed sample of each row's columns, its ``j``-th largest key as a threshold ``t`` (``j``
chosen so that ``t`` is below the row's true k-th key with high probability), keep the keys
``>= t`` as candidates, compact them into a fixed ``(rows, cap)`` buffer, and take the top-k of
that; rows whose candidates are fewer than ``k`` or more than ``cap`` fall back to a full top-k.
It chooses the same values as ``torch.topk`` (checked below), but on this CPU it is several times
slower: the compaction (``masked_select``, a boolean ``sum``) costs more than the whole top-k it
avoids. On CUDA, ``torch.topk`` already is a per-row radix select over the keys' bits.

The second route (``--route bits``), also a negative result: a per-row threshold search over the
keys' bits, compiled (inductor's C++). 33 counts find each row's k-th key exactly, bit by bit from
the top, one more the keys above it and 13 more the column bound that takes the ties at it lowest
columns first: a boolean mask of exactly ``k`` per row, in column order, with no compaction.
Inductor emits each count as its own loop over all the rows (it does not fuse them per row), so
47 scans replace one top-k; on this CPU that is several times slower even in blocks of rows that
stay in cache.

    python benchmarks/experiments/threshold_topk.py                 # 25M scores, k = 41 and 308 (~1 minute)
    python benchmarks/experiments/threshold_topk.py --rows 500      # quicker
    python benchmarks/experiments/threshold_topk.py --route bits    # the bit search (~2 minutes, compiles twice)
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere
from benchmarks.bench_common import median_ms  # noqa: E402


def threshold_topk(keys: Tensor, k: int, samples: int = 512) -> tuple[Tensor, int]:
    """Columns of a top-k of every row of int32 ``keys`` (unsorted), and how many rows fell back."""
    rows, n = keys.shape
    mu = k * samples / n  # expected sampled keys above the row's k-th
    j = min(samples, math.ceil(mu + 3 * math.sqrt(mu)) + 1)
    cap = min(n, 2 * math.ceil(j * n / samples))
    columns = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:samples].sort().values
    t = keys.index_select(1, columns).topk(j, dim=1, sorted=False).values.amin(1, keepdim=True)
    candidate = keys >= t
    counts = candidate.sum(1)
    values = keys.masked_select(candidate)
    cols = torch.arange(n, dtype=torch.int16).masked_select(candidate)
    row_of = torch.repeat_interleave(counts)
    pos = torch.arange(values.numel()) - (counts.cumsum(0) - counts).index_select(0, row_of)
    keep = pos < cap
    at = (row_of * cap + pos)[keep]
    buf = torch.full((rows, cap), torch.iinfo(torch.int32).min, dtype=torch.int32)
    colbuf = torch.zeros((rows, cap), dtype=torch.int16)
    buf.view(-1)[at] = values[keep]
    colbuf.view(-1)[at] = cols[keep]
    out = colbuf.gather(1, buf.topk(k, dim=1, sorted=False).indices).long()
    bad = ((counts < k) | (counts > cap)).nonzero().view(-1)
    if bad.numel():
        out[bad] = keys.index_select(0, bad).topk(k, dim=1, sorted=False).indices
    return out, bad.numel()


def bit_search_mask(keys: Tensor, k: int) -> Tensor:
    """Exactly ``k`` picks per row of int32 ``keys`` as a boolean mask: every key above the row's
    k-th, then its ties lowest columns first (keys ``>= -2``: the selector's sentinels included)."""
    cols = torch.arange(keys.shape[1], dtype=torch.int32, device=keys.device)

    def count(picked: Tensor) -> Tensor:
        return picked.sum(1, keepdim=True, dtype=torch.int32)

    # the k-th key: the sentinels first, then the non-negative keys bit by bit from the top
    t = torch.where(count(keys >= 0) >= k, 0, torch.where(count(keys >= -1) >= k, -1, -2)).to(torch.int32)
    for bit in range(30, -1, -1):
        higher = torch.where(t >= 0, t | (1 << bit), t)
        t = torch.where(count(keys >= higher) >= k, higher, t)
    need = k - count(keys > t)  # ties at t still to take
    tie = keys == t
    bound = torch.zeros_like(t)  # the ties below column `bound` are taken: the largest bound that takes <= need
    for bit in range(keys.shape[1].bit_length() - 1, -1, -1):  # bound reaches past the last column
        wider = bound | (1 << bit)
        bound = torch.where(count(tie & (cols < wider)) <= need, wider, bound)
    return (keys > t) | (tie & (cols < bound))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=6200, help="rows of 4096 scores (6200: a 25M model)")
    p.add_argument("--route", choices=("sampled", "bits"), default="sampled",
                   help="sampled: the sampled threshold; bits: the compiled bit search")
    p.add_argument("--block", type=int, default=256, help="--route bits: rows a call (256: the CPU's score block)")
    args = p.parse_args()
    torch.set_num_threads(1)
    scores = torch.randn(args.rows, 4096, generator=torch.Generator().manual_seed(1)).abs()
    keys = scores.view(torch.int32)  # non-negative fp32 scores order as their int32 bits
    if args.route == "bits":
        bits(keys, args.block)
        return
    for k in (41, 308):  # 1% (native wire at 99%) and 7.5% (int4 at 99%) of 4096
        full = keys.topk(k, dim=1, sorted=False).indices
        mine, fell_back = threshold_topk(keys, k)
        same = torch.equal(keys.gather(1, full).sort(1).values, keys.gather(1, mine).sort(1).values)
        print(f"k = {k}: torch.topk {median_ms(lambda: keys.topk(k, dim=1, sorted=False)):.0f} ms, "
              f"threshold {median_ms(lambda: threshold_topk(keys, k)):.0f} ms "
              f"({fell_back} of {args.rows} rows fell back; same values: {same})")
    candidate = keys >= keys[:, :1]
    for name, fn in (("keys >= t", lambda: keys >= keys[:, :1]), ("bool sum(1)", lambda: candidate.sum(1)),
                     ("masked_select", lambda: keys.masked_select(candidate))):
        print(f"  {name}: {median_ms(fn, 3):.0f} ms")


def bits(keys: Tensor, block: int) -> None:
    """Time the compiled bit search against ``torch.topk``, in blocks of ``block`` rows."""
    search = torch.compile(bit_search_mask, dynamic=False)
    rows = keys.shape[0]
    tied = keys.clone()
    tied[:, :64] = tied[:, :1]  # a 64-way tie in every row: the tie rule must hold too
    tied[0] = -1  # a row of excluded keys only
    check = tied[:block]
    t0 = time.perf_counter()
    ok_shape = bool((search(check, 308).sum(1) == 308).all())
    compile_s = time.perf_counter() - t0
    for k in (41, 308):
        picked = search(check, k)
        want = check.topk(k, dim=1).values.sort(1).values
        got = torch.where(picked, check, torch.iinfo(torch.int32).min).topk(k, dim=1).values.sort(1).values
        same = ok_shape and bool((picked.sum(1) == k).all()) and torch.equal(got, want)
        out = torch.empty(keys.shape, dtype=torch.bool)

        def blocked() -> None:
            for lo in range(0, rows - rows % block, block):
                out[lo:lo + block] = search(keys[lo:lo + block], k)

        print(f"k = {k}: torch.topk {median_ms(lambda: keys.topk(k, dim=1, sorted=False)):.0f} ms, "
              f"bit search {median_ms(blocked, 3):.0f} ms in blocks of {block} rows "
              f"({rows - rows % block} of {rows} rows; exactly k, the same values: {same})")
    print(f"  first call (compile): {compile_s:.0f} s")


if __name__ == "__main__":
    main()
