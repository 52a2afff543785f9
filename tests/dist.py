"""Run a function on N gloo processes on CPU and collect what each rank returns."""

from __future__ import annotations

import os
import socket
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn: Callable, rank: int, world_size: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    args = torch.load(Path(out) / "args.pt", weights_only=False)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        dist.barrier()  # every rank done with its collectives (SCAPE's async mask all-gathers included)
        torch.save({"ok": result}, Path(out) / f"{rank}.pt")
    except BaseException:
        torch.save({"error": traceback.format_exc()}, Path(out) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


def failure(fn: Callable[[], Any]) -> str:
    """``"Type: message"`` of what ``fn()`` raises (``"no error"`` if nothing): what a rank reports back."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is what the tests check
        return f"{type(e).__name__}: {e}"
    return "no error"


def run_distributed(fn: Callable, *args: Any, world_size: int = 2, timeout: float = 300) -> list[Any]:
    """``fn(rank, world_size, *args)`` on each rank; returns the ranks' results, raises their errors."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        # through a file, not pickled process arguments: those would put tensors in memory
        # shared by every rank, and optimizers load state without copying it
        torch.save(args, Path(out) / "args.pt")
        procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, out)) for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
                raise TimeoutError(f"rank did not finish in {timeout}s")
        results, errors = [], []
        for r in range(world_size):
            path = Path(out) / f"{r}.pt"
            if not path.exists():
                errors.append(f"rank {r} died (exit code {procs[r].exitcode})")
                continue
            res = torch.load(path, weights_only=False)
            if "error" in res:
                errors.append(f"rank {r} failed:\n{res['error']}")
            else:
                results.append(res["ok"])
        if errors:  # every rank's: the first is often only "connection closed" by the one that failed
            raise RuntimeError("\n".join(errors))
        return results
