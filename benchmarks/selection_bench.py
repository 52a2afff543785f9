"""What choosing one mask costs on the CPU: the score and the pick, per selection, one thread.

``MaskSelector.choose`` (the step's whole selection: the score, the exclusion of the mask being
flushed, the pick, the shorter rows) on the layout of a GPT of ``--params`` parameters, with a
momentum and windows like a run's (random ``m``, windows of 1 to 40 steps), at the densities of
the defaults: 99% on the int4 wire (7.5% of the coordinates), 99% native (1%) and 90% (10%).
Timed as the calling thread's CPU time (``time.thread_time``: what the work costs whatever else
the machine runs), median of ``--repeats``, interleaved. Rows:

    topk            the default: the C radix select, the score computed inside it (no stored score)
    topk, torch     the same columns through torch: the score stored, then torch.topk over keys made
                    unique by column, sorted (what runs without a C compiler)
    groups          selection="groups": the score stored, then one argmax per group

    python benchmarks/selection_bench.py                  # 25M parameters, ~1 minute
    python benchmarks/selection_bench.py --params 5e6 --repeats 3
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.bench_common import GPT, RESULTS, core_version, machine  # noqa: E402
from scape_core import native  # noqa: E402
from scape_core.config import ScapeConfig  # noqa: E402
from scape_core.layout import FlatLayout  # noqa: E402
from scape_core.selection import MaskSelector  # noqa: E402

SETTINGS = {"99% int4 (default)": dict(sparsity=0.99), "99% native": dict(sparsity=0.99, wire="native"),
            "90%": dict(sparsity=0.9)}
ROWS = {"topk": dict(selection="topk"), "topk, torch": dict(selection="topk"), "groups": dict(selection="groups")}


def cpu_ms(fn, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        start = time.thread_time()
        fn()
        times.append((time.thread_time() - start) * 1e3)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--params", type=float, default=25e6)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", default=str(RESULTS / "selection_bench.json"))
    args = p.parse_args()
    torch.set_num_threads(1)
    model = GPT.sized(args.params, vocab=65, context=128)
    layout = FlatLayout({n: q for n, q in model.named_parameters()}, ScapeConfig().chunk_size)
    g = torch.Generator().manual_seed(0)
    m = torch.randn(layout.rows, layout.chunk, generator=g)
    windows = torch.randint(60, 100, (layout.rows, layout.chunk), generator=g).float()
    assert native.available(), "no C compiler: the default's C pick is what this measures"
    cases = {}
    for setting, fields in SETTINGS.items():
        for row, extra in ROWS.items():
            config = ScapeConfig(**fields, **extra, warmup_steps=2, ramp_steps=0)
            selector = MaskSelector(layout, config)
            shape = layout.mask_shape(config.density)
            flushed = selector.choose(100, shape.density, None, m, None, windows, 0.9)  # the mask being flushed
            cases[(setting, row)] = functools.partial(selector.choose, 101, shape.density, flushed, m, None,
                                                      windows, 0.9)
    times: dict[tuple[str, str], list[float]] = {key: [] for key in cases}
    for _ in range(args.repeats):  # interleaved
        for (setting, row), run in cases.items():
            if row == "topk, torch":
                saved, native._library = native._library, None
                native._unavailable = "measured"
                try:
                    times[(setting, row)] += cpu_ms(run, 1)
                finally:
                    native._library, native._unavailable = saved, None
            else:
                times[(setting, row)] += cpu_ms(run, 1)
    params = sum(q.numel() for q in model.parameters())
    lines = [f"MaskSelector.choose on the layout of a {params / 1e6:.1f}M GPT ({layout.rows} rows of {layout.chunk}), "
             f"one thread, CPU ms per mask, median of {args.repeats} (ratio to groups)", "",
             "| selection | " + " | ".join(SETTINGS) + " |", "|---|" + "---|" * len(SETTINGS)]
    report = {}
    for row in ROWS:
        cells = []
        for setting in SETTINGS:
            ms = statistics.median(times[(setting, row)])
            ratio = ms / statistics.median(times[(setting, "groups")])
            cells.append(f"{ms:.0f} ({ratio:.2f}x)")
            report[f"{setting} / {row}"] = {"ms": ms, "to_groups": ratio}
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    print(f"\n{machine()}; {core_version()}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"command": " ".join(sys.argv), "machine": machine(), "core": core_version(),
                                           "report": text, "cases": report, "times": {f"{a} / {b}": t for (a, b), t
                                                                                    in times.items()}}, indent=1))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
