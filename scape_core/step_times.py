"""Whether SCAPE paid on this run: the wall time of its dense and sparse steps, and the line that says so.

SCAPE's dense warm-up is a free baseline on the user's own model, data and link: the same loop,
every coordinate exchanged. :class:`StepTimes` measures the wall time from the end of one optimizer
step to the end of the next (forward, backward, the exchange, the update: all a step costs), for
the dense warm-up steps and for the sparse steps at the target density. It leaves out each phase's
first :data:`SETTLE_STEPS` steps (DDP's bucket rebuild, the first allocations, a ``torch.compile``
with ``kernels="compiled"``) and the ramp's steps, and reports medians, so that an occasional slow
step (a validation pass, a checkpoint) does not move them.

The clock is the host's (``time.perf_counter`` at the end of each optimizer step): no device
synchronization is added. On CUDA the host runs ahead of the device by a bounded queue, so over
many steps the host's step time is the device's whenever the loop reads the device somewhere
(``loss.item()``, a logger); without any such read, a step is measured as the host issued it.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Mapping

from scape_core.config import ScapeConfig

SETTLE_STEPS = 3  # each phase's first steps (bucket rebuild, allocations, compiles) are not timed
KEPT_STEPS = 512  # the latest steps of each phase the medians are taken over
FASTER = 1.05  # sparse steps this much faster than dense ones count as having paid


class StepTimes:
    """The wall time of each timed step, by phase: ``"dense"`` (the warm-up) and ``"sparse"`` (at the
    target density, after the ramp). :meth:`tick` at the end of every optimizer step;
    :meth:`restart` where the time since the last step is not a step's (a dropped step, a load).

    Example:
        >>> times = StepTimes(ScapeConfig(sparsity=0.99, warmup_steps=6, ramp_steps=0))
        >>> for step in range(12):
        ...     times.tick(step)
        >>> len(times.seconds["dense"]), len(times.seconds["sparse"])  # steps 4-5 and 9-11
        (2, 3)
        >>> times.median("dense") > 0
        True
    """

    def __init__(self, config: ScapeConfig) -> None:
        self.schedule = config.schedule
        self.target_start = config.target_step
        self.seconds: dict[str, deque[float]] = {phase: deque(maxlen=KEPT_STEPS) for phase in ("dense", "sparse")}
        self.seen = dict.fromkeys(self.seconds, 0)  # intervals seen per phase since the last restart
        self.last: float | None = None  # perf_counter at the end of the last optimizer step

    def phase(self, step: int) -> str | None:
        """``"dense"``, ``"sparse"`` (at the target density) or ``None`` (the ramp) for ``step``."""
        if self.schedule.is_dense(step):
            return "dense"
        return "sparse" if step >= self.target_start else None

    def tick(self, step: int) -> None:
        """Optimizer step ``step`` just ended: time it from the end of the one before."""
        now = time.perf_counter()
        last, self.last = self.last, now
        phase = self.phase(step)
        if last is None or phase is None:
            return
        self.seen[phase] += 1
        if self.seen[phase] > SETTLE_STEPS:
            self.seconds[phase].append(now - last)

    def restart(self) -> None:
        """The time until the next step's end is not one step's: leave it out, and settle again."""
        self.last = None
        self.seen = dict.fromkeys(self.seconds, 0)

    def median(self, phase: str) -> float:
        """The median timed step of ``phase`` in seconds; 0.0 while none is timed."""
        kept = self.seconds[phase]
        return statistics.median(kept) if kept else 0.0


def _seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 0.1 else f"{s:.2f} s"


def _bytes(n: float) -> str:
    if n >= 1e7:
        return f"{n / 1e6:,.0f} MB"
    return f"{n / 1e6:,.1f} MB" if n >= 1e5 else f"{n / 1e3:,.1f} kB"


def what_would_help(config: ScapeConfig) -> str:
    """The settings that make a sparse step cheaper, those not already chosen; empty when none is left.

    Example:
        >>> what_would_help(ScapeConfig(sparsity=0.99))
        'wire="native" (fp32 values: fewer coordinates to encode and update), sparsity above 0.99 (fewer \
coordinates per step), kernels="compiled" (on CUDA: the passes over every coordinate fused)'
    """
    hints = []
    if config.resolved_wire != "native":
        hints.append('wire="native" (fp32 values: fewer coordinates to encode and update)')
    if config.sparsity < 0.999:
        hints.append(f"sparsity above {config.sparsity:g} (fewer coordinates per step)")
    if config.kernels != "compiled":
        hints.append('kernels="compiled" (on CUDA: the passes over every coordinate fused)')
    return ", ".join(hints)


def summary_line(stats: Mapping[str, float], config: ScapeConfig, world_size: int = 2) -> str:
    """One line on whether SCAPE paid in a run: its sparse steps' time against its dense warm-up's,
    and the bytes sent against dense DDP's; when the sparse steps are not faster, it says so and
    names the settings that would help. ``stats`` is :meth:`ScapeState.stats`'s.

    Example:
        >>> stats = dict(step_seconds_dense=1.2, step_seconds_sparse=0.41, bytes_sent=308.4e6, dense_bytes=2769.7e6)
        >>> summary_line(stats, ScapeConfig())
        'SCAPE: sparse steps 0.41 s against 1.20 s for the dense warm-up: 2.9x faster; 308 MB sent instead of \
2,770 MB'
    """
    dense, sparse = stats.get("step_seconds_dense", 0.0), stats.get("step_seconds_sparse", 0.0)
    sent = ("nothing sent (one process)" if world_size == 1
            else f"{_bytes(stats['bytes_sent'])} sent instead of {_bytes(stats['dense_bytes'])}")
    if config.dense:
        timed = f"steps {_seconds(dense)} each" if dense else "steps not timed (too few)"
        return f"SCAPE: sparsity=0, every step dense (DDP + AdamS): {timed}; {sent}"
    if not sparse:
        when = f"it starts at step {config.target_step} and its first {SETTLE_STEPS} steps are not timed"
        dense_part = f"dense warm-up steps {_seconds(dense)}; " if dense else ""
        return f"SCAPE: {dense_part}no sparse step at the target density was timed ({when}); {sent}"
    if not dense:
        return (f"SCAPE: sparse steps {_seconds(sparse)}; the dense warm-up was not timed (it needs more than "
                f"{SETTLE_STEPS + 1} steps in this run: its first {SETTLE_STEPS} are not timed); {sent}")
    ratio = dense / sparse
    head = f"SCAPE: sparse steps {_seconds(sparse)} against {_seconds(dense)} for the dense warm-up"
    if ratio >= FASTER:
        return f"{head}: {ratio:.1f}x faster; {sent}"
    verdict = "slower" if ratio < 1 else "not faster"
    hints = what_would_help(config)
    helps = (f"; what would make them faster: {hints}" if hints
             else "; on this link dense DDP (sparsity=0) is the faster choice")
    return (f"{head}: {verdict} ({ratio:.2f}x), SCAPE's own work per step costs more than the bytes it saves take "
            f"on this link; {sent}{helps}")
