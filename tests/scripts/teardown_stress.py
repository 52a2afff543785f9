"""Launch a 4-rank plain-DDP SCAPE run many times and count the launches that hang or fail at teardown.

Each launch is one ``torch.multiprocessing.spawn`` of :func:`worker` on 4 gloo ranks (CPU, one thread
each), as a user's script would run it: a small transformer at ``sparsity=0.9`` (native wire, warm-up 6,
ramp 6), 18 steps, ``save_checkpoint``, ``dist.destroy_process_group()``, and the worker function
returns, which frees the DDP model. Every rank arms ``faulthandler.dump_traceback_later``; a launch that
has not ended after ``--timeout`` seconds counts as a deadlock: its ranks' native stacks are taken with
gdb (when installed), then it is killed. ``--stock`` runs the same loop with stock DDP and AdamW, no
SCAPE. Out of the default suite: about 13 s a launch on 2 cores.

    python tests/scripts/teardown_stress.py --launches 50                 # SCAPE
    python tests/scripts/teardown_stress.py --launches 50 --stock          # stock DDP alone
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

STEPS = 18
WORLD = 4


def worker(rank: int, world: int, port: int, out: str, stock: bool, release_first: bool, hang_after: float) -> None:
    """One rank: train, save a checkpoint, destroy the process group, return (the DDP model is freed then)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from scape_core import ScapeAdamS, ScapeState, save_checkpoint, scape_hook
    from tests.test_resume import TinyTransformer, _tokens

    trace = open(Path(out) / f"rank{rank}.traceback", "w")  # noqa: SIM115 - open until the process ends
    faulthandler.dump_traceback_later(hang_after, file=trace)  # every thread's Python stack if it hangs
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = TinyTransformer()
    ddp = DDP(model, bucket_cap_mb=0.02)  # several buckets
    if stock:
        opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3, weight_decay=0.1)
    else:
        state = ScapeState(ddp, sparsity=0.9, wire="native", warmup_steps=6, ramp_steps=6)
        ddp.register_comm_hook(state, scape_hook)
        opt = ScapeAdamS(ddp.parameters(), state, lr=3e-3, weight_decay=0.1)
    for step in range(STEPS):
        tokens = _tokens(step, rank)
        logits = ddp(tokens[:, :-1])
        nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
    if stock:
        if rank == 0:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, Path(out) / "ckpt.pt")
        dist.barrier()
    else:
        save_checkpoint(Path(out) / "ckpt.pt", state, model=model, optimizer=opt)
    if release_first:  # the workaround: the DDP model (its Reducer holds the process group) freed first
        del ddp, opt
        if not stock:
            del state
        gc.collect()  # a DDP model in a reference cycle is freed by the collector, not by the del
    dist.destroy_process_group()
    (Path(out) / f"rank{rank}.done").touch()
    # returning clears this frame: the DDP model is freed here, and with it its Reducer's process group


def launch_once(out: str, stock: bool, release_first: bool, hang_after: float) -> None:
    """The launch's own process: spawn the ranks and wait for them (as ``mp.spawn`` in a user's script)."""
    import torch.multiprocessing as mp

    from tests.dist import free_port

    mp.spawn(worker, args=(WORLD, free_port(), out, stock, release_first, hang_after), nprocs=WORLD, join=True)


def native_stacks(pid: int) -> str:
    """Every thread's native stack of process ``pid`` (gdb), or why not."""
    if shutil.which("gdb") is None:
        return "(gdb not installed)"
    proc = subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 30"],
                          capture_output=True, text=True, timeout=120)
    return proc.stdout[-20000:]


def children(pid: int) -> list[int]:
    """The process ids of ``pid``'s children (its ranks)."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def launch(timeout: float, stock: bool, release_first: bool, keep: Path | None) -> dict:
    """One launch: ``ok``, ``deadlock`` (past ``timeout``: stacks kept under ``keep``) or ``failed``."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, __file__, "--launch-once", out, "--hang-after", str(timeout - 15)]
        cmd += ["--stock"] * stock + ["--release-first"] * release_first
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        start = time.time()
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            text, _ = proc.communicate(timeout=timeout)
            outcome = "ok" if proc.returncode == 0 else "failed"
        except subprocess.TimeoutExpired:
            outcome, text = "deadlock", ""
            ranks = children(proc.pid)
            done = [r for r in range(WORLD) if (Path(out) / f"rank{r}.done").exists()]
            report = [f"ranks done (destroy_process_group returned): {done}; rank pids {ranks}"]
            for pid in ranks:
                report.append(f"===== pid {pid} native stacks\n{native_stacks(pid)}")
            os.killpg(proc.pid, signal.SIGKILL)
            text, _ = proc.communicate()
            for r in range(WORLD):
                trace = Path(out) / f"rank{r}.traceback"
                if trace.exists():
                    report.append(f"===== rank {r} faulthandler\n{trace.read_text()}")
            text = "\n".join(report) + "\n" + (text or "")
        seconds = round(time.time() - start, 1)
        if outcome != "ok" and keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            (keep / f"{outcome}-{int(start)}.txt").write_text(text)
        return {"outcome": outcome, "seconds": seconds, "tail": "" if outcome == "ok" else text[-2000:]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--launches", type=int, default=50)
    p.add_argument("--timeout", type=float, default=120, help="seconds before a launch counts as a deadlock")
    p.add_argument("--stock", action="store_true", help="stock DDP + AdamW, no SCAPE")
    p.add_argument("--release-first", action="store_true",
                   help="free the DDP model before destroy_process_group() (the workaround)")
    p.add_argument("--keep", type=Path, default=ROOT / "runs" / "teardown_stress",
                   help="where the output of a launch that hung or failed is kept")
    p.add_argument("--launch-once", metavar="DIR", help=argparse.SUPPRESS)
    p.add_argument("--hang-after", type=float, default=105, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.launch_once:
        launch_once(args.launch_once, args.stock, args.release_first, args.hang_after)
        return {}
    counts = {"ok": 0, "deadlock": 0, "failed": 0}
    seconds = []
    for n in range(args.launches):
        result = launch(args.timeout, args.stock, args.release_first, args.keep)
        counts[result["outcome"]] += 1
        seconds.append(result["seconds"])
        print(f"launch {n + 1}/{args.launches}: {result['outcome']} in {result['seconds']} s "
              f"(so far {counts})", flush=True)
        if result["tail"]:
            print(result["tail"], flush=True)
    summary = {"launches": args.launches, **counts, "stock": args.stock, "release_first": args.release_first,
               "median_seconds": sorted(seconds)[len(seconds) // 2] if seconds else None}
    print(json.dumps(summary), flush=True)
    return summary


if __name__ == "__main__":
    main()
