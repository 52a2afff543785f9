"""Data-parallel training in one process: W virtual ranks with SCAPE's exact arithmetic.

:class:`SimulatedScape` mirrors ``scape_core`` step for step, with every rank's tensors stacked
along a leading rank axis instead of spread over processes:

- the hook (``scape_core/hook.py``): ``a_r = g_r + e_r``; dense steps all-reduce ``g_r / W``;
  sparse steps all-reduce ``a_r[M] / W`` and keep ``e_r = a_r`` with the mask zeroed;
- the optimizer (``ScapeAdamS``): dense AdamS (foreach path) on dense steps, the configured
  update rule from ``scape_core.update_rules`` on sparse ones;
- the schedule (``ScapeState.end_step``): warm-up, ``mask_delay`` with exclusion of the mask
  already scheduled, ``mask_refresh``, the residual-aware or momentum score, partitioned top-k
  with ``scape_core.masks`` (rank ``r`` scores partition ``r`` from its own residual).

Bytes are counted as the core counts them, per rank and step: the values handed to the
all-reduce plus each mask selection's all-gather payload. ``tests/test_simulator.py`` checks the
parameters against the real 2-process hook.

Prototype switches that the core does not have (yet) are marked as such: ``send="momentum"``
(DGC-style momentum correction), ``score="residual"`` and a ``density_at`` schedule (sparsity
ramp). :class:`SimulatedTopK` is the raw top-k + error feedback + AdamW baseline.

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

from scape_core.adams import MOMENTUM, adams_foreach
from scape_core.config import ScapeConfig
from scape_core.masks import INDEX_BYTES, MaskLayout, mask_score, scheduled_in, select_topk, topk_count
from scape_core.update_rules import UPDATE_RULES, LinearUpdate, register_update_rule


class LinearKeepD(LinearUpdate):
    """``linear`` that also keeps each coordinate's last ``d`` (prototype: the ``gain`` score reads it)."""

    def window_step(self, state, grad, mask, **hp):  # type: ignore[no-untyped-def]
        s, d, m = super().window_step(state, grad, mask, **hp)
        if "d" not in state:
            state["d"] = torch.zeros_like(state[MOMENTUM])
        state["d"].view(-1).index_copy_(0, mask, d)
        return s, d, m


register_update_rule(LinearKeepD("linear_keep_d"))


def _last_d(state: dict, part: slice, m: Tensor) -> Tensor:
    """The ``d`` of each coordinate's last sync (rule ``linear_keep_d``), ``|m|`` where there is none."""
    d = state["d"].view(-1)[part] if "d" in state else torch.zeros_like(m)
    return torch.where(d > 0, d, m.abs())

VALUE_BYTES = 4  # fp32 gradients


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


class SimulatedScape:
    """SCAPE on ``world_size`` virtual ranks: the hook, ``ScapeAdamS`` and ``ScapeState`` in one.

    Args:
        model: the model whose parameters are trained (shared by all virtual ranks).
        world_size: number of virtual ranks W.
        config: the :class:`ScapeConfig` (``config.update`` names the rule).
        lr, betas, eps, weight_decay: AdamS hyperparameters; ``lr`` can change per step.
        send: ``"gradient"`` (the core) or ``"momentum"`` (prototype: each rank keeps a local
            momentum ``u_r = beta1 u_r + (1 - beta1) g_r``, accumulates it in the residual,
            sends it, and clears the sent coordinates of ``u_r``, as DGC's momentum correction).
        score: overrides ``config.score``; prototypes: ``"residual"`` scores ``|e_r|`` alone,
            ``"age_momentum"`` scores ``|m| * (n - 1)``, ``n`` the window the coordinate will have at
            the step the mask is for: the expected size of its pending sum, from replicated values
            only (needs a rule that tracks windows: ``linear``, ``catchup``, ``predict``);
            ``"age"`` scores ``n - 1`` alone (round robin by waiting time, ``|m|`` breaking ties);
            ``"gain"`` scores ``(n - 1) m^2 / d`` (needs ``update="linear_keep_d"``), the
            first-order loss decrease of applying the pending sum; ``"pending"`` scores
            ``sqrt((n - 1)^2 m^2 + (n - 1) sigma^2)`` (same rule), its expected size noise included.
        density_at: prototype sparsity ramp: ``step -> density`` for the mask used at ``step``.
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
        density_at: Callable[[int], float] | None = None,
    ) -> None:
        if send not in ("gradient", "momentum"):
            raise ValueError(f"send must be 'gradient' or 'momentum', got {send!r}")
        self.params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        self.world_size = world_size
        self.config = config
        self.hp = dict(lr=lr, beta1=betas[0], beta2=betas[1], eps=eps, weight_decay=weight_decay)
        self.send = send
        self.score = score or config.resolved_score
        if density_at is None and getattr(config, "ramp_steps", 0):  # a core with the ramp
            density_at = config.density_at
        self.density_at = density_at
        self.rule = UPDATE_RULES[config.update]
        self.numels = {n: p.numel() for n, p in self.params.items()}
        self.numel = sum(self.numels.values())
        self._layouts: dict[float, MaskLayout] = {}
        self.opt_state: dict[str, dict] = {}  # name -> {"step", "exp_avg", rule extras}
        self.residuals: dict[str, Tensor] = {}  # name -> (W, numel)
        self.local_momentum: dict[str, Tensor] = {}  # send="momentum" only
        self.masks: dict[int, dict[str, Tensor]] = {}
        self.t = 0
        self.counters = Counters()
        self.sync_counts = {n: torch.zeros(k, dtype=torch.int32) for n, k in self.numels.items()}  # diagnostics

    # ----- schedule (ScapeState) ----------------------------------------------------------
    def layout(self, step: int) -> MaskLayout:
        density = self.config.density if self.density_at is None else float(self.density_at(step))
        if density not in self._layouts:
            self._layouts[density] = MaskLayout(self.numels, self.world_size, density)
        return self._layouts[density]

    def is_dense(self, step: int) -> bool:
        return self.config.dense or step < self.config.warmup_steps

    def current_mask(self) -> dict[str, Tensor]:
        if self.t not in self.masks:
            if self.t - 1 - self.config.mask_delay >= 0:
                raise RuntimeError(f"no mask scheduled for step {self.t}")
            self.masks[self.t] = self.layout(self.t).strided()
        return self.masks[self.t]

    def _end_step(self) -> None:
        done, self.t = self.t, self.t + 1
        self.counters.steps += 1
        if self.config.dense:
            return
        target = done + 1 + self.config.mask_delay
        if not self.is_dense(target):
            if (target - self.config.warmup_steps) % self.config.mask_refresh == 0:
                self._select(target)
            else:
                self.masks[target] = self.masks[target - 1]
        self.masks = {s: m for s, m in self.masks.items() if s >= self.t}

    def _select(self, target: int) -> None:
        """Every rank scores its partition from its own residual; the full mask is their union."""
        layout = self.layout(target)
        scheduled = self.masks.get(target - 1) if self.config.mask_delay else None
        b1 = self.hp["beta1"]
        parts: dict[str, list[Tensor]] = {n: [] for n in self.params}
        for r in range(self.world_size):
            for slot in layout.partition(r):
                if not slot.k:
                    continue
                part = slice(slot.start, slot.start + slot.size)
                state = self.opt_state.get(slot.name)
                m = torch.zeros(slot.size) if state is None else state[MOMENTUM].view(-1)[part].float()
                e = self.residuals.get(slot.name)
                windows = state is not None and "synced_at" in state
                synced = state["synced_at"].view(-1)[part] if windows else None
                age = target - synced.float() if windows else None  # n - 1 at the step the mask is for
                if self.score == "residual" and e is not None:
                    score = e[r, part].abs()
                elif self.score == "gain" and windows:  # first-order loss decrease of syncing now
                    score = m * m * age / (_last_d(state, part, m) + 1e-30)
                elif self.score == "pending" and windows:  # expected |pending sum|, noise included
                    d = _last_d(state, part, m)
                    c = self.hp["beta2"] * (1 - b1) / (1 + b1) + (1 - self.hp["beta2"])
                    noise = (d * d - m * m).clamp_(min=0) / c
                    score = (age * age * m * m + age * noise).sqrt_()
                elif self.score == "age" and windows:  # round robin by waiting time, |m| breaking ties
                    score = age + m.abs() / (m.abs().max() + 1e-30)
                else:  # the core's scores
                    score = mask_score(self.score, m, target=target, synced_at=synced,
                                       residual=None if e is None else e[r, part], beta1=b1)
                exclude = None if scheduled is None else scheduled_in(scheduled[slot.name], slot.start, slot.size)
                parts[slot.name].append(select_topk(score, slot.k, exclude) + slot.start)
        self.masks[target] = {n: torch.cat(p) if p else torch.empty(0, dtype=torch.long) for n, p in parts.items()}
        self.counters.mask_bytes += layout.payload_bytes
        self.counters.bytes_sent += layout.payload_bytes

    # ----- one step: hook + optimizer -----------------------------------------------------
    @torch.no_grad()
    def step(self, grads: dict[str, Tensor], lr: float | None = None) -> None:
        """One optimizer step; ``grads[name]`` is every rank's local gradient, shape ``(W, numel)``."""
        if lr is not None:
            self.hp["lr"] = lr
        W = self.world_size
        dense = self.is_dense(self.t)
        mask = None if dense else self.current_mask()
        synced = {}
        for name, g in grads.items():
            g = g.float()
            if self.send == "momentum" and not dense:
                u = self.local_momentum.setdefault(name, torch.zeros_like(g))
                g = u.lerp_(g, 1 - self.hp["beta1"]).clone()
            e = self.residuals.get(name)
            a = g if e is None else g + e
            self.counters.dense_bytes += self.numels[name] * VALUE_BYTES
            if dense:
                synced[name] = (a / W).sum(0)
                if e is not None:
                    e.zero_()
                self.counters.values_sent += self.numels[name]
                self.counters.bytes_sent += self.numels[name] * VALUE_BYTES
                continue
            idx = mask[name]
            self.sync_counts[name][idx] += 1
            values = (a[:, idx] / W).sum(0)
            if self.config.error_feedback:
                e = a.clone()
                e[:, idx] = 0.0
                self.residuals[name] = e
            if self.send == "momentum":
                self.local_momentum[name][:, idx] = 0.0
            full = torch.zeros(self.numels[name])
            full[idx] = values
            synced[name] = full
            self.counters.values_sent += idx.numel()
            self.counters.bytes_sent += idx.numel() * VALUE_BYTES
        self._apply(synced, mask)
        self._end_step()

    def _apply(self, synced: dict[str, Tensor], mask: dict[str, Tensor] | None) -> None:
        params, gs, momenta = [], [], []
        for name, g in synced.items():
            p = self.params[name]
            state = self.opt_state.setdefault(name, {"step": 0, MOMENTUM: torch.zeros_like(p, dtype=torch.float32)})
            state["step"] += 1
            params.append(p.data)
            gs.append(g.view_as(p))
            momenta.append(state[MOMENTUM])
        if mask is None:
            adams_foreach(params, gs, momenta, **self.hp)
            return
        for name, p, g in zip(synced, params, gs):
            self.rule.apply(p, self.opt_state[name], g, mask[name], **self.hp)


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
