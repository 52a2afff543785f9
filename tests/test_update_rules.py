"""The masked update rules searched by the convergence benchmark (scape_core/update_rules.py)."""

import pytest
import torch

from scape_core import ScapeConfig
from scape_core.adams import MOMENTUM, adams_reference
from scape_core.update_rules import UPDATE_RULES, window

HP = dict(lr=1e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0)


def fresh(step: int, numel: int = 6, seed: int = 0) -> tuple[torch.Tensor, dict]:
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(numel, generator=g)
    return p, {"step": step, MOMENTUM: torch.randn(numel, generator=g) * 0.1}


@pytest.mark.parametrize("name", ["lazy", "dense", "catchup", "catchup_sqrt", "linear", "linear_per_step",
                                  "linear_noise", "predict"])
def test_rules_are_selectable(name):
    assert ScapeConfig(update=name).update == name
    assert UPDATE_RULES[name].name == name


def test_window_counts_steps_since_last_sync():
    _, state = fresh(step=10)  # first sparse step: the warm-up synced everything at step 9
    assert window(state, torch.tensor([0, 1])).tolist() == [1.0, 1.0]
    state["step"] = 14
    assert window(state, torch.tensor([1, 2])).tolist() == [4.0, 5.0]
    assert state["synced_at"].tolist() == [10, 14, 14, 9, 9, 9]


def test_catchup_of_one_step_is_lazy():
    mask = torch.tensor([1, 3, 4])
    grad = torch.zeros(6)
    grad[mask] = torch.tensor([0.3, -0.2, 0.05])
    p1, s1 = fresh(step=5)
    p2, s2 = fresh(step=5)
    UPDATE_RULES["lazy"].apply(p1, s1, grad, mask, **HP)
    UPDATE_RULES["catchup"].apply(p2, s2, grad, mask, **HP)
    torch.testing.assert_close(p1, p2)
    torch.testing.assert_close(s1[MOMENTUM], s2[MOMENTUM])


def test_catchup_replays_dense_adams_on_a_constant_gradient():
    # coordinate 0 waits 6 steps (its residual sums 6 equal gradients), then is selected
    n, g = 6, 0.4
    p, state = fresh(step=1, numel=2)
    ref_p, ref_m = p[:1].clone(), state[MOMENTUM][:1].clone()
    window(state, torch.tensor([0, 1]))  # synchronized at step 1
    state["step"] = 1 + n
    grad = torch.tensor([n * g, 0.0])
    UPDATE_RULES["catchup"].apply(p, state, grad, torch.tensor([0]), **HP)
    for _ in range(n):
        adams_reference([ref_p], [torch.tensor([g])], [ref_m], lr=HP["lr"], beta1=0.9, beta2=0.95, eps=1e-8,
                        weight_decay=0.0)
    torch.testing.assert_close(p[:1], ref_p)
    torch.testing.assert_close(state[MOMENTUM][:1], ref_m)


@pytest.mark.parametrize("name", ["linear", "linear_per_step", "linear_noise"])
def test_linear_applies_the_whole_sum_and_is_bounded_by_the_window(name):
    p, state = fresh(step=1, numel=4)
    before = p.clone()
    window(state, torch.arange(4))
    state["step"] = 11  # a 10-step window
    grad = torch.tensor([1.0, -2.0, 0.0, 3.0])
    mask = torch.tensor([0, 1, 3])
    UPDATE_RULES[name].apply(p, state, grad, mask, **HP)
    moved = (p - before).abs()
    assert moved[2] == 0  # not selected: unchanged (no weight decay here)
    assert (moved[mask] <= 10 * HP["lr"] + 1e-6).all()  # at most n lr-sized steps
    assert (moved[mask] > HP["lr"]).all()  # and more than the lazy rule's one step
    assert torch.equal(torch.sign(p - before)[mask], -torch.sign(grad[mask]))  # descends the sum
