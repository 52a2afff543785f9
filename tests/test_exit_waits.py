"""What SCAPE's exit handler waits for (scape_core/inflight.py): every held collective not yet finished, and,
where ``/proc`` cannot say whether gloo's workers are still running, its quiet intervals all the same."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from scape_core import inflight

ROOT = Path(__file__).resolve().parents[1]

HELD_AT_EXIT = textwrap.dedent("""
    from scape_core import inflight

    class Work:  # a collective: finished (is_completed) or not; wait() says it was waited for
        def __init__(self, name, done=False):
            self.name, self.done = name, done

        def is_completed(self):
            return self.done

        def wait(self):
            print("waited", self.name, flush=True)
            return True

    a, b, c = Work("a"), Work("b"), Work("c")
    for work in (a, b, c):
        inflight.hold(work)
    a.done = True
    inflight.hold(Work("d"))  # a seen finished here: dropped at the next hold
    print("script ends", flush=True)
""")


def test_every_held_unfinished_collective_is_waited_for_at_exit():
    """A script that holds four collectives and ends: the exit handler (registered with ``atexit`` on
    import) waits for each of the three not seen finished, after the script's last line. One left out, or
    no handler, and gloo's thread may free it during finalization (the abort of docs/reliability.md)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", HELD_AT_EXIT], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.split("\n")
    assert lines[0] == "script ends", proc.stdout
    assert sorted(line for line in lines[1:] if line) == ["waited b", "waited c", "waited d"], proc.stdout


def test_a_collective_that_cannot_be_finished_at_exit_is_a_warning(monkeypatch, recwarn):
    """The process group may already be gone at exit: the handler warns and waits for the rest."""
    waited = []

    class Work:
        def __init__(self, fails: bool) -> None:
            self.fails = fails

        def is_completed(self) -> bool:
            return False

        def wait(self) -> bool:
            waited.append(self)
            if self.fails:
                raise RuntimeError("the process group was destroyed")
            return True

    monkeypatch.setattr(inflight, "_PENDING", [])
    monkeypatch.setattr(inflight, "_FINISHED", [])
    first, second = Work(fails=True), Work(fails=False)
    inflight.hold(first)
    inflight.hold(second)
    inflight.finish_all()
    assert waited == [first, second]
    assert [str(w.message) for w in recwarn] == ["SCAPE: a collective could not be finished: the process group "
                                                 "was destroyed"]


def test_where_proc_cannot_tell_the_exit_still_waits_its_quiet_intervals(monkeypatch):
    """Without ``/proc/self/task`` (another OS, a sandbox) nobody can say whether a gloo worker is still freeing
    a finished collective, so the handler sleeps its ``quiet_checks`` intervals, not nothing."""
    def no_proc(path: str) -> list[str]:
        raise PermissionError(path)

    with monkeypatch.context() as m:
        m.setattr(inflight.os, "listdir", no_proc)
        assert inflight.other_threads() is None
    slept = []
    monkeypatch.setattr(inflight, "other_threads", lambda: None)
    monkeypatch.setattr(inflight.time, "sleep", slept.append)
    inflight.quiesce_threads(quiet_checks=3)
    assert slept == [0.01] * 3
    slept.clear()
    inflight.quiesce_threads(quiet_checks=5)
    assert slept == [0.01] * 5


COLLECTIVES = {"all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "barrier", "broadcast",
               "all_to_all_single", "reduce_scatter_tensor", "gather", "scatter", "reduce"}


def test_every_collective_scape_starts_is_held():
    """Every collective in ``scape_core`` is started inside ``inflight.hold(...)`` or handed to
    ``inflight.collective`` (never called blocking): a blocking collective's work is freed by gloo's thread,
    which waits forever for the GIL at a teardown inside a destructor that holds it (the 4-rank teardown
    deadlock of docs/reliability.md; ``tests/scripts/teardown_stress.py``). Read from the source."""
    import ast

    loose = []
    for path in sorted((ROOT / "scape_core").glob("*.py")):
        tree = ast.parse(path.read_text())
        held = set()
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "hold"
                    and node.args):
                held.add(id(node.args[0]))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call) or id(node) in held:
                continue
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            base = node.func.value.id if isinstance(node.func, ast.Attribute) and isinstance(
                node.func.value, ast.Name) else None
            if name in COLLECTIVES and (base == "dist" or (base is None and name == "all_gather_into_tensor")):
                loose.append(f"{path.name}:{node.lineno} {name}")
    assert not loose, loose
