r"""The masked update rule: how a sparse step moves ``m`` and ``theta`` on the mask.

On a sparse step every rank holds the same synchronized sum ``s`` on the mask (the mean over
ranks of ``grad + residual``: the whole window of gradient since the coordinate's last
exchange), the same window lengths ``n``, the same ``m`` and the same rule statistics. A rule
maps those, entry by entry, to the step ``u`` (``theta -= lr * u``) and the new ``m`` and
statistics. It sees only replicated values, so parameters stay bit-identical on every rank.
The optimizer gathers the entries, applies decoupled weight decay to every coordinate, writes
the results back and leaves everything as it was on a skipped step: a rule is pure arithmetic.

Shipped rules:

- ``linear`` (default): :math:`u = s / d`, the whole window sum over a replicated AdamS-like
  scale :math:`d = \max(\sqrt{m^2 + c\,\mathrm{noise}}, |s/n|) + \epsilon`, where ``m`` is an EMA
  (:math:`\beta_1`, once per window) of window means :math:`s/n`, ``sq`` an EMA (:math:`\beta_2`)
  of :math:`s^2/n` (the first window taken as is), :math:`\mathrm{noise} = \max(sq - n m^2, 0)`
  and :math:`c = \beta_2 (1 - \beta_1)/(1 + \beta_1) + (1 - \beta_2)`, the noise share AdamS's
  own denominator keeps. :math:`d \ge |s/n|` bounds a window's move by ``n`` lr-sized steps.
- ``lazy`` (the contract's first reading): one AdamS step on ``s``:
  :math:`v = \beta_2 m^2 + (1-\beta_2) s^2`, :math:`m \leftarrow \beta_1 m + (1-\beta_1) s`,
  :math:`u = m / (\sqrt v + \epsilon)`. It normalises away the size of a window's sum and loses
  20-31% validation loss in ``docs/benchmarks.md``; kept as the documented alternative.

Other rules (the candidates measured in ``docs/benchmarks.md``) live in ``benchmarks/`` and
register themselves with :func:`register_update_rule`.
"""

from __future__ import annotations

import ctypes
from typing import Any, Protocol

import torch
from torch import Tensor

from scape_core import native
from scape_core.kernels import Kernels


class UpdateRule(Protocol):
    """What the core needs from a masked update rule.

    Attributes:
        name: the name ``ScapeConfig(update=...)`` selects it by.
        statistics: names of the extra fp32 values the rule keeps per coordinate (checkpointed
            with the optimizer, e.g. ``("sq",)``); the optimizer allocates them.
        uses_windows: whether :meth:`update` reads the window lengths ``n`` (otherwise it gets ones).
        default_score: the mask score ``ScapeConfig(score="auto")`` resolves to for this rule.
    """

    name: str
    statistics: tuple[str, ...]
    uses_windows: bool
    default_score: str

    def update(self, s: Tensor, n: Tensor, m: Tensor, stats: dict[str, Tensor], *, beta1: float, beta2: float,
               eps: float) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """Entries of one sparse step (1-D fp32) -> ``(u, new m, new statistics)``; inputs stay untouched."""
        ...


UPDATE_RULES: dict[str, UpdateRule] = {}


def register_update_rule(rule: UpdateRule) -> UpdateRule:
    """Make ``rule`` selectable as ``ScapeConfig(update=rule.name)``; returns it.

    Example:
        >>> class SignSGD:
        ...     name, statistics, uses_windows, default_score = "sign", (), False, "momentum"
        ...     def update(self, s, n, m, stats, *, beta1, beta2, eps):
        ...         return s.sign(), m, stats
        >>> _ = register_update_rule(SignSGD())
    """
    for attr, kind in (("name", str), ("statistics", tuple), ("uses_windows", bool), ("default_score", str)):
        if not isinstance(getattr(rule, attr, None), kind):
            raise TypeError(f"an update rule needs `{attr}` ({kind.__name__}); see scape_core.update_rules.UpdateRule")
    if not callable(getattr(rule, "update", None)):
        raise TypeError("an update rule needs an `update(s, n, m, stats, *, beta1, beta2, eps)` method")
    UPDATE_RULES[rule.name] = rule
    return rule


class LazyUpdate:
    """The contract's rule: one AdamS step per exchange on the synchronized value."""

    name = "lazy"
    statistics: tuple[str, ...] = ()
    uses_windows = False
    default_score = "momentum_residual"

    def update(self, s: Tensor, n: Tensor, m: Tensor, stats: dict[str, Tensor], *, beta1: float, beta2: float,
               eps: float) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        v = torch.addcmul(m * m * beta2, s, s, value=1 - beta2)  # previous m, current value
        m = torch.lerp(m, s, 1 - beta1)
        return m / v.sqrt_().add_(eps), m, stats


class LinearUpdate:
    """The default rule: the whole window sum ``s`` over a replicated scale ``d`` (module docstring).

    Written in single fp32 operations (no ``lerp`` or ``addcmul``, which torch fuses into FMAs in some
    positions of a tensor and not others): :data:`LINEAR_SOURCE` computes the same ``m``, ``sq`` and windows in C,
    and ``u`` but for the last bit of a square root (torch's on the CPU is not always correctly rounded).
    """

    name = "linear"
    statistics: tuple[str, ...] = ("sq",)
    uses_windows = True
    default_score = "age_momentum"

    def update(self, s: Tensor, n: Tensor, m: Tensor, stats: dict[str, Tensor], *, beta1: float, beta2: float,
               eps: float) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        mean = s / n
        m = m + (mean - m) * (1 - beta1)
        q = s * mean  # s^2 / n
        sq = stats["sq"]
        sq = torch.where(sq > 0, sq + (q - sq) * (1 - beta2), q)  # the first window: taken as is
        noise = (sq - (n * m) * m).clamp_(min=0)
        d = torch.maximum((m * m + noise * noise_share(beta1, beta2)).sqrt_(), mean.abs_()).add_(eps)
        return s / d, m, {"sq": sq}

    def fused(self, momentum: Tensor, statistics: dict[str, Tensor], windows: Tensor, at: Tensor, s: Tensor,
              applied: Tensor, step: int, *, beta1: float, beta2: float, eps: float) -> Tensor | None:
        """The whole masked update (:func:`masked_update_pass` with this rule) as one C loop
        over the entries on the CPU (the same state, see the class docstring); ``None`` where it does not run
        (not the CPU, no C compiler, not contiguous fp32 buffers and int64 indices): the caller runs the torch
        operators."""
        sq = statistics["sq"]
        tensors = (momentum, sq, windows, at, s, applied)
        if (any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors) or at.dtype != torch.int64
                or any(t.dtype != torch.float32 for t in (momentum, sq, windows, s)) or applied.dtype != torch.bool
                or native.library() is None):
            return None
        return torch.ops.scape.linear_update(momentum.view(-1), sq.view(-1), windows.view(-1), at, s, applied,
                                             float(step), beta1, beta2, eps)


def noise_share(beta1: float, beta2: float) -> float:
    """``c``: the share of the window's noise the linear rule's scale keeps, as AdamS's own denominator does.

    Example:
        >>> round(noise_share(0.9, 0.95), 4), round(noise_share(0.9, 0.999), 4)
        (0.1, 0.0536)
    """
    return beta2 * (1 - beta1) / (1 + beta1) + (1 - beta2)


LINEAR_SOURCE = r"""
/* LinearUpdate at `count` entries `at` of the flat m, sq and windows (masked_update_pass's arithmetic, one fp32
   operation at a time, in its order): where applied (`applied[0]`, or `applied[i]` if `each`), m, sq and the
   window written back and u = s / d; elsewhere nothing written and u = 0. In blocks: gathered, computed in a loop
   the compiler vectorizes (divisions and roots are most of the work), scattered. */
#define LINEAR_BLOCK 512
void scape_linear_update(float *m, float *sq, float *w, const int64_t *at, const float *s, const uint8_t *applied,
                         int each, int64_t count, float step, float w1, float w2, float c, float eps, float *u) {
    float mo[LINEAR_BLOCK], so[LINEAR_BLOCK], nn[LINEAR_BLOCK], mn[LINEAR_BLOCK], sn[LINEAR_BLOCK];
    for (int64_t base = 0; base < count; base += LINEAR_BLOCK) {
        int64_t nb = count - base < LINEAR_BLOCK ? count - base : LINEAR_BLOCK;
        const int64_t *j = at + base;
        const float *sb = s + base;
        float *ub = u + base;
        for (int64_t i = 0; i < nb; i++) { mo[i] = m[j[i]]; so[i] = sq[j[i]]; nn[i] = step - w[j[i]]; }
        for (int64_t i = 0; i < nb; i++) {
            float n = nn[i], si = sb[i];
            float mean = si / n;
            float mi = mo[i] + (mean - mo[i]) * w1;
            float q = si * mean;
            float sqi = so[i] > 0 ? so[i] + (q - so[i]) * w2 : q;
            float noise = sqi - (n * mi) * mi;
            noise = noise < 0 ? 0.0f : noise;  /* clamp(min=0): NaN stays */
            float root = sqrtf(mi * mi + noise * c), am = fabsf(mean);
            float d = ((root != root) | (root > am)) ? root : am;  /* torch.maximum: NaN wins */
            mn[i] = mi; sn[i] = sqi; ub[i] = si / (d + eps);
        }
        for (int64_t i = 0; i < nb; i++) {
            if (applied[each ? base + i : 0]) { w[j[i]] = step; m[j[i]] = mn[i]; sq[j[i]] = sn[i]; }
            else ub[i] = 0.0f;
        }
    }
}
"""
_PTR, _F32 = ctypes.c_void_p, ctypes.c_float
native.register(LINEAR_SOURCE, {"scape_linear_update": (None, [_PTR, _PTR, _PTR, _PTR, _PTR, _PTR, ctypes.c_int,
                                                               ctypes.c_int64, _F32, _F32, _F32, _F32, _F32, _PTR])})


@torch.library.custom_op("scape::linear_update", mutates_args=("m", "sq", "windows"), device_types="cpu")
def _linear_update_op(m: Tensor, sq: Tensor, windows: Tensor, at: Tensor, s: Tensor, applied: Tensor, step: float,
                      beta1: float, beta2: float, eps: float) -> Tensor:
    u = torch.empty_like(s)
    address = [ctypes.c_void_p(t.data_ptr()) for t in (m, sq, windows, at, s, applied, u)]
    native.library().scape_linear_update(*address[:6], int(applied.dim() > 0), s.numel(), step, 1 - beta1,
                                         1 - beta2, noise_share(beta1, beta2), eps, address[6])
    return u


@_linear_update_op.register_fake
def _(m: Tensor, sq: Tensor, windows: Tensor, at: Tensor, s: Tensor, applied: Tensor, step: float, beta1: float,
      beta2: float, eps: float) -> Tensor:
    return torch.empty_like(s)


register_update_rule(LazyUpdate())
register_update_rule(LinearUpdate())


def masked_update_pass(rule: Any, momentum: Tensor, statistics: dict[str, Tensor], windows: Tensor | None,
                       local: Tensor, s: Tensor, applied: Tensor, step: Tensor, beta1: float, beta2: float,
                       eps: float) -> Tensor:
    """The update rule on the mask's entries (``local``: their flat indices in the state's buffers, which
    may be given flat): reads ``m``, the statistics and the windows there, writes them back where
    ``applied``, marks the entries exchanged at ``step``; returns ``u`` (0 where not applied). As
    ``ScapeAdamS``'s eager path."""
    local = local.long()  # index_copy_ takes int64 (a no-op for int64 entries)
    if windows is not None:
        windows = _flat(windows)
        last = windows.index_select(0, local)
        windows.index_copy_(0, local, torch.where(applied, step, last))
        n = step - last
    else:
        n = torch.ones_like(s)
    momentum = _flat(momentum)
    m = momentum.index_select(0, local)
    flats = {k: _flat(b) for k, b in statistics.items()}
    stats = {k: b.index_select(0, local) for k, b in flats.items()}
    u, m_new, stats_new = rule.update(s, n, m, stats, beta1=beta1, beta2=beta2, eps=eps)
    momentum.index_copy_(0, local, torch.where(applied, m_new, m))
    for key, value in stats_new.items():
        flats[key].index_copy_(0, local, torch.where(applied, value, stats[key]))
    return u.masked_fill(~applied, 0.0)


def _flat(buffer: Tensor) -> Tensor:
    """``buffer`` as 1-D (itself if it is: an eager caller passes the views it keeps)."""
    return buffer if buffer.dim() == 1 else buffer.view(-1)


def masked_update(kernels: Kernels, rule: UpdateRule, momentum: Tensor, statistics: dict[str, Tensor],
                  windows: Tensor | None, local: Tensor, s: Tensor, applied: Tensor, step: int, **hp: float) -> Tensor:
    """The rule at the entries (``step``: the one being applied): its fused form where it has one that runs
    here in eager mode (the linear rule's C loop on the CPU, :meth:`LinearUpdate.fused`), else
    :func:`masked_update_pass` (eager or compiled)."""
    fused = getattr(rule, "fused", None)
    if not kernels.compiled and fused is not None and windows is not None:
        u = fused(momentum, statistics, windows, local, s, applied, step, **hp)
        if u is not None:
            return u
    at = kernels.scalar("step", step, local.device, torch.float32)  # windows are fp32
    run = kernels.get("masked_update", masked_update_pass, (local.numel(), applied.dim()))
    return run(rule, momentum, statistics, windows, local, s, applied, at, hp["beta1"], hp["beta2"], hp["eps"])
