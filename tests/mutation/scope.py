"""Narrow a cosmic-ray session to some functions: mark every other pending mutant as skipped.

cosmic-ray mutates whole modules; a bounded run (a before/after comparison on a 2-core machine)
wants the same few functions on both sides. Run between ``cr-filter-operators`` and
``cosmic-ray exec``::

    python tests/mutation/scope.py mutation.sqlite scape_core/update_rules.py:62-65 scape_core/hook.py:74-97

Each ``PATH:FIRST-LAST`` keeps the mutants whose first line is in that range (1-based, inclusive).
"""

from __future__ import annotations

import argparse
import sqlite3


def parse_range(text: str) -> tuple[str, int, int]:
    """``"path:first-last"`` as ``(path, first, last)``.

    Example:
        >>> parse_range("scape_core/hook.py:74-97")
        ('scape_core/hook.py', 74, 97)
    """
    path, _, lines = text.rpartition(":")
    first, _, last = lines.partition("-")
    if not path or not first.isdigit() or not last.isdigit() or int(first) > int(last):
        raise argparse.ArgumentTypeError(f"expected PATH:FIRST-LAST, got {text!r}")
    return path, int(first), int(last)


def narrow(session: str, keep: list[tuple[str, int, int]]) -> int:
    """Mark the pending mutants of ``session`` outside ``keep`` as skipped; return how many stay pending."""
    with sqlite3.connect(session) as db:
        done = {job for (job,) in db.execute("select job_id from work_results")}
        pending = [(job, path, row) for job, path, row in db.execute(
            "select job_id, module_path, start_pos_row from mutation_specs") if job not in done]
        drop = [job for job, path, row in pending
                if not any(path == p and first <= row <= last for p, first, last in keep)]
        db.executemany("insert into work_results (worker_outcome, output, test_outcome, diff, job_id) "
                       "values ('SKIPPED', 'outside the scope', NULL, '', ?)", [(job,) for job in drop])
    return len(pending) - len(drop)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("session", help="the cosmic-ray session (sqlite) after cr-filter-operators")
    parser.add_argument("ranges", nargs="+", type=parse_range, help="PATH:FIRST-LAST to keep")
    args = parser.parse_args()
    print(f"{narrow(args.session, args.ranges)} mutants pending in scope")


if __name__ == "__main__":
    main()
