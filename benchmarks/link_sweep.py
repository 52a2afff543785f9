"""Speed-up over dense DDP against the link's bandwidth, from ``comm_bench.py`` runs at several rates.

Each input is one ``comm_bench.py --links slow --gbit RATE`` report. For every method the speed-up
is the median over rounds of dense DDP's step time over the method's (the i-th timed step of every
method ran in the same round); the ceiling is dense DDP over the no-communication bound, the most
any method can gain at that rate. Prints a Markdown table and draws one picture.

    for g in 0.1 0.3 1 3 10; do
      sudo python benchmarks/comm_bench.py --links slow --batches 1 --rounds 4 --gbit $g --json runs/comm_${g}gbit.json
    done
    python benchmarks/link_sweep.py runs/comm_*gbit.json --plot docs/speedup_vs_link.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

DENSE, BOUND = "DDP + AdamW", "no-comm + AdamS"
LABELS = {BOUND: "no communication (the ceiling)", "SCAPE 99%": "SCAPE 99%, the default (int4 values)",
          "SCAPE 99% native": "SCAPE 99%, wire=\"native\" (fp32 values)"}


def speedups(report: dict[str, Any], batch: int = 1) -> tuple[float, dict[str, tuple[float, float]]]:
    """``(Gbit/s, {method: (dense / method, bound / method)})`` of one ``comm_bench.py`` report: the speed-up
    over dense DDP and the share of the no-communication throughput kept, each the median over rounds of
    the ratio within a round (the i-th timed step of every method ran in the same round).

    Example:
        >>> report = {"command": "python benchmarks/comm_bench.py --gbit 0.5", "summary": {"slow/1": {
        ...     "DDP + AdamW": {"times": [2.0, 4.0, 3.0]}, "no-comm + AdamS": {"times": [0.5, 0.5, 1.0]},
        ...     "SCAPE": {"times": [1.0, 1.0, 2.0]}}}}
        >>> gbit, rows = speedups(report)
        >>> gbit, rows["SCAPE"]
        (0.5, (2.0, 0.5))
    """
    words = report["command"].split()
    gbit = float(words[words.index("--gbit") + 1]) if "--gbit" in words else 1.0
    rows = report["summary"][f"slow/{batch}"]
    dense, bound = rows[DENSE]["times"], rows[BOUND]["times"]
    return gbit, {name: (statistics.median(d / t for d, t in zip(dense, row["times"])),
                         statistics.median(b / t for b, t in zip(bound, row["times"])))
                  for name, row in rows.items()}


def common(points: list[tuple[float, dict[str, tuple[float, float]]]]) -> list[str]:
    """The methods every report ran."""
    return [n for n in points[0][1] if all(n in row for _, row in points)]


def table(points: list[tuple[float, dict[str, tuple[float, float]]]]) -> str:
    """One row per method, one column per rate: the speed-up over dense DDP + AdamW, then the share of the
    no-communication throughput kept."""
    names = common(points)
    lines = ["| speed-up over dense, share kept | " + " | ".join(f"{g:g} Gbit/s" for g, _ in points) + " |",
             "|---|" + "---|" * len(points)]
    for n in names:
        label = LABELS.get(n, n)
        lines.append(f"| {label} | " + " | ".join(f"{row[n][0]:.2f}x, {row[n][1]:.0%}" for _, row in points) + " |")
    return "\n".join(lines)


def plot(points: list[tuple[float, dict[str, tuple[float, float]]]], path: Path, title: str) -> None:
    """Speed-up against Gbit/s (log scale), the ceiling dashed, even with dense DDP dotted."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    rates = [g for g, _ in points]
    for n in [n for n in common(points) if n != DENSE]:
        style = dict(linestyle="--", color="gray") if n == BOUND else dict(marker="o")
        label = LABELS.get(n, n)
        ax.plot(rates, [row[n][0] for _, row in points], label=label, **style)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("link bandwidth per rank (Gbit/s)")
    ax.set_ylabel("speed-up over dense DDP + AdamW")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("reports", nargs="+", help="comm_bench.py JSON reports (--links slow), one per rate")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--plot", help="where to draw the picture (PNG)")
    args = p.parse_args()
    reports = [json.loads(Path(r).read_text()) for r in args.reports]
    points = sorted(speedups(report, args.batch) for report in reports)
    print(table(points))
    if args.plot:
        words = reports[0]["command"].split()
        context = words[words.index("--context") + 1] if "--context" in words else "128"
        plot(points, Path(args.plot), f"25M GPT, 2 CPU ranks, per-rank batch {args.batch} x {context} tokens")
        print(f"\nwrote {args.plot}")


if __name__ == "__main__":
    main()
