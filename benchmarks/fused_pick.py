"""The group pick as one compiled reduction: the design issue 33 names for the compiled path, measured.

Today ``selection="groups"`` under ``kernels="compiled"`` writes the score (one compiled pass), then
moves the excluded coordinates below the others and takes the group maxima eagerly (gathers,
scatters, two ``argmax`` over views, ``cat``). Here the score, the exclusion and the group maximum
are one ``torch.compile``'d function of ``m`` and the windows, for the steady state where the mask
being flushed is a groups mask of the same ``k`` (one column per group, so the exclusion is a
comparison with that group's excluded offset, and no key buffer is written). It checks that the
picks equal the library's (:func:`scape_core.masks.select_groups`), and reports time per call and
the bytes each way reads and writes at its boundary (what a memory-bound GPU pays).

    python benchmarks/fused_pick.py                      # 25M coordinates, 99% int4 (k = 309 of 4,096)
    python benchmarks/fused_pick.py --rows 2048 --k 41   # a smaller one
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.bench_common import median_ms  # noqa: E402
from scape_core.layout import FlatLayout  # noqa: E402
from scape_core.masks import Mask, age_momentum_score, excluded_key, select_groups  # noqa: E402


def fused_pick(m: Tensor, synced_at: Tensor, before: Tensor, excluded: Tensor, k: int) -> Tensor:
    """The columns of every row's group maxima of ``|(synced_at - before) m|`` (ranked by their bits),
    the column ``excluded[:, j]`` of group ``j`` below every other of its group: ``(rows, k)`` int64.

    Example:
        >>> m = torch.tensor([[1.0, 3.0, 2.0, 5.0]]); w = torch.zeros(1, 4)
        >>> fused_pick(m, w, torch.tensor(-1.0), torch.tensor([[1, 3]]), 2)   # groups [0, 2), [2, 4)
        tensor([[0, 2]])
    """
    rows, size = m.shape
    g, r = divmod(size, k)
    keys = ((synced_at - before) * m).abs().view(torch.int32)
    wide = r * (g + 1)
    parts = []
    for lo, hi, first, n, width in ((0, wide, 0, r, g + 1), (wide, size, r, k - r, g)):  # wider groups, then the rest
        if not n:
            continue
        offsets = torch.arange(lo, hi, width, device=m.device)  # each group's first column
        part = keys[:, lo:hi].unflatten(1, (n, width))
        own = excluded[:, first:first + n] - offsets  # the excluded offset in each group
        hit = torch.arange(width, device=m.device) == own[..., None]  # a broadcast: no index per coordinate
        part = torch.where(hit, excluded_key(part), part)
        parts.append(part.argmax(-1) + offsets)
    return parts[0] if len(parts) == 1 else torch.cat(parts, 1)


def eager_pick(layout: FlatLayout, m: Tensor, synced_at: Tensor, target: int, previous: Mask, density: float,
               out: Tensor) -> Tensor:
    """The library's path: the score into ``out``, then :func:`select_groups` (int16 columns)."""
    score = age_momentum_score(m, synced_at, target, out=out)
    return select_groups(score, layout, layout.mask_shape(density), previous)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=6167)
    p.add_argument("--chunk", type=int, default=4096)
    p.add_argument("--k", type=int, default=309, help="picks per row (309: 99%% on the int4 wire)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads (the benchmarks' ranks run one each)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows, chunk, k = args.rows, args.chunk, args.k
    layout = FlatLayout({"w": torch.zeros(rows, chunk)}, chunk=chunk)
    density = k / chunk
    assert layout.mask_shape(density).k == k, "pick a k that the layout's rounding gives back"
    m = torch.randn(rows, chunk)
    synced_at = torch.randint(0, 40, (rows, chunk)).float()
    target = 41
    previous = Mask(density, eager_pick(layout, m.roll(1, 1), synced_at, target - 1,
                                        Mask(density, torch.zeros(rows, k, dtype=torch.int16)), density,
                                        torch.empty_like(m)))  # a groups mask of the same k
    out = torch.empty_like(m)
    before = torch.tensor(float(target - 1))
    excluded = previous.cols.long()
    compiled = torch.compile(fused_pick, fullgraph=True, dynamic=False)
    t0 = time.perf_counter()
    got = compiled(m, synced_at, before, excluded, k)
    compile_s = time.perf_counter() - t0
    want = eager_pick(layout, m, synced_at, target, previous, density, out.clone())
    same = torch.equal(got.to(torch.int16), want)
    eager = lambda: eager_pick(layout, m, synced_at, target, previous, density, out)  # noqa: E731
    t_eager = median_ms(eager, args.repeats, warm=True)
    t_fused = median_ms(lambda: compiled(m, synced_at, before, excluded, k), args.repeats, warm=True)
    n = rows * chunk
    fused_bytes = (m.numel() * 4 + synced_at.numel() * 4 + excluded.numel() * 8 + got.numel() * 8) / n
    print(f"{rows} rows x {chunk}, k = {k}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    print(f"same picks as select_groups: {same}; first call (compile) {compile_s:.1f} s")
    print(f"per call, median of {args.repeats}: eager (score pass + select_groups) {t_eager:.1f} ms, "
          f"fused {t_fused:.1f} ms ({t_fused / t_eager:.2f}x)")
    print(f"boundary bytes of the fused pass: {fused_bytes:.2f} B per coordinate (reads m and the windows, "
          "the excluded columns; writes the picks)")
    if not same:
        sys.exit("fused_pick: the picks differ from select_groups")


if __name__ == "__main__":
    main()
