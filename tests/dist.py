"""Run a function on N gloo processes on CPU and collect what each rank returns.

How long a run may take is not a fixed number of seconds: a loaded machine runs the same test
several times slower. A run fails when its ranks stop making progress (no CPU time used by any
of them, or their children, for :data:`STALL` seconds: a real hang, such as a rank waiting in a
collective the others never reach), when one rank fails and the others have not finished
:data:`GRACE` seconds later, or past ``timeout`` (a generous cap). Set ``SCAPE_TEST_STALL`` to
change the stall limit.
"""

from __future__ import annotations

import logging
import os
import socket
import tempfile
import time
import traceback
import warnings
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Iterator

import psutil
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STALL = float(os.environ.get("SCAPE_TEST_STALL", 120))  # seconds without CPU progress: a hang
GRACE = 60.0  # seconds the other ranks get to finish once one has failed
SAMPLE = 10.0  # seconds between two readings of the ranks' CPU time


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
        (Path(out) / f"{rank}.err").touch()  # seen at once by wait_for: the others get GRACE seconds
        torch.save({"error": traceback.format_exc()}, Path(out) / f"{rank}.pt")
    finally:
        dist.destroy_process_group()


@contextmanager
def said() -> Iterator[SimpleNamespace]:
    """What SCAPE says on this rank inside the block: ``.lines``, its log lines (the ``scape_core`` logger:
    the start-of-run line), and ``.warnings``, every warning's message."""
    heard = SimpleNamespace(lines=[], warnings=[])
    handler = logging.Handler()
    handler.emit = lambda record: heard.lines.append(record.getMessage())  # type: ignore[method-assign]
    logger = logging.getLogger("scape_core")
    logger.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield heard
    finally:
        logger.removeHandler(handler)
        heard.warnings += [str(w.message) for w in caught]


def failure(fn: Callable[[], Any]) -> str:
    """``"Type: message"`` of what ``fn()`` raises (``"no error"`` if nothing): what a rank reports back."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is what the tests check
        return f"{type(e).__name__}: {e}"
    return "no error"


def _cpu_seconds(procs: list[Any]) -> float:
    """CPU time used so far by the rank processes and their children (compile workers)."""
    total = 0.0
    for p in procs:
        try:
            proc = psutil.Process(p.pid)
            for q in [proc, *proc.children(recursive=True)]:
                times = q.cpu_times()
                total += times.user + times.system
        except psutil.Error:  # exited meanwhile
            continue
    return total


def wait_for(procs: list[Any], timeout: float, out: str) -> None:
    """Wait until every process exits; kill them all and raise ``TimeoutError`` on a stall, a failed
    rank whose peers do not finish, or past ``timeout`` (see the module docstring)."""
    start = last_progress = sampled = time.monotonic()
    cpu, failed_at, why = _cpu_seconds(procs), None, None
    while any(p.is_alive() for p in procs):
        time.sleep(0.5)
        now = time.monotonic()
        if now - sampled >= SAMPLE:  # progress: 5% of a core since the last reading (a blocked rank uses ~0)
            used = _cpu_seconds(procs)
            if used - cpu > 0.05 * (now - sampled):
                last_progress = now
            cpu, sampled = used, now
        failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) or (Path(out) / f"{r}.err").exists()]
        if failed and failed_at is None:
            failed_at = now
        if now - last_progress > STALL:
            why = (f"no rank made progress for {STALL:.0f}s (a hang: a rank waiting for a collective the others "
                   "never reach?)")
        elif failed_at is not None and now - failed_at > GRACE:
            why = f"rank {failed[0]} failed and the others did not finish within {GRACE:.0f}s"
        elif now - start > timeout:
            why = f"the ranks did not finish in {timeout:.0f}s"
        if why:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join()
            alive = [r for r, p in enumerate(procs) if not (Path(out) / f"{r}.pt").exists()]
            raise TimeoutError(f"{why}; ranks without a result: {alive}")


def run_distributed(fn: Callable, *args: Any, world_size: int = 2, timeout: float = 3600) -> list[Any]:
    """``fn(rank, world_size, *args)`` on each rank; returns the ranks' results, raises their errors.

    ``timeout`` is a cap for a run still making progress; a hang fails after :data:`STALL` seconds."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        # through a file, not pickled process arguments: those would put tensors in memory
        # shared by every rank, and optimizers load state without copying it
        torch.save(args, Path(out) / "args.pt")
        procs = [ctx.Process(target=_worker, args=(fn, r, world_size, port, out)) for r in range(world_size)]
        for p in procs:
            p.start()
        try:
            wait_for(procs, timeout, out)
        except TimeoutError as e:
            errors = [torch.load(Path(out) / f"{r}.pt", weights_only=False).get("error", "")
                      for r in range(world_size) if (Path(out) / f"{r}.pt").exists()]
            raise TimeoutError(f"{e}" + "".join(f"\n{err}" for err in errors if err)) from None
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
