"""tests/dist.py's multi-process runner: no fixed limit for a run that is working (a loaded machine
is slow, not hung), but a hang fails fast, naming it."""

from __future__ import annotations

import time

import pytest

from tests import dist


def _one_fails_one_waits(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank 1's own error")
    time.sleep(600)  # as a rank blocked in a collective its peer never reaches


def _one_hangs(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(600)  # no progress at all
    return rank


def test_a_failed_rank_ends_the_run_after_the_grace_with_its_error(monkeypatch):
    monkeypatch.setattr(dist, "GRACE", 2.0)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="rank 1 failed and the others did not finish") as e:
        dist.run_distributed(_one_fails_one_waits)
    assert "rank 1's own error" in str(e.value)
    assert time.monotonic() - start < 60


def test_a_run_without_progress_fails_as_a_hang(monkeypatch):
    monkeypatch.setattr(dist, "STALL", 4.0)
    monkeypatch.setattr(dist, "SAMPLE", 1.0)
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"no rank made progress for 4s .*ranks without a result: \[0, 1\]"):
        dist.run_distributed(_one_hangs)
    assert time.monotonic() - start < 60
