"""Launch each way in's shortest script (README's runnable blocks) many times and count the runs that end
badly: a non-zero exit, or an abort at exit ("terminate called without an active exception", SIGABRT)
after a good run, which every scheduler marks failed.

Each launch is ``torchrun --standalone`` of the block, as ``tests/test_readme.py`` runs it (2 CPU
processes, gloo, one thread each), in a fresh folder. ``--load N`` runs N busy processes beside the
launches (the CI machine has 2 cores, other jobs on it). Out of the default suite: 30 launches of
every block take about an hour on 2 cores.

    python tests/scripts/exit_stress.py --launches 30 --load 1            # every block
    python tests/scripts/exit_stress.py --blocks transformers --launches 30
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.test_readme import MY_PROJECT, RUNS  # noqa: E402

ABORT = "terminate called without an active exception"


def busy(stop_at: float) -> None:
    """One core's worth of load until ``stop_at``."""
    x = 0
    while time.time() < stop_at:
        x = (x * 31 + 7) % 1_000_003


def launch(code: str, nproc: int, timeout: float) -> dict:
    """One torchrun of ``code``: its exit code, whether it aborted at exit, and its seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "my_project.py").write_text(MY_PROJECT)
        (Path(tmp) / "snippet.py").write_text(code)
        env = dict(os.environ, OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="1", PYTHONUNBUFFERED="1",
                   PYTHONPATH=os.pathsep.join([tmp, str(ROOT), os.environ.get("PYTHONPATH", "")]))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               "snippet.py"]
        start = time.time()
        try:
            proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"rc": "timeout", "abort": False, "seconds": timeout, "tail": ""}
        out = proc.stdout + proc.stderr
        return {"rc": proc.returncode, "abort": ABORT in out or "Signal 6" in out or "SIGABRT" in out,
                "seconds": round(time.time() - start, 1), "tail": "" if proc.returncode == 0 else out[-3000:]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names: dict[str, tuple[int, str]] = {}
    for heading, n, code in RUNS:  # a section's second block (Lightning's Fabric) gets a number
        name = re.sub(r"\W+", "-", heading).strip("-").lower()
        names[name if name not in names else f"{name}-{sum(k.startswith(name) for k in names) + 1}"] = (n, code)
    p.add_argument("--blocks", nargs="+", default=list(names), help=f"substrings of: {', '.join(names)}")
    p.add_argument("--launches", type=int, default=30)
    p.add_argument("--load", type=int, default=1, help="busy processes beside the launches")
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "exit_stress.json")
    args = p.parse_args(argv)
    chosen = {name: names[name] for name in names if any(b in name for b in args.blocks)}
    results: dict = {}
    for name, (nproc, code) in chosen.items():
        stop_at = time.time() + args.launches * args.timeout
        load = [multiprocessing.Process(target=busy, args=(stop_at,), daemon=True) for _ in range(args.load)]
        for proc in load:
            proc.start()
        runs = []
        try:
            for i in range(args.launches):
                runs.append(launch(code, nproc, args.timeout))
                bad = sum(r["rc"] != 0 for r in runs)
                print(f"{name}: launch {i + 1}/{args.launches}: exit {runs[-1]['rc']} in {runs[-1]['seconds']} s "
                      f"({bad} bad so far)", flush=True)
        finally:
            for proc in load:
                proc.terminate()
        results[name] = {"launches": len(runs), "bad": sum(r["rc"] != 0 for r in runs),
                         "aborts": sum(r["abort"] for r in runs), "load": args.load,
                         "median_seconds": sorted(r["seconds"] for r in runs)[len(runs) // 2],
                         "failures": [r["tail"] for r in runs if r["rc"] != 0][:3]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    for name, r in results.items():
        print(f"{name}: {r['bad']} of {r['launches']} launches ended badly ({r['aborts']} aborts at exit), "
              f"load {r['load']}, median {r['median_seconds']} s")
    return results


if __name__ == "__main__":
    main()
