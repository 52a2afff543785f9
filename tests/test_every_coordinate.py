"""Every coordinate trains: the age score's window limit brings in coordinates whose momentum is 0.

The default score ``|m| (n - 1)`` is 0 wherever ``m`` is, and ``m`` changes only where a coordinate
is exchanged; so without a limit a coordinate with no momentum at the first sparse step (a token
first seen after the warm-up, an added token, an idle expert, every coordinate with
``warmup_steps=0``) is never picked while its row has ``k`` others. ``ScapeConfig.max_window``
bounds every window: these tests pin the bound, its replicated arithmetic, the first move of a
coordinate that waited long, and what a real run trains.
"""

import math

import pytest
import torch

from benchmarks import coverage
from scape_core.config import ScapeConfig
from scape_core.layout import FlatLayout
from scape_core.selection import MaskSelector
from scape_core.update_rules import LinearUpdate
from tests import reference


def _waits(config: ScapeConfig, numels: list[int], chunk: int, steps: int, seed: int = 0) -> tuple[int, int]:
    """Run the selector alone for ``steps`` sparse steps over a layout where half the coordinates keep a
    momentum of 0 forever (exchanged or not) and the others get a large one when exchanged: the
    longest window any coordinate had when it was exchanged, and the bound for it."""
    layout = FlatLayout({f"p{i}": torch.zeros(n) for i, n in enumerate(numels)}, chunk)
    selector = MaskSelector(layout, config)
    g = torch.Generator().manual_seed(seed)
    m = torch.zeros(layout.rows, chunk)
    hot = torch.rand(layout.rows, chunk, generator=g) < 0.5  # these win the score whenever they can
    windows = torch.full((layout.rows, chunk), -1.0)  # as ScapeState makes them at step 0
    real = torch.cat([layout.view(torch.ones(layout.rows, chunk, dtype=torch.bool), f"p{i}")
                      for i in range(len(numels))])
    longest = 0
    for step in range(steps):
        entries = selector.mask_for(step).flat(layout)
        waited = step - windows.view(-1)[entries]
        longest = max(longest, int(waited.max()))
        windows.view(-1)[entries] = float(step)
        fresh = torch.rand(entries.numel(), generator=g) + 1.0
        m.view(-1)[entries] = torch.where(hot.view(-1)[entries], fresh, 0.0)
        selector.after_step(step, m, None, windows, beta1=0.9)
    waits = (steps - 1) - torch.cat([layout.view(windows, f"p{i}") for i in range(len(numels))])
    assert real.all()
    longest = max(longest, int(waits.max()))  # a coordinate still waiting counts too
    shape = layout.mask_shape(config.schedule.density_at(steps - 1))
    bound = config.window_limit(chunk, shape.k) + math.ceil(chunk / shape.k)
    return longest, bound


@pytest.mark.parametrize("selection", ["topk", "groups"])
@pytest.mark.parametrize("mask_delay", [0, 1])
def test_every_coordinate_is_exchanged_within_the_bound(selection, mask_delay):
    """``max_window + ceil(chunk / k)`` steps at most between two exchanges, whatever ``m``: half of
    the coordinates never get a momentum, and a full row, a shorter one and a tiny one are there."""
    config = ScapeConfig(sparsity=0.9, wire="native", warmup_steps=0, ramp_steps=0, selection=selection,
                         mask_delay=mask_delay, max_window=12, chunk_size=64)
    longest, bound = _waits(config, [64 * 3 + 20, 7, 64], 64, steps=120)
    assert bound == 12 + math.ceil(64 / 7)
    assert 12 < longest <= bound  # the limit was reached, and held


def test_the_default_limit_is_eight_mean_windows_and_holds():
    config = ScapeConfig(sparsity=0.9, wire="native", warmup_steps=0, ramp_steps=0, chunk_size=64)
    assert config.window_limit(64, 7) == 8 * math.ceil(64 / 7) == reference.max_window(64, 0.1)
    longest, bound = _waits(config, [64 * 2, 30], 64, steps=200)
    assert 72 < longest <= bound


def test_without_the_limit_coordinates_with_no_momentum_wait_forever():
    """What the limit prevents: the score alone never picks a coordinate whose ``m`` stays 0."""
    config = ScapeConfig(sparsity=0.9, wire="native", warmup_steps=0, ramp_steps=0, chunk_size=64,
                         max_window=2 ** 24)
    longest, _ = _waits(config, [64 * 2], 64, steps=200)
    assert longest == 200  # never exchanged: waiting since before step 0


def test_the_linear_rules_first_move_after_a_long_wait_is_bounded_and_no_larger_than_dense_adams():
    """A coordinate that waited ``n`` steps with ``m = 0`` and no statistics (never exchanged) moves
    ``lr * min(n, sqrt(n / (c (1 - (1 - beta1)^2))))`` at most, whatever its window sum holds (3.2
    ``sqrt(n)`` at the default betas); for gradients of one sign, dense AdamS moves as far over the
    window and as many steps after it (it keeps moving about 0.9 lr a step while ``m`` decays)."""
    beta1, beta2, eps = 0.9, 0.95, 1e-8
    c = beta2 * (1 - beta1) / (1 + beta1) + (1 - beta2)
    g = torch.Generator().manual_seed(0)
    for n in (1, 3, 10, 100, 126, 1000):
        bound = min(n, math.sqrt(n / (c * (1 - (1 - beta1) ** 2))))
        patterns = {"steady": torch.ones(n), "first": torch.eye(n)[0], "last": torch.eye(n)[-1],
                    "noisy": 0.3 + torch.randn(n, generator=g)}
        for scale in (1e-6, 1.0, 1e6):
            for name, grads in patterns.items():
                grads = grads.double() * scale
                s, windows = grads.sum().float().view(1), torch.tensor([float(n)])
                u, _, _ = LinearUpdate().update(s, windows, torch.zeros(1), {"sq": torch.zeros(1)}, beta1=beta1,
                                                beta2=beta2, eps=eps)
                assert abs(float(u)) <= bound * (1 + 1e-5), (n, name, scale)
                if name == "noisy" or scale < 1:  # signs that cancel, or gradients near eps: dense moves
                    continue                      # less, and the bound is what holds
                after = torch.cat([grads, torch.zeros(n, dtype=torch.float64)])  # the window, then as long again
                dense = _dense_adams_move(after, beta1, beta2, eps)
                assert abs(float(u)) <= abs(dense) * (1 + 1e-5) + 1.0, (n, name, scale, float(u), dense)


def _dense_adams_move(grads: torch.Tensor, beta1: float, beta2: float, eps: float) -> float:
    """How far dense AdamS moves one coordinate (in lr) over ``grads``, from ``m = 0``."""
    m, total = torch.zeros((), dtype=torch.float64), 0.0
    for grad in grads:
        v = beta2 * m * m + (1 - beta2) * grad * grad
        m = beta1 * m + (1 - beta1) * grad
        total += float(m / (v.sqrt() + eps))
    return total


def test_late_tokens_train_and_no_warmup_moves_every_coordinate():
    """Through the real hook on 2 ranks, with the library's defaults but a short warm-up and ramp:
    tokens first seen after the warm-up train, and with ``warmup_steps=0`` every coordinate with a
    gradient moves; the replica guard checks every 10 steps (replicas stay bit-identical)."""
    late = coverage.measure("late-tokens", dict(warmup_steps=10, ramp_steps=30, replica_check_every=10),
                            steps=260, shift=60)
    assert late["early_rows_moved"] == late["late_rows_moved"] == late["rows_each"] == 64
    assert late["longest_wait"] <= 112 + math.ceil(4096 / 309)  # the bound at the target density
    cold = coverage.measure("no-warmup", dict(replica_check_every=10), sparse_steps=200)
    assert cold["moved_with_gradient"] >= 0.95 * cold["with_gradient"]  # 50% without the limit


def test_a_checkpoint_from_before_the_limit_resumes():
    """A saved config without ``max_window`` (older checkpoints) passes the resume check."""
    old = {k: v for k, v in ScapeConfig().to_dict().items() if k != "max_window"}
    ScapeConfig().check_resume(old, step=0, masks=[])
    ScapeConfig(max_window=30).check_resume(ScapeConfig().to_dict(), step=0, masks=[])  # any value resumes
