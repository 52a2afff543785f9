"""Data-parallel training in one process: W virtual ranks with SCAPE's exact arithmetic.

:class:`SimulatedScape` mirrors ``scape_core`` step for step on the core's own pieces (the flat
layout, the mask schedule, the selection and the update rules), with every rank's residual
stacked along a leading rank axis instead of spread over processes:

- the hook (``scape_core/hook.py``): ``a_r = g_r + e_r``; dense steps all-reduce ``g_r / W``;
  sparse steps all-reduce ``a_r[M] / W`` and keep ``e_r = a_r`` with the mask zeroed;
- the optimizer (``ScapeAdamS``): dense AdamS on dense steps; on sparse ones the rule on the
  mask's entries, decoupled weight decay everywhere;
- the schedule (``ScapeState``): warm-up, ramp, ``mask_delay`` with the scheduled mask
  excluded, ``mask_refresh``; a replicated score selects the whole mask, a score that reads the
  residual selects rank r's partition of rows from rank r's residual.

Bytes are counted as the core counts them, per rank and step: the values handed to the
all-reduce (an encoded wire: its encoded buffer, ``scape_core.wire``) plus each partitioned
selection's all-gather payload. ``tests/test_simulator.py`` checks parameters and bytes against
the real 2-process hook (which exchanges one buffer per step in the mask's order, whatever DDP's buckets).

Prototype switches the core does not have are marked as such: ``send="momentum"`` (DGC-style
momentum correction), the scores ``residual``, ``age``, ``gain``, ``pending``, ``wire="int2"``,
``scope="global"`` (one top-k over every coordinate) and ``vector_density`` (1-D parameters at
their own density).
:class:`SimulatedTopK` is the raw top-k + error feedback + AdamW baseline.

Example:
    >>> model = torch.nn.Linear(8, 2)
    >>> sim = SimulatedScape(model, world_size=4, config=ScapeConfig(sparsity=0.9, warmup_steps=2), lr=1e-2)
    >>> grads = {n: torch.randn(4, p.numel()) for n, p in model.named_parameters()}
    >>> sim.step(grads)  # one optimizer step of all 4 ranks
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from benchmarks.experiments import candidate_rules, candidate_wires  # noqa: F401  (register the candidate rules and wires)
from scape_core import fused
from scape_core import wire as wires
from scape_core.adams import adams_foreach
from scape_core.config import ScapeConfig
from scape_core.layout import FlatLayout, MaskShape, topk_count
from scape_core.masks import EXCLUDED, PADDING, SELECTIONS, Mask, age_momentum_score, momentum_residual_score, select
from scape_core.selection import MaskSelector, partition
from scape_core.update_rules import UPDATE_RULES

VALUE_BYTES = 4  # fp32 gradients
INDEX_BYTES = 4  # the top-k baseline sends int32 indices
PROTOTYPE_SCORES = ("residual", "age", "gain", "pending")


class Counters:
    """Per-rank communication, summed over steps (every virtual rank sends the same amount)."""

    def __init__(self) -> None:
        self.steps = 0
        self.values_sent = 0
        self.bytes_sent = 0
        self.mask_bytes = 0
        self.dense_bytes = 0

    def as_dict(self) -> dict[str, float]:
        d = dict(vars(self))
        d["compression"] = self.dense_bytes / self.bytes_sent if self.bytes_sent else 1.0
        d["bytes_per_step"] = self.bytes_sent / max(self.steps, 1)
        return d


class _VirtualRanks(MaskSelector):
    """The core's mask schedule and lookup (:class:`~scape_core.selection.MaskSelector`), choosing
    for W virtual ranks at once through :meth:`SimulatedScape._choose` (which adds the prototypes)."""

    def __init__(self, sim: "SimulatedScape") -> None:
        super().__init__(sim.layout, sim.config, world_size=sim.world_size)
        self.sim = sim

    def choose(self, target: int, density: float, scheduled: Mask | None, momentum: Tensor,
               residual: Tensor | None, windows: Tensor | None, beta1: float) -> Mask:
        return self.sim._choose(target, density, scheduled, residual)


class SimulatedScape:
    """SCAPE on ``world_size`` virtual ranks: the hook, ``ScapeAdamS`` and ``ScapeState`` in one.

    Args:
        model: the model whose parameters are trained (shared by all virtual ranks).
        world_size: number of virtual ranks W.
        config: the :class:`ScapeConfig` (``config.update`` names the rule, ``config.ramp_steps`` the ramp).
        lr, betas, eps, weight_decay: AdamS hyperparameters; ``lr`` can change per step.
        send: ``"gradient"`` (the core) or ``"momentum"`` (prototype: each rank keeps a local
            momentum ``u_r = beta1 u_r + (1 - beta1) g_r``, accumulates it in the residual,
            sends it, and clears the sent coordinates of ``u_r``, as DGC's momentum correction).
        score: overrides ``config.score``; prototypes: ``"residual"`` scores ``|e_r|`` alone;
            ``"age"`` scores ``n - 1`` alone (round robin by waiting time, ``|m|`` breaking ties);
            ``"gain"`` scores ``(n - 1) m^2 / d`` (needs ``update="linear_keep_d"``), the
            first-order loss decrease of applying the pending sum; ``"pending"`` scores
            ``sqrt((n - 1)^2 m^2 + (n - 1) sigma^2)`` (same rule), its expected size noise included.
        wire: overrides ``config.wire``; prototype: ``"int2"`` (values in {-1, 0, 1} times the block's max).
        scope: ``"row"`` (the core: ``k`` per row) or ``"global"`` (prototype: one top-k of the
            replicated score over every coordinate, as many entries as the per-row mask).
        vector_density: prototype: 1-D parameters (biases, norm gains) at this density (or the
            step's, if denser); the other rows at the step's.
    """

    def __init__(
        self,
        model: nn.Module,
        world_size: int,
        config: ScapeConfig,
        *,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        send: str = "gradient",
        score: str | None = None,
        wire: str | None = None,
        scope: str = "row",
        vector_density: float | None = None,
    ) -> None:
        if send not in ("gradient", "momentum"):
            raise ValueError(f"send must be 'gradient' or 'momentum', got {send!r}")
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.world_size = world_size
        self.config = config
        self.schedule = config.schedule
        self.hp = dict(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay)
        self.send = send
        self.score = score or config.resolved_score
        if scope not in ("row", "global"):
            raise ValueError(f"scope must be 'row' or 'global', got {scope!r}")
        self.wire = wire or config.resolved_wire  # prototype: "int2", which the core does not ship
        self.scope, self.vector_density = scope, vector_density
        self.rule = UPDATE_RULES[config.update]
        self.layout = FlatLayout(self.params, config.chunk_size)
        self.numel = sum(self.layout.numel.values())
        self.m = self.layout.zeros()
        self.stats = {k: self.layout.zeros() for k in self.rule.statistics}
        self.residual: Tensor | None = None  # (W, rows * chunk)
        self.local_momentum: Tensor | None = None  # send="momentum" only
        self.windows: Tensor | None = None  # (rows, chunk) fp32 as the core's: the step each was last exchanged
        self.selection = _VirtualRanks(self)
        self.t = 0
        self.counters = Counters()
        self.sync_counts = torch.zeros(self.layout.rows * self.layout.chunk, dtype=torch.int32)  # diagnostics
        self.real = self.layout.zeros(torch.bool)
        for name in self.params:
            self.layout.view(self.real, name).fill_(True)
        self.real = self.real.view(-1)
        vector = torch.zeros(self.layout.rows, dtype=torch.bool)  # rows of 1-D parameters (prototype)
        for name, p in self.params.items():
            if p.dim() == 1:
                first = self.layout.first_row[name]
                vector[first:first + self.layout.nrows[name]] = True
        self.vector_rows = vector

    def _flat(self, per_name: dict[str, Tensor], lead: tuple[int, ...] = ()) -> Tensor:
        out = torch.zeros(*lead, self.layout.rows * self.layout.chunk)
        for name, value in per_name.items():
            start = self.layout.first_row[name] * self.layout.chunk
            out[..., start:start + self.layout.numel[name]] = value.reshape(*lead, -1)
        return out

    # ----- schedule: the core's MaskSelector over the virtual ranks ---------------------------
    @property
    def masks(self) -> dict[int, Mask]:
        """The scheduled masks by the step that uses them."""
        return self.selection.masks

    def current_mask(self) -> Mask:
        return self.selection.mask_for(self.t)

    def _end_step(self) -> None:
        done, self.t = self.t, self.t + 1
        self.counters.steps += 1
        self.selection.after_step(done, self.m, self.residual, self.windows, self.hp["beta1"])

    def _choose(self, target: int, density: float, scheduled: Mask | None, residual: Tensor | None) -> Mask:
        """The mask of ``target``: every virtual rank's partition (a score that reads the residual),
        else the replicated score's, per row or through a prototype's own entries."""
        layout = self.layout
        shape = layout.mask_shape(density)
        if self.score in ("momentum_residual", "residual"):  # per rank: rank r scores its partition of rows
            parts = []
            for r in range(self.world_size):
                rows = partition(layout, r, self.world_size)
                e = None if residual is None else residual[r].view(layout.rows, -1)[rows]
                if self.score == "residual" and e is not None:
                    score = e.abs()
                else:
                    score = momentum_residual_score(self.m[rows], e, self.hp["beta1"])
                parts.append(SELECTIONS[self.config.selection](score, layout, shape, scheduled, rows))
            payload = layout.block(self.world_size) * shape.k * 2  # the largest partition, int16
            self.counters.mask_bytes += payload
            self.counters.bytes_sent += payload
            return Mask(shape.density, torch.cat(parts))
        score = self._replicated_score(target, shape)
        if self.scope == "row" and self.vector_density is None:
            return Mask(shape.density, SELECTIONS[self.config.selection](score, layout, shape, scheduled))
        # prototypes: entries chosen outside the per-row shape (the mask keeps only its flat entries)
        flat = score.view(-1)
        if scheduled is not None:
            flat.index_fill_(0, scheduled.flat(layout), EXCLUDED)
        if self.scope == "global":  # one top-k over every coordinate, as many entries as the per-row mask
            picked = flat.masked_fill(~self.real, PADDING).topk(shape.entries).indices
        else:
            picked = Mask(shape.density, select(score.clone(), layout, shape)).flat(layout)
        if self.vector_density is not None:  # 1-D parameters at their own density
            vshape = layout.mask_shape(max(self.vector_density, shape.density))
            vec = Mask(vshape.density, select(score.clone(), layout, vshape)).flat(layout)
            on_vector = lambda e: self.vector_rows[torch.div(e, layout.chunk, rounding_mode="floor")]  # noqa: E731
            picked = torch.cat([picked[~on_vector(picked)], vec[on_vector(vec)]])
        return Mask(shape.density, torch.empty(0, dtype=torch.int16), _flat=picked.sort().values)

    def _replicated_score(self, target: int, shape: MaskShape) -> Tensor:
        m = self.m
        if self.score == "age_momentum":
            return age_momentum_score(m, self.windows, target, self.config.window_limit(self.layout.chunk, shape.k))
        if self.score == "momentum" or self.windows is None:
            return m.abs()
        age = self.windows.float().neg_().add_(target - 1)  # n - 1 at the step the mask is for
        if self.score == "age":  # round robin by waiting time, |m| breaking ties
            return age + m.abs() / (m.abs().max() + 1e-30)
        d = self.stats["d"]
        last_d = torch.where(d > 0, d, m.abs())
        if self.score == "gain":  # first-order loss decrease of exchanging now
            return m * m * age / (last_d + 1e-30)
        if self.score == "pending":  # expected |pending sum|, noise included
            b1, b2 = self.hp["beta1"], self.hp["beta2"]
            noise = (last_d * last_d - m * m).clamp_(min=0) / (b2 * (1 - b1) / (1 + b1) + (1 - b2))
            return (age * age * m * m + age * noise).sqrt_()
        raise ValueError(f"unknown score {self.score!r}")

    # ----- one step: hook + optimizer -----------------------------------------------------
    @torch.no_grad()
    def step(self, grads: dict[str, Tensor], lr: float | None = None) -> None:
        """One optimizer step; ``grads[name]`` is every rank's local gradient, shape ``(W, numel)``."""
        if lr is not None:
            self.hp["lr"] = lr
        W = self.world_size
        g = self._flat({n: v.float() for n, v in grads.items()}, (W,))
        self.counters.dense_bytes += self.numel * VALUE_BYTES
        if self.schedule.is_dense(self.t):
            mean = (g / W).sum(0)  # each rank sends g_r / W: the all-reduce sums them
            self.counters.values_sent += self.numel
            self.counters.bytes_sent += self.numel * VALUE_BYTES
            names = list(self.params)
            adams_foreach([self.params[n].data for n in names],
                          [self.layout.view(mean.view(self.layout.rows, -1), n).view_as(self.params[n]) for n in names],
                          [self.layout.view(self.m, n).view_as(self.params[n]) for n in names], **self.hp)
            self._end_step()
            return
        if self.residual is None:  # the first sparse step
            self.residual = torch.zeros_like(g)
            if self.config.keeps_windows:
                self.windows = torch.full((self.layout.rows, self.layout.chunk), self.t - 1, dtype=torch.float32)
        if self.send == "momentum":
            u = self.local_momentum if self.local_momentum is not None else torch.zeros_like(g)
            self.local_momentum = g = u.lerp_(g, 1 - self.hp["beta1"]).clone()
        mask = self.current_mask()
        entries = mask.flat(self.layout)
        a = self.residual + g if self.config.error_feedback else g
        if self.wire == "native":
            s, kept = (a[:, entries] / W).sum(0), 0.0
            nbytes = entries.numel() * VALUE_BYTES
        else:
            s, kept, nbytes = self._exchange(a[:, entries])
        if self.config.error_feedback:
            a[:, entries] = kept
            self.residual = a
        if self.send == "momentum":
            self.local_momentum[:, entries] = 0.0
        self.sync_counts[entries] += 1
        self.counters.values_sent += entries.numel()
        self.counters.bytes_sent += nbytes
        self._apply(s, entries, self.layout.mask_shape(mask.density))
        self._end_step()

    def _exchange(self, sent: Tensor) -> tuple[Tensor, Tensor, int]:
        """The two-stage low-precision exchange of ``scape_core.wire`` on every rank's ``(W, E)`` values:
        the mean every rank applies, what each rank keeps in its residual, and the bytes one rank sends."""
        W, E = sent.shape
        plan = wires.WirePlan(self.wire, E, W, self.config.wire_block)
        x = wires.pad(plan, sent)  # (sender, owner, segment)
        data = wires.encode(plan, x)
        decoded = wires.decode(plan, data)
        kept = (x - decoded).flatten(-2)[:, :E]
        mean = decoded.sum(0).div_(W)  # (owner, segment): owner j sums the senders' copies of segment j in order
        applied = wires.decode(plan, wires.encode(plan, mean))
        owner = torch.arange(E) // plan.segment  # rank j keeps W times its segment's second rounding
        kept[owner, torch.arange(E)] += ((mean - applied) * W).flatten()[:E]
        return applied.flatten()[:E], kept, plan.nbytes

    def _apply(self, s: Tensor, entries: Tensor, shape: MaskShape) -> None:
        """``ScapeAdamS``'s sparse step: the rule on the entries, decay everywhere, the update on the mask (in the
        core's C loops where it runs them: the same bits)."""
        params = list(self.params.values())
        if self.windows is not None and hasattr(self.rule, "fused") and fused.runs_here(params, entries):
            hp, keep = self.hp, torch.tensor(True)
            u = self.rule.fused(self.m, self.stats, self.windows, entries, s, keep, self.t, beta1=hp["beta1"],
                                beta2=hp["beta2"], eps=hp["eps"])
            fused.update(params, fused.RowTable.of(self.layout, list(self.params)), shape, torch.zeros(len(params),
                         dtype=torch.int32), torch.tensor([-hp["lr"] * hp["weight_decay"]]),
                         torch.tensor([bool(hp["weight_decay"])]), torch.tensor([-hp["lr"]]), keep, entries, u)
            return
        if self.windows is not None:
            flat = self.windows.view(-1)
            n = (self.t - flat.index_select(0, entries)).float()
            flat.index_fill_(0, entries, self.t)
        else:
            n = torch.ones_like(s)
        m_flat = self.m.view(-1)
        stats = {k: b.view(-1).index_select(0, entries) for k, b in self.stats.items()}
        u, m, stats = self.rule.update(s, n, m_flat.index_select(0, entries), stats,
                                       beta1=self.hp["beta1"], beta2=self.hp["beta2"], eps=self.hp["eps"])
        m_flat.index_copy_(0, entries, m)
        for key, value in stats.items():
            self.stats[key].view(-1).index_copy_(0, entries, value)
        delta = torch.zeros(self.layout.rows * self.layout.chunk)  # u at the entries: the core's staging buffer
        delta.index_copy_(0, entries, u)
        decay = torch.add(torch.ones(()), torch.ones(()), alpha=-self.hp["lr"] * self.hp["weight_decay"])  # as the core
        for name, p in self.params.items():
            if self.hp["weight_decay"]:
                p.data.mul_(decay)
            p.data.add_(self.layout.view(delta.view(self.layout.rows, -1), name).view_as(p), alpha=-self.hp["lr"])

    def never_synced(self) -> float:
        """Fraction of real coordinates never exchanged after the warm-up (diagnostics)."""
        return float((self.sync_counts[self.real] == 0).float().mean())


class SimulatedTopK:
    """Raw top-k with error feedback under AdamW: the baseline the paper calls unstable.

    Each rank picks its own top-k of ``|g_r + e_r|`` per parameter (``k = ceil(density * numel)``);
    the union of all ranks' picks is all-reduced (every rank sends its values there and clears
    them from its residual), and AdamW steps on that gradient, zero off the union. Bytes per rank
    and step: its ``k`` int32 indices (all-gather) plus the union's fp32 values (all-reduce).
    The first ``warmup_steps`` steps are dense, as SCAPE's.
    """

    def __init__(self, model: nn.Module, world_size: int, density: float, warmup_steps: int, *,
                 lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0) -> None:
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.world_size, self.density, self.warmup_steps = world_size, density, warmup_steps
        self.opt = torch.optim.AdamW(self.params.values(), lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.residuals: dict[str, Tensor] = {}
        self.t = 0
        self.counters = Counters()
        self.union_fraction: list[float] = []

    @torch.no_grad()
    def step(self, grads: dict[str, Tensor], lr: float | None = None) -> None:
        if lr is not None:
            for group in self.opt.param_groups:
                group["lr"] = lr
        W = self.world_size
        union_total = 0
        self.last_synced = {}
        for name, g in grads.items():
            p = self.params[name]
            n = p.numel()
            self.counters.dense_bytes += n * VALUE_BYTES
            if self.t < self.warmup_steps:
                p.grad = (g.float() / W).sum(0).view_as(p)
                self.counters.values_sent += n
                self.counters.bytes_sent += n * VALUE_BYTES
                continue
            a = g.float() + self.residuals[name] if name in self.residuals else g.float().clone()
            k = topk_count(n, self.density)
            picks = a.abs().topk(k, dim=1).indices  # (W, k): each rank's own choice
            union = torch.zeros(n, dtype=torch.bool)
            union[picks.reshape(-1)] = True
            idx = union.nonzero().view(-1)
            full = torch.zeros(n)
            full[idx] = (a[:, idx] / W).sum(0)
            a[:, idx] = 0.0
            self.residuals[name] = a
            p.grad = full.view_as(p)
            self.last_synced[name] = full
            union_total += idx.numel()
            self.counters.values_sent += idx.numel()
            self.counters.bytes_sent += idx.numel() * VALUE_BYTES + k * INDEX_BYTES
            self.counters.mask_bytes += k * INDEX_BYTES
        if self.t >= self.warmup_steps:
            self.union_fraction.append(union_total / sum(p.numel() for p in self.params.values()))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.t += 1
        self.counters.steps += 1


def rank_gradients(model: nn.Module, loss_fn: Callable[[nn.Module, Tensor, Tensor], Tensor],
                   batches: list[tuple[Tensor, Tensor]]) -> tuple[dict[str, Tensor], float]:
    """Every rank's local gradient ``(W, numel)`` per parameter, and the mean loss."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out = {n: torch.empty(len(batches), p.numel()) for n, p in params.items()}
    total = 0.0
    for r, (x, y) in enumerate(batches):
        loss = loss_fn(model, x, y)
        gs = torch.autograd.grad(loss, list(params.values()))
        for (n, _), g in zip(params.items(), gs):
            out[n][r] = g.reshape(-1)
        total += loss.item()
    return out, total / len(batches)
