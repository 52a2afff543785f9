"""SCAPE's collectives, held by Python until gloo is surely done with them, and finished at exit.

A gloo collective launched during ``backward()`` (every comm-hook all-reduce) captures the
backward's thread-local state, which in torch 2.13 holds a Python object; the hook's
``fut.then(...)`` callback is another. gloo finishes the collective on its own worker thread,
and whichever side drops the last reference to it frees those Python objects, which needs the
GIL. On gloo's thread during interpreter finalization that cannot happen, and the process
aborts: "terminate called without an active exception" (stock DDP on gloo does the same in
torch 2.13: 11 of 20 two-rank runs of a 4-step script). So:

- Python keeps a reference to every collective SCAPE starts and drops it at the :func:`hold`
  after the one that saw it finished, by when gloo's thread (a few microseconds behind
  ``finish()``) has let go, so the work is freed on a Python thread that holds the GIL. (During
  training a free on gloo's thread would only wait for the GIL; the danger is at exit.)
- At exit (``atexit``, before finalization) every held collective is waited for, callbacks
  included (``Work.wait()`` returns after them), and the remaining references are kept for
  good, so gloo's thread never frees one while the interpreter shuts down.

A blocking collective (``async_op=False``) is exposed the same way: torch drops its work as soon as it
is waited for, so gloo's thread, a moment behind, frees it and its tensors' Python objects. At a
teardown inside a destructor that holds the GIL (a DDP model freed after ``destroy_process_group()``:
its Reducer holds the last reference to the process group, whose destructor joins gloo's threads) that
thread waits for the GIL forever. So every collective SCAPE starts, blocking ones included, goes
through :func:`hold` (blocking ones through :func:`collective`).

Collectives SCAPE does not start have the same exposure: transformers' ``Trainer`` ends ``train()``
with a ``dist.all_gather`` of Python tensors (``store_flos``), and a worker ("pt_gloo_runloop")
preempted under load frees that work, and the tensors' Python objects, after the script has
ended; a core dump showed it abort in ``AsyncAllgatherWork``'s destructor, taking the GIL inside
``Py_FinalizeEx`` (stock ``Trainer``: 3 of 40 launches under load). So the exit handler also waits,
with the GIL free, until no other thread of the process is running (:func:`quiesce_threads`).
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading
import time
import warnings
from typing import Any, Callable

import torch.distributed as dist

_PENDING: list[dist.Work] = []  # started, not yet seen finished
_FINISHED: list[dist.Work] = []  # seen finished at the last hold(): dropped at the next one


def hold(work: dist.Work) -> dist.Work:
    """Keep a reference to ``work`` until it is safe to drop (see the module docstring); return it."""
    done = [w.is_completed() for w in _PENDING]
    _FINISHED[:] = [w for w, d in zip(_PENDING, done) if d]
    _PENDING[:] = [w for w, d in zip(_PENDING, done) if not d] + [work]
    return work


def collective(start: Callable[..., dist.Work], *args: Any, **kwargs: Any) -> None:
    """Run ``start(*args, async_op=True, **kwargs)`` (a ``torch.distributed`` collective) to completion, its
    work held (:func:`hold`): SCAPE's blocking collectives, freed by Python, never by gloo's thread.

    Example:
        >>> out = [torch.zeros(2) for _ in range(dist.get_world_size())]
        >>> collective(dist.all_gather, out, torch.ones(2))
        >>> out
        [tensor([1., 1.])]
    """
    hold(start(*args, async_op=True, **kwargs)).wait()


def finish_all() -> None:
    """Wait for every held collective (one that failed is reported as a warning, not raised)."""
    for work in list(_PENDING):
        try:
            work.wait()
        except Exception as e:  # the process group is already gone: nothing left to wait for
            warnings.warn(f"SCAPE: a collective could not be finished: {e}", stacklevel=1)


def other_threads() -> list[str] | None:
    """The scheduler states (``R`` running or runnable, ``S`` sleeping, ...) of this process's threads but
    the calling one (gloo's workers among them: their names vary); ``None`` where ``/proc`` cannot tell."""
    me, states = str(threading.get_native_id()), []
    try:
        for tid in os.listdir("/proc/self/task"):
            if tid == me:
                continue
            try:
                with open(f"/proc/self/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:  # the thread ended meanwhile
                continue
    except OSError:
        return None
    return states


def quiesce_threads(timeout: float = 2.0, quiet_checks: int = 3) -> None:
    """Sleep (the GIL free, so a thread waiting for it to free a Python object gets it) until no other
    thread of the process has been running at ``quiet_checks`` checks 10 ms apart, at most ``timeout``
    seconds: after this, no gloo worker is still freeing a finished collective when the interpreter
    finalizes. Returns at once without other threads; where ``/proc`` cannot tell, sleeps the
    ``quiet_checks`` intervals."""
    states = other_threads()
    if states is not None and not states:
        return
    deadline, quiet = time.monotonic() + timeout, 0
    while quiet < quiet_checks and time.monotonic() < deadline:
        time.sleep(0.01)
        states = other_threads()
        quiet = 0 if states and "R" in states else quiet + 1


@atexit.register
def _finish_at_exit() -> None:
    finish_all()
    quiesce_threads()
    # gloo's thread may hold its own reference a moment longer; ours must outlive it
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(_PENDING))
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(_FINISHED))
