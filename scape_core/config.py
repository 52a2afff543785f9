"""SCAPE hyperparameters, validated once, shared by the hook, the optimizer and the adapters."""

from __future__ import annotations

import dataclasses
import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch.distributed as dist

from scape_core.kernels import KERNELS
from scape_core.layout import MAX_CHUNK
from scape_core.masks import SELECTIONS
from scape_core.schedule import MaskSchedule
from scape_core.update_rules import UPDATE_RULES

SCORES = ("auto", "momentum_residual", "momentum", "age_momentum")
WIRES = ("auto", "native", "bfloat16", "int8", "int4")
WIRE_BITS = {"bfloat16": 16, "int8": 8, "int4": 4}
# wire="auto": the wire from each sparsity up, as measured at equal bytes (docs/benchmarks.md): int4 won at 1-3%
# of dense bytes, int8 at 5%, both tied native at 7% and lost at 10%
AUTO_WIRES = ((0.97, "int4"), (0.95, "int8"))
WINDOW_LIMIT_MEAN_WINDOWS = 8  # max_window=0: a coordinate is overdue after this many mean windows (chunk / k)


@dataclass(frozen=True)
class ScapeConfig:
    """How SCAPE sparsifies gradient communication.

    Args:
        sparsity: the share of a dense fp32 all-reduce's bytes a sparse step does NOT send, in
            ``[0, 1)``. ``0.99`` (default) sends about 1% of the bytes; ``0`` is dense DDP + AdamS. With
            native values that is the share of coordinates not exchanged (density ``1 - sparsity``);
            an encoded wire spends the same bytes on more coordinates (see ``wire``, :attr:`density`).
        warmup_steps: the first optimizer steps are dense (full all-reduce, dense AdamS); they
            fill the momentum the first mask is scored from.
        mask_delay: ``1`` (default) uses the mask selected after step ``t`` at step ``t + 2``,
            so its all-gather overlaps a whole step; ``0`` uses it at ``t + 1`` (ablation).
        mask_refresh: steps between new masks; ``1`` selects a new mask every step.
        error_feedback: keep what was not sent in a per-rank residual (default). ``False``
            drops it (ablation only: unsent gradient is lost).
        score: ``"age_momentum"`` scores ``|m| * (n - 1)``, ``n`` the coordinate's window at the
            step the mask is for (replicated: every rank selects the whole mask itself, no mask
            bytes); ``"momentum_residual"`` scores ``|beta1 * m + (1 - beta1) * residual|`` (the
            contract's first score: it reads each rank's residual, so rank r selects a partition of
            the rows and the partitions are all-gathered); ``"momentum"`` scores ``|m|`` (ablation).
            ``"auto"`` (default): the rule's own (``"age_momentum"`` for ``linear``,
            ``"momentum_residual"`` for ``lazy``).
        ramp_steps: after the warm-up, masks are denser for this many steps, as DGC's sparsity
            warm-up: 25%, 6.25%, 1.5625% density for ``ramp_steps / 3`` steps each (only the
            stages denser than ``1 - sparsity``), then ``1 - sparsity``. ``0``: no ramp.
        update: name of the masked update rule (see :mod:`scape_core.update_rules`).
        chunk_size: masks pick ``ceil(density * chunk_size)`` coordinates in every row of this
            many coordinates of the flat layout (a parameter's last, shorter row picks its share),
            with one batched top-k; at most 32768 (columns are int16).
        shard_optimizer: each rank keeps ``m``, the rule's statistics and the windows only for
            its block of ``1 / W`` of the coordinates (ZeRO-1, as the paper's distributed
            optimizer): per parameter ``4 + 12 / W`` bytes of state instead of 16, for more
            bytes per step (each owner's updates and its masks are all-gathered). Same masks
            and bit-identical parameters as the replicated mode.
        wire: how a sparse step's values travel. ``"native"``: in the gradients' dtype, one
            all-reduce. ``"bfloat16"``, ``"int8"``, ``"int4"``: 16, 8 or 4 bits per value (the
            integer ones with one fp32 scale per block of ``wire_block`` values), reduced in two
            stages (all-to-all, fp32 sum by the segment's owner, all-gather); each rank keeps its
            rounding in its residual (:mod:`scape_core.wire`); the mask takes ``32 / bits`` times
            the coordinates, so the bytes stay ``1 - sparsity``. ``"auto"`` (default): ``"int4"``
            at ``sparsity >= 0.97``, ``"int8"`` from 0.95, ``"native"`` below (where few enough
            coordinates are dropped that precision matters more than their count) and with
            ``shard_optimizer`` (its masks and updates travel per coordinate, so more coordinates cost
            more than the values save). Choose ``"native"`` for the fewest passes per step (no encode
            or decode, one collective) when the link is fast enough that bytes matter less.
        wire_block: values per scale of an integer wire (at most; blocks split a segment evenly).
        skip_streak_warning: warn (rank 0, once per streak) when this many consecutive optimizer
            steps were skipped for non-finite gradients: training has stopped moving. Counted on
            the device and read where SCAPE already reads it (``ScapeState.stats()``, which the
            adapters call every step or log), else from a copy started every 25 steps without
            waiting (so up to 50 steps late). ``0``: never warn.
        kernels: ``"eager"`` (default) runs the passes over every coordinate (the residual, the
            score, the decay and update, dense AdamS) as torch operators; ``"compiled"`` runs them
            as ``torch.compile``'d fused loops (:mod:`scape_core.kernels`): fewer passes over memory,
            for a compile in each process's first steps (minutes on a small CPU; inductor keeps the
            code on disk for the next run). Choose it for long runs on a GPU, where memory traffic is
            what a sparse step costs.
        replica_check_every: optimizer steps between checks that every rank holds the same replicated
            state (parameters, ``m``, the rule's statistics, windows, scheduled masks): one small all-gather
            of 64-bit fingerprints and one read of the device, at the first step, every this many and before
            every checkpoint is gathered; a mismatch raises on every rank, naming the first buffer and
            parameter that differ (:mod:`scape_core.replicas`). ``0``: never check.
        selection: how a row's ``k`` picks are chosen from the score. ``"topk"`` (default): the
            ``k`` largest scores of the row, ties taken lowest columns first (exact; on the CPU a
            radix select in C, compiled at the first use, :mod:`scape_core.rowselect`). ``"groups"``:
            the row cut into ``k`` contiguous groups of ``chunk_size // k`` or one more coordinates,
            and the largest score of each (ties: the lowest column): a reduction instead of a top-k,
            a little cheaper, but it misses a row's best coordinates when they share a group, and
            trains worse at high sparsity (``docs/benchmarks.md``). Keep ``"topk"``; ``"groups"`` is
            for comparison. Both are computed identically on every rank from replicated values, with
            a fixed number of picks per row (``docs/algorithm.md``).
        max_window: the longest a coordinate waits between two exchanges, in steps, under the
            default age score. A coordinate whose window would pass it is overdue: it is picked before
            every scored one, the longest-waiting first, whatever its momentum, so every coordinate
            is exchanged at least every ``max_window + ceil(chunk_size / k)`` steps (``k`` the row's
            picks). Without it a coordinate whose ``m`` is 0 (tokens first seen after the warm-up,
            added tokens, idle experts, every coordinate with ``warmup_steps=0``) scores 0 and never
            trains. ``0`` (default): ``8 * ceil(chunk_size / k)`` at each density, eight mean windows
            (112 steps at the 99% default, 1,064 at 99.9%), which leaves the score's own picks alone
            for coordinates that move. Lower it to bring rare coordinates in sooner (more of each step's
            picks go to them); a very large value (``2**24``) turns the bound off.

    Example:
        >>> ScapeConfig(sparsity=0.9, warmup_steps=20).density
        0.09999999999999998
        >>> ScapeConfig().resolved_score
        'age_momentum'
    """

    sparsity: float = 0.99
    warmup_steps: int = 50
    mask_delay: int = 1
    mask_refresh: int = 1
    error_feedback: bool = True
    score: str = "auto"
    update: str = "linear"
    ramp_steps: int = 150
    chunk_size: int = 4096
    shard_optimizer: bool = False
    wire: str = "auto"
    wire_block: int = 128
    skip_streak_warning: int = 5
    kernels: str = "eager"
    selection: str = "topk"
    replica_check_every: int = 100
    max_window: int = 0

    def __post_init__(self) -> None:
        normalized = {  # any real number type (numpy scalars included) is kept as a Python float / int
            "sparsity": _real_number("sparsity", self.sparsity, "a float in [0, 1)"),
            "warmup_steps": _check_int("warmup_steps", self.warmup_steps, minimum=0),
            "mask_delay": _check_int("mask_delay", self.mask_delay),
            "mask_refresh": _check_int("mask_refresh", self.mask_refresh, minimum=1),
            "ramp_steps": _check_int("ramp_steps", self.ramp_steps, minimum=0),
            "chunk_size": _check_int("chunk_size", self.chunk_size, minimum=16),
            "skip_streak_warning": _check_int("skip_streak_warning", self.skip_streak_warning, minimum=0),
            "replica_check_every": _check_int("replica_check_every", self.replica_check_every, minimum=0),
            "max_window": _check_int("max_window", self.max_window, minimum=0),
        }
        for name, value in normalized.items():
            object.__setattr__(self, name, value)  # the dataclass is frozen
        if not 0.0 <= self.sparsity < 1.0:
            raise ValueError(f"sparsity must be in [0, 1), got {self.sparsity!r}")
        if self.chunk_size > MAX_CHUNK:
            raise ValueError(f"chunk_size must be <= {MAX_CHUNK} (columns are int16), got {self.chunk_size!r}")
        if self.kernels not in KERNELS:
            raise ValueError(f"kernels must be one of {KERNELS}, got {self.kernels!r}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {tuple(SELECTIONS)}, got {self.selection!r}")
        if self.wire not in WIRES:
            raise ValueError(f"wire must be one of {WIRES}, got {self.wire!r}")
        object.__setattr__(self, "wire_block", _check_int("wire_block", self.wire_block, minimum=8))
        if not self.dense and self.resolved_wire != "native" and self._coordinates() >= 1.0:
            raise ValueError(f"sparsity={self.sparsity} on the {self.resolved_wire} wire would exchange every "
                             f"coordinate: use sparsity > {1 - self._bits() / 32:.3f} (or wire='native')")
        if self.mask_delay not in (0, 1):
            raise ValueError(f"mask_delay must be 0 or 1, got {self.mask_delay!r}")
        for name in ("error_feedback", "shard_optimizer"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.score not in SCORES:
            raise ValueError(f"score must be one of {SCORES}, got {self.score!r}")
        if self.update not in UPDATE_RULES:
            raise ValueError(
                f"update must be one of {sorted(UPDATE_RULES)}, got {self.update!r} "
                "(register new rules with scape_core.register_update_rule)"
            )
        if self.resolved_score not in SCORES[1:]:
            raise ValueError(f"update rule {self.update!r} declares default_score={self.resolved_score!r}; "
                             f"expected one of {SCORES[1:]}")

    def window_limit(self, chunk: int, k: int) -> int | None:
        """The longest window before a coordinate is overdue (:attr:`max_window`), at ``k`` picks per row
        of ``chunk``; ``None`` when the score reads no windows.

        Example:
            >>> ScapeConfig().window_limit(4096, 309)      # the 99% default's rows: 8 * ceil(4096 / 309)
            112
        """
        if self.resolved_score != "age_momentum":
            return None
        return self.max_window or WINDOW_LIMIT_MEAN_WINDOWS * math.ceil(chunk / max(k, 1))

    @property
    def keeps_windows(self) -> bool:
        """Whether SCAPE keeps each coordinate's last exchanged step (the rule or the score reads it)."""
        return UPDATE_RULES[self.update].uses_windows or self.resolved_score == "age_momentum"

    @property
    def replicated_score(self) -> bool:
        """Whether every rank computes the same score (then each selects the whole mask alone)."""
        return self.resolved_score in ("age_momentum", "momentum")

    @property
    def resolved_score(self) -> str:
        """The mask score in use (``"auto"`` resolved for the update rule)."""
        if self.score != "auto":
            return self.score
        return UPDATE_RULES[self.update].default_score

    @property
    def resolved_wire(self) -> str:
        """The wire in use (``"auto"`` resolved for the sparsity; native when the optimizer is sharded).

        Example:
            >>> [ScapeConfig(sparsity=s).resolved_wire for s in (0.99, 0.96, 0.9)]
            ['int4', 'int8', 'native']
            >>> ScapeConfig(sparsity=0.99, shard_optimizer=True).resolved_wire
            'native'
        """
        if self.wire != "auto":
            return self.wire
        if self.shard_optimizer:  # masks and updates are all-gathered per coordinate: more of them cost more
            return "native"
        return next((wire for least, wire in AUTO_WIRES if float(self.sparsity) >= least), "native")

    @property
    def schedule(self) -> MaskSchedule:
        """The mask schedule these settings describe (its sparsity: the coordinates'; every step dense at
        ``sparsity=0``, whatever the wire)."""
        sparsity = self.sparsity if self.dense or self.resolved_wire == "native" else 1.0 - self.density
        return MaskSchedule(sparsity, self.warmup_steps, self.ramp_steps, self.mask_delay, self.mask_refresh)

    @property
    def density(self) -> float:
        """Fraction of coordinates exchanged on a sparse step: ``1 - sparsity`` with native values,
        ``(1 - sparsity) * 32 / bits`` on an encoded wire (``bits`` per value, its scale's share included).

        Example:
            >>> round(ScapeConfig(sparsity=0.99, wire="int4").density, 4)  # 4 bits + 32 per 128 values
            0.0753
            >>> ScapeConfig(sparsity=0.0, wire="int4").density   # every step dense: the wire is unused
            1.0
        """
        if self.dense or self.resolved_wire == "native":
            return 1.0 - float(self.sparsity)
        return self._coordinates()

    def _bits(self) -> float:
        wire = self.resolved_wire
        return WIRE_BITS[wire] + (32 / self.wire_block if wire != "bfloat16" else 0.0)

    def _coordinates(self) -> float:
        return (1.0 - float(self.sparsity)) * 32 / self._bits()

    @property
    def target_step(self) -> int:
        """The first step at the target density (after the warm-up and the ramp's stages).

        Example:
            >>> ScapeConfig(sparsity=0.99, warmup_steps=10, ramp_steps=30, wire="native").target_step
            40
            >>> ScapeConfig(sparsity=0.99, warmup_steps=10, ramp_steps=30).target_step  # int4: 7.5%, one stage denser
            20
            >>> ScapeConfig(sparsity=0.5, warmup_steps=10, ramp_steps=30).target_step  # no stage denser than 50%
            10
        """
        stages = len(self.schedule.ramp_densities)
        return self.warmup_steps + (-(-stages * self.ramp_steps // 3) if self.ramp_steps else 0)

    def short_run_warning(self, total_steps: int) -> str | None:
        """What a run of ``total_steps`` optimizer steps misses of this schedule; ``None`` if nothing.

        For trainers that know the run's length (Lightning's ``max_steps``): a run that ends
        inside the warm-up or the ramp never trains at the density the user asked for.

        Example:
            >>> config = ScapeConfig(sparsity=0.99, warmup_steps=2, ramp_steps=1000)
            >>> "the run ends at density 0.25" in config.short_run_warning(8)
            True
        """
        if self.dense or total_steps >= self.target_step:
            return None
        if total_steps <= self.warmup_steps:
            what = (f"dense warm-up lasts warmup_steps={self.warmup_steps}: every step is dense, no "
                    "communication is saved")
        else:
            what = (f"warm-up and ramp (warmup_steps={self.warmup_steps}, ramp_steps={self.ramp_steps}) reach "
                    f"the target density {self.density:.4g} (sparsity={self.sparsity}) only at step "
                    f"{self.target_step}: the run ends at density {self.schedule.density_at(total_steps - 1):.4g}")
        return (f"SCAPE: this run has {total_steps} optimizer steps, but its {what}. Lower warmup_steps / "
                "ramp_steps (or train longer) to train at the sparsity you set.")

    def changed(self) -> list[str]:
        """The fields whose value differs from the default, in declaration order.

        Example:
            >>> ScapeConfig(sparsity=0.9, warmup_steps=50).changed()
            ['sparsity']
        """
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) != f.default]

    def bytes_share(self, coordinates: float | None = None) -> float:
        """The share of a dense fp32 exchange's bytes a sparse step at the target density sends when it
        exchanges the share ``coordinates`` of the coordinates (default: :attr:`density`, what the
        ``sparsity`` asks for; a layout's masks take more where a row's ``k`` rounds up,
        :meth:`scape_core.layout.MaskShape.entries`).

        Example:
            >>> ScapeConfig(sparsity=0.9999, wire="native").bytes_share(1 / 16)  # a row of 16 picks one at least
            0.0625
        """
        share = self.density if coordinates is None else coordinates
        return share if self.resolved_wire == "native" else share * self._bits() / 32

    def describe_run(self, total_steps: int | None = None, sources: Mapping[str, str] | None = None,
                     sent: float | None = None) -> str:
        """The one line every adapter prints at the start of a run: the settings that differ from the
        defaults (with where each came from, ``sources``, unless ``"argument"``), the step sparse steps
        begin at, the step the target density is reached at, and ``total_steps`` if known. ``sent``: the
        share of dense bytes a sparse step really sends (:meth:`bytes_share` of the layout's masks), said
        beside the target's where it is out of reach (:data:`OUT_OF_REACH` times it or more).

        Example:
            >>> print(ScapeConfig(warmup_steps=30, ramp_steps=90).describe_run(300))
            SCAPE: warmup_steps=30, ramp_steps=90 (the rest default); steps 0-29 dense (warm-up), \
sparse from step 30 at density 0.25, at the target density 0.0753 (int4 wire, 1% of dense bytes) from step 60; \
300 steps in this run
            >>> print(ScapeConfig(sparsity=0.0, warmup_steps=30, ramp_steps=90).describe_run())
            SCAPE: sparsity=0.0 (the rest default); every step dense (DDP + AdamS): nothing is saved (warmup_steps, \
ramp_steps do not apply)
            >>> config = ScapeConfig(sparsity=0.9, warmup_steps=0, ramp_steps=0)
            >>> print(config.describe_run(sources={"warmup_steps": "env X"}))
            SCAPE: sparsity=0.9, warmup_steps=0 (env X), ramp_steps=0 (the rest default); sparse from step 0, at the \
target density 0.1 (native wire, 10% of dense bytes) from step 0
        """
        sources = sources or {}
        changed = self.changed()
        unused = [n for n in changed if self.dense and n in SPARSE_ONLY]  # said apart: they do not apply
        shown = [f"{n}={getattr(self, n)!r}" + (f" ({sources[n]})" if sources.get(n, "argument") != "argument"
                                                else "") for n in changed if n not in unused]
        settings = (", ".join(shown) + " (the rest default)" if shown else
                    f"the default settings (sparsity={self.sparsity}, warmup_steps={self.warmup_steps}, "
                    f"ramp_steps={self.ramp_steps})")
        if self.dense:
            plan = "every step dense (DDP + AdamS): nothing is saved"
            if unused:
                plan += f" ({', '.join(unused)} {'does' if len(unused) == 1 else 'do'} not apply)"
        else:
            w, target = self.warmup_steps, self.target_step
            start = self.schedule.density_at(w)
            plan = (f"steps 0-{w - 1} dense (warm-up), " if w else "") + f"sparse from step {w}"
            if target > w:
                plan += f" at density {start:.3g}"
            share = f"{(1 - self.sparsity) * 100:.3g}% of dense bytes"
            if sent is not None and sent > OUT_OF_REACH * (1 - self.sparsity):
                share = (f"{sent * 100:.3g}% of dense bytes, not {(1 - self.sparsity) * 100:.3g}%: each row of "
                         f"chunk_size={self.chunk_size} and each parameter's last row picks at least one coordinate")
            plan += (f", at the target density {self.density:.3g} ({self.resolved_wire} wire, {share}) from step "
                     f"{target}")
        if self.shard_optimizer:
            plan += (" (shard_optimizer: each step also all-gathers the rows each rank owns, the updates on sparse "
                     "steps and the parameters on dense ones, in whole rows of chunk_size, counted in bytes_sent: "
                     "on a small model more than dense DDP's bytes, compression below 1)")
        length = f"; {total_steps} steps in this run" if total_steps is not None else ""
        return f"SCAPE: {settings}; {plan}{length}"

    def check_resume(self, saved: Mapping[str, Any], step: int, masks: Iterable[int]) -> None:
        """Refuse a saved SCAPE state whose mask schedule this config cannot continue; name the setting.

        ``saved`` is the checkpoint's config dict, ``step`` its step and ``masks`` the steps it
        holds masks for. Another ``sparsity`` is refused. Another ``warmup_steps`` or
        ``mask_delay`` is accepted when the checkpoint holds every mask this config needs
        before it selects its own (e.g. both warm-ups ended before the saved step), and
        refused, naming the setting, when it does not. ``ramp_steps``, ``mask_refresh``, ``score``,
        ``selection`` and ``max_window`` only shape masks not yet chosen: any value resumes.
        Another ``selection`` warns (rank 0): the run goes on, but not as the saved one would have.

        Example:
            >>> ScapeConfig(warmup_steps=3).check_resume(ScapeConfig(warmup_steps=10).to_dict(), step=6, masks=[])
            ... # doctest: +ELLIPSIS
            Traceback (most recent call last):
            ...
            ValueError: SCAPE state was saved at step 6 with warmup_steps=10, this run uses warmup_steps=3: here ...
        """
        if saved.get("sparsity") != self.sparsity:
            raise ValueError(f"SCAPE state was saved with sparsity={saved.get('sparsity')}, this run uses "
                             f"sparsity={self.sparsity}")
        was = _resolved_wire(saved)
        if was is not None and was != self.resolved_wire:
            raise ValueError(f"SCAPE state was saved on the {was} wire (wire={saved.get('wire')!r}, "
                             f"shard_optimizer={saved.get('shard_optimizer')}), this run would use the "
                             f"{self.resolved_wire} wire (wire={self.wire!r}, shard_optimizer={self.shard_optimizer}): "
                             "the wire sets how many coordinates each mask holds, so the saved masks and residuals "
                             f"belong to the {was} wire. Resume with wire={was!r} (wire='auto' picks native when the "
                             "optimizer is sharded, an encoded wire from sparsity 0.95 when it is not)")
        if saved.get("selection") not in (None, self.selection) and not (dist.is_initialized() and dist.get_rank()):
            warnings.warn(f"SCAPE state was saved with selection={saved['selection']!r}, this run uses "
                          f"selection={self.selection!r}: the masks from step {step} on are chosen by another rule, so "
                          "the run does not continue the saved one as it would have. Resume with "
                          f"selection={saved['selection']!r} to continue it (the default is 'topk')", stacklevel=4)
        held = {int(t) for t in masks}
        # masks chosen before the checkpoint: sparse steps whose selecting step (t - 1 - delay) came before it
        needed = [t for t in range(step, step + self.mask_delay + 1)
                  if not self.dense and t >= self.warmup_steps and t - 1 - self.mask_delay >= 0]
        missing = [t for t in needed if t not in held]
        if not missing:
            return
        changed = [n for n in ("warmup_steps", "mask_delay") if saved.get(n) != getattr(self, n)]
        if not changed:
            raise ValueError(f"SCAPE state of step {step} holds no mask for step(s) {missing}: it was saved "
                             "without its scheduled masks (save with ScapeState.state_dict or gather_state_dict)")
        was = ", ".join(f"{n}={saved.get(n)}" for n in changed)
        now = ", ".join(f"{n}={getattr(self, n)}" for n in changed)
        raise ValueError(f"SCAPE state was saved at step {step} with {was}, this run uses {now}: here step(s) "
                         f"{missing} are sparse and their masks were chosen before the checkpoint, which holds "
                         f"none for them. Resume with {was}.")

    @property
    def dense(self) -> bool:
        """True when every step is dense (``sparsity == 0``)."""
        return float(self.sparsity) == 0.0

    def replace(self, **changes: Any) -> "ScapeConfig":
        """A copy with ``changes`` applied (and validated); unknown names raise TypeError."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise TypeError(f"unknown ScapeConfig field(s): {sorted(unknown)}")
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields (for checkpoints and logs)."""
        return dataclasses.asdict(self)


# the fields only sparse steps read: a dense run's start-of-run line says they do not apply
SPARSE_ONLY = ("warmup_steps", "mask_delay", "mask_refresh", "error_feedback", "score", "update", "ramp_steps",
               "chunk_size", "wire", "wire_block", "selection", "max_window")
# a layout whose masks send this many times the bytes the sparsity asks for (every row picks one at least, a
# parameter's last row too) is out of reach: the start-of-run line says what is sent, and it warns
OUT_OF_REACH = 1.5
ENV_PREFIX = "SCAPE_"  # accelerate_scape reads SCAPE_<FIELD> variables (accelerate_scape.settings)


def unread_environment(config: ScapeConfig, environ: Mapping[str, str]) -> str | None:
    """What to say when ``SCAPE_<FIELD>`` variables are set to values this run does not use (``None``:
    none are). Only ``accelerate_scape`` reads them, below the arguments given there; ``ScapeState``,
    Lightning's and FSDP2's ways in take their settings as arguments.

    Example:
        >>> print(unread_environment(ScapeConfig(), {"SCAPE_SPARSITY": "0.5", "SCAPE_WARMUP_STEPS": "50"}))
        SCAPE: SCAPE_SPARSITY=0.5 is set, but this run uses sparsity=0.99: only accelerate_scape (ScapePlugin, \
accelerate-scape launch, ScapeTrainer) reads SCAPE_* variables, below the arguments given there. Pass the setting as \
an argument (ScapeState(..., sparsity=...), ScapeStrategy(sparsity=...), scape_fsdp(..., sparsity=...)), or unset it
    """
    unread = []
    for f in dataclasses.fields(ScapeConfig):
        raw = environ.get(ENV_PREFIX + f.name.upper(), "").strip()
        value = getattr(config, f.name)
        if raw and not _same_text(value, raw):
            unread.append((f"{ENV_PREFIX}{f.name.upper()}={raw}", f"{f.name}={value!r}", f.name))
    if not unread:
        return None
    given = ", ".join(v for v, _, _ in unread)
    used = ", ".join(u for _, u, _ in unread)
    example = unread[0][2]
    return (f"SCAPE: {given} {'is' if len(unread) == 1 else 'are'} set, but this run uses {used}: only "
            "accelerate_scape (ScapePlugin, accelerate-scape launch, ScapeTrainer) reads SCAPE_* variables, below the "
            f"arguments given there. Pass the setting as an argument (ScapeState(..., {example}=...), "
            f"ScapeStrategy({example}=...), scape_fsdp(..., {example}=...)), or unset it")


def _same_text(value: Any, raw: str) -> bool:
    """Whether the text of an environment variable means ``value`` (a field's)."""
    if isinstance(value, bool):
        return raw.lower() in (("1", "true", "yes", "on") if value else ("0", "false", "no", "off"))
    if isinstance(value, (int, float)):
        try:
            return float(raw) == float(value)
        except ValueError:
            return False
    return raw == str(value)


def _resolved_wire(saved: Mapping[str, Any]) -> str | None:
    """The wire a saved config dict resolved to (``None`` if it names a field this version lacks)."""
    known = {f.name for f in dataclasses.fields(ScapeConfig)}
    try:
        return ScapeConfig(**{k: v for k, v in saved.items() if k in known}).resolved_wire
    except (TypeError, ValueError):
        return None


def _what(value: Any) -> str:
    """How an error shows a refused value: a string is called one (YAML may read ``1e-1`` as text)."""
    return f"the string {value!r}" if isinstance(value, str) else f"{value!r} ({type(value).__name__})"


def _real_number(name: str, value: Any, expected: str = "a real number") -> float:
    """``value`` as a Python float if it is a real number of any type (numpy scalars included), not NaN.

    Example:
        >>> import numpy as np; _real_number("sparsity", np.float32(0.5))
        0.5
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {expected}, got {_what(value)}")
    if math.isnan(value):
        raise ValueError(f"{name} must be {expected}, got {value!r}")
    return float(value)


def _check_int(name: str, value: Any, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {_what(value)}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")
    return int(value)


def check_max_steps(max_steps: Any) -> int | None:
    """``max_steps`` (a run's optimizer steps, where an adapter is told them) as an int >= 1, or ``None``.

    Example:
        >>> check_max_steps(0)
        Traceback (most recent call last):
        ...
        ValueError: max_steps must be >= 1, got 0
    """
    return None if max_steps is None else _check_int("max_steps", max_steps, minimum=1)


def check_optimizer_args(lr: float, betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """Validate AdamS hyperparameters, naming the bad argument (NaN and inf refused, as torch refuses NaN).

    Any real number type is accepted (``np.float32(1e-3)``); tensors are not.

    Example:
        >>> check_optimizer_args(float("inf"), (0.9, 0.95), 1e-8, 0.0)
        Traceback (most recent call last):
        ...
        ValueError: lr must be a finite number >= 0, got inf
    """
    checks = [("lr", lr), ("eps", eps), ("weight_decay", weight_decay)]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"betas must be a pair (beta1, beta2), got {betas!r}")
    for name, value in checks:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{name} must be a finite number >= 0, got {_what(value)}")
        if not (math.isfinite(value) and value >= 0.0):
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    for i, b in enumerate(betas):
        if isinstance(b, bool) or not isinstance(b, numbers.Real) or not 0.0 <= b < 1.0:
            raise ValueError(f"betas[{i}] must be in [0, 1), got {b!r}")
