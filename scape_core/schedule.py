"""When SCAPE is dense, how dense each mask is, and which step selects which mask: one pure object.

Steps are counted from 0 (``ScapeState.step``, skipped steps included). ``warmup_steps`` dense
steps come first; then, for ``ramp_steps`` steps, masks are denser (DGC's sparsity warm-up: 25%,
6.25%, 1.5625% density for a third of the ramp each, only the stages denser than the target);
then every mask has density ``1 - sparsity``. The mask used at step ``T`` is selected at the end
of step ``T - 1 - mask_delay`` (its exchange overlaps the steps in between); with
``mask_refresh = R`` only every R-th sparse step gets a new mask, the others reuse the last one.
"""

from __future__ import annotations

from dataclasses import dataclass

RAMP = (0.25, 0.0625, 0.015625)  # DGC's sparsity warm-up: 75%, 93.75%, 98.4%


@dataclass(frozen=True)
class MaskSchedule:
    """The mask schedule of a :class:`~scape_core.ScapeConfig` (every rank derives it alone).

    Example:
        >>> s = MaskSchedule(sparsity=0.99, warmup_steps=10, ramp_steps=30)
        >>> [s.density_at(t) for t in (10, 20, 30, 40)]
        [0.25, 0.0625, 0.015625, 0.010000000000000009]
        >>> s.is_dense(9), s.target_after(9), s.selects(12)
        (True, 11, True)
    """

    sparsity: float
    warmup_steps: int = 50
    ramp_steps: int = 150
    mask_delay: int = 1
    mask_refresh: int = 1

    @property
    def density(self) -> float:
        """The density after the ramp: ``1 - sparsity``."""
        return 1.0 - float(self.sparsity)

    @property
    def ramp_densities(self) -> tuple[float, ...]:
        """The ramp's stages that are denser than the target, in order."""
        return tuple(d for d in RAMP if d > self.density) if self.ramp_steps else ()

    def densities(self) -> tuple[float, ...]:
        """Every density a mask of this schedule can have."""
        return () if self.dense else self.ramp_densities + (self.density,)

    def densities_from(self, step: int) -> tuple[float, ...]:
        """The densities the masks of ``step`` and every later step can have (the ramp's past stages dropped).

        Example:
            >>> s = MaskSchedule(sparsity=0.99, warmup_steps=10, ramp_steps=30)
            >>> s.densities_from(0), s.densities_from(30), s.densities_from(40)
            ((0.25, 0.0625, 0.015625, 0.010000000000000009), (0.015625, 0.010000000000000009), (0.010000000000000009,))
        """
        if self.dense:
            return ()
        past = max(0, (step - self.warmup_steps) * 3 // self.ramp_steps) if self.ramp_steps else 0
        return self.ramp_densities[past:] + (self.density,)

    @property
    def dense(self) -> bool:
        """Every step is dense (``sparsity == 0``)."""
        return float(self.sparsity) == 0.0

    def is_dense(self, step: int) -> bool:
        """Whether ``step`` exchanges every coordinate (warm-up, or ``sparsity == 0``)."""
        return self.dense or step < self.warmup_steps

    def density_at(self, step: int) -> float:
        """Density of the mask used at the sparse ``step``."""
        stages = self.ramp_densities
        if stages:
            stage = (step - self.warmup_steps) * 3 // self.ramp_steps
            if 0 <= stage < len(stages):
                return stages[stage]
        return self.density

    def target_after(self, step: int) -> int:
        """The step whose mask is selected at the end of ``step``."""
        return step + 1 + self.mask_delay

    def selects(self, target: int) -> bool:
        """Whether ``target`` gets a new mask (``False``: dense, or it reuses the previous mask)."""
        return not self.is_dense(target) and (target - self.warmup_steps) % self.mask_refresh == 0

    def first_selected(self) -> int:
        """The first sparse step whose mask some earlier step selects (earlier ones use a fixed mask)."""
        return max(self.warmup_steps, 1 + self.mask_delay)
