"""The compiled pick against the eager one: ``selection="groups"`` as one pass, measured.

Eager, a selection writes the score (``|m| (n - 1)``) into a scratch buffer, moves the excluded
coordinates below the others (a gather and a scatter) and takes each group's maximum (two ``argmax``
over views). With ``kernels="compiled"`` the library runs :func:`scape_core.masks.pick_pass`
instead: the score, the exclusion of the mask being flushed (a groups mask of the same ``k``: one
comparison per group) and each group's best are one function of ``m`` and the windows, which also
writes the mask's entries; no score is stored. This checks that both choose the same columns and
entries, and reports time per call and the bytes each reads and writes at its boundary (what a
memory-bound GPU pays).

    python benchmarks/experiments/fused_pick.py                      # 25M coordinates, 99% int4 (k = 309 of 4,096)
    python benchmarks/experiments/fused_pick.py --rows 2048 --k 41   # a smaller one
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script from anywhere

from benchmarks.bench_common import median_ms  # noqa: E402
from scape_core.kernels import Kernels  # noqa: E402
from scape_core.layout import FlatLayout  # noqa: E402
from scape_core.masks import Mask, age_momentum_score, pick_compiled, select_groups  # noqa: E402


def eager_pick(layout: FlatLayout, m: Tensor, synced_at: Tensor, target: int, previous: Mask, density: float,
               out: Tensor) -> Mask:
    """The eager path: the score into ``out``, then :func:`select_groups`, then the entries."""
    score = age_momentum_score(m, synced_at, target, out=out)
    mask = Mask(density, select_groups(score, layout, layout.mask_shape(density), previous))
    mask.flat(layout)
    return mask


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
    layout = FlatLayout({"w": torch.zeros(rows, chunk), "b": torch.zeros(chunk // 3)}, chunk=chunk)  # and a short row
    density = k / chunk
    shape = layout.mask_shape(density)
    assert shape.k == k, "pick a k that the layout's rounding gives back"
    m = torch.randn(layout.rows, chunk)
    synced_at = torch.randint(0, 40, (layout.rows, chunk)).float()
    target = 41
    out = torch.empty_like(m)
    previous = eager_pick(layout, m.roll(1, 1), synced_at, target - 1, None, density, out.clone())
    previous.groups = True  # a groups mask of the same density: what the compiled pick excludes group by group
    kernels = Kernels("compiled")
    every = slice(0, layout.rows)

    def fused() -> tuple[Tensor, Tensor]:
        return pick_compiled(kernels, m, synced_at, target, None, previous.cols, layout, shape, every, entries=True)

    t0 = time.perf_counter()
    cols, entries = fused()
    compile_s = time.perf_counter() - t0
    want = eager_pick(layout, m, synced_at, target, previous, density, out.clone())
    same = torch.equal(cols, want.cols) and torch.equal(entries.long(), want.flat(layout))
    t_eager = median_ms(lambda: eager_pick(layout, m, synced_at, target, previous, density, out), args.repeats,
                        warm=True)
    t_fused = median_ms(fused, args.repeats, warm=True)
    n = layout.rows * chunk
    short = shape.short_rows(0, layout.rows)
    read = (m.numel() + synced_at.numel()) * 4 + previous.cols.numel() * 2 + sum(t.numel() * 8 for t in short)
    read += (layout.full_rows.numel() + layout.partial_rows.numel() + shape.partial_index.numel()) * 8
    written = cols.numel() * 2 + entries.numel() * entries.element_size()
    print(f"{layout.rows} rows x {chunk}, k = {k}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    print(f"same columns and entries as select_groups: {same}; first call (compile) {compile_s:.1f} s")
    print(f"per call, median of {args.repeats}: eager (score pass + select_groups + entries) {t_eager:.1f} ms, "
          f"compiled pick {t_fused:.1f} ms ({t_fused / t_eager:.2f}x)")
    print(f"boundary bytes of the compiled pick: {(read + written) / n:.2f} B per coordinate (reads m, the windows "
          "and the excluded columns; writes the columns and the entries)")
    if not same:
        sys.exit("fused_pick: the compiled pick differs from select_groups")


if __name__ == "__main__":
    main()
