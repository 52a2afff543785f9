"""Consecutive skipped steps: counted on the device every step, read only where the host may wait.

A step is skipped when any rank's gradients are non-finite (the verdict stays on the device, so a
sparse step never waits for the host). :class:`SkipStreak` keeps the current streak in a small
device tensor; it is read by ``ScapeState.stats()`` (which reads the device anyway) or, when
nothing calls it, from a non-blocking copy that ``ScapeState.end_step`` starts every
:data:`STREAK_CHECK_EVERY` steps and looks at the next time. A long streak warns once, on rank 0;
a rank whose own gradients were non-finite in it (known on sparse steps, where each rank checks
what it sends) says so itself, so no collective is needed to name it. It warns, never raises: a
skipped step loses nothing, a streak can end, and a raise on one rank would leave the others
waiting in their next collective (``docs/reliability.md``).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import Tensor

STREAK_CHECK_EVERY = 25  # steps between the reads of the skip streak when nothing else reads the device
# what a failed check means (scape_core.exchange.all_finite sums the values in fp32)
NOT_FINITE = ("NaN or inf values, or finite values so large (near fp32's limit, 3.4e38) that their fp32 sum "
              "overflowed; SCAPE drops such a step, as torch's GradScaler drops an overflowing one")


class SkipStreak:
    """The streak of consecutive skipped steps of one rank, and its warnings.

    Example:
        >>> streak = SkipStreak(limit=2, rank=0, device=torch.device("cpu"))
        >>> for step in range(3):
        ...     streak.count(torch.tensor(True), torch.tensor(False), step)
        >>> streak.current()
        3
    """

    def __init__(self, limit: int, rank: int, device: torch.device) -> None:
        self.limit, self.rank, self.device = limit, rank, device
        # [consecutive skipped steps now, of them with this rank's own gradients non-finite,
        #  streaks that reached the limit, the step the last one did, this rank's own count then]
        self.counters = torch.zeros(5, dtype=torch.long, device=device)
        self._step = torch.zeros(1, dtype=torch.long, device=device)  # count()'s step, on the device
        # count()'s views of the counters, made once
        self._runs, self._run, self._own = self.counters[:2], self.counters[0], self.counters[1:2]
        self._tail, self._reached = self.counters[2:], self.counters[2:3]
        self._warned = 0
        self._copy: tuple[Tensor, Any] | None = None  # (host copy, its device event) in flight

    def count(self, skip: Tensor, own_bad: Tensor, step: int) -> None:
        """Step ``step`` ended: ``skip`` (0-dim bool) whether it was skipped, ``own_bad`` whether this
        rank's own gradients were non-finite. A few 0-dim kernels on views made once, no host read."""
        self._runs.add_(torch.stack([skip, own_bad])).mul_(skip)  # the streaks, reset by a taken step
        self._step.fill_(step)
        reached = self._run == self.limit
        self._tail.copy_(torch.where(reached, torch.cat([self._reached + 1, self._step, self._own]), self._tail))

    def current(self) -> int:
        """Consecutive skipped steps now (reads the device)."""
        return int(self.counters[0])

    def check(self) -> None:
        """Warn of a streak that reached the limit since the last warning (reads the device)."""
        if self.limit:
            self._warn(self.counters.tolist())

    def poll(self) -> None:
        """Without waiting: look at the copy the last poll started (done by now, or left for the next
        poll), then start a new one (``non_blocking``, with an event on an accelerator)."""
        if not self.limit:
            return
        if self._copy is not None:
            host, event = self._copy
            if event is not None and not event.query():
                return
            self._warn(host.tolist())
        host = torch.empty(5, dtype=torch.long, pin_memory=self.device.type == "cuda")
        host.copy_(self.counters, non_blocking=self.device.type != "cpu")
        event = None
        if self.device.type != "cpu":
            event = torch.Event(device=self.device.type)
            event.record()
        self._copy = (host, event)

    def _warn(self, counters: list[int]) -> None:
        reached, at, own = counters[2:]
        if reached <= self._warned:
            return
        self._warned = reached
        steps = f"steps {at - self.limit + 1}..{at}"
        if self.rank == 0:
            warnings.warn(f"SCAPE: {self.limit} consecutive optimizer steps were skipped ({steps}): the gradients "
                          f"did not pass SCAPE's finiteness check at each ({NOT_FINITE}), so nothing is being learned. "
                          "Check the loss, its scale and the learning rate; stats()['skipped_streak'] counts the "
                          "current streak", stacklevel=3)
        if own:
            warnings.warn(f"SCAPE: rank {self.rank}'s own gradients failed the finiteness check in {own} of the "
                          f"{self.limit} consecutive skipped steps ({steps}): {NOT_FINITE}", stacklevel=3)
