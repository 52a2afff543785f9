"""The masked update rules: the core's against the contract (tests/reference.py), and the benchmark candidates."""

import pytest
import torch

from benchmarks.experiments import candidate_rules  # noqa: F401  (registers the candidates)
from scape_core import ScapeConfig, register_update_rule
from scape_core.update_rules import UPDATE_RULES
from tests import reference

HP = dict(beta1=0.9, beta2=0.95, eps=1e-8)


def entries(seed: int, size: int = 64) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    n = torch.randint(1, 200, (size,), generator=g).float()
    return torch.randn(size, generator=g) * n.sqrt(), n, torch.randn(size, generator=g) * 0.1


@pytest.mark.parametrize("name", ["linear", "lazy"])
def test_core_rules_follow_the_contract_over_several_windows(name):
    rule = UPDATE_RULES[name]
    m = entries(0)[2]
    stats = {k: torch.zeros_like(m) for k in rule.statistics}  # before the first window: zeros
    want_m, want_sq = m.double(), None
    for window in range(5):
        s, n, _ = entries(window + 1)
        inputs = (s.clone(), n.clone(), m.clone(), {k: v.clone() for k, v in stats.items()})
        u, m_new, stats_new = rule.update(*inputs, **HP)
        assert torch.equal(inputs[0], s) and torch.equal(inputs[2], m)  # inputs untouched
        want_u, want_m, want_sq = reference.RULES[name](s.double(), n.double(), want_m, want_sq, **HP)
        torch.testing.assert_close(u.double(), want_u, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(m_new.double(), want_m, rtol=1e-5, atol=1e-7)
        if name == "linear":
            torch.testing.assert_close(stats_new["sq"].double(), want_sq, rtol=1e-5, atol=1e-7)
        m, stats = m_new, stats_new


def test_linear_moves_at_most_n_steps_and_more_than_lazy():
    s, n, m = entries(7)
    u, _, _ = UPDATE_RULES["linear"].update(s, n, m, {"sq": torch.zeros_like(s)}, **HP)
    lazy, _, _ = UPDATE_RULES["lazy"].update(s, n, m, {}, **HP)
    assert (u.abs() <= n + 1e-5).all()  # d >= |s / n|: a window moves at most n lr-sized steps
    assert torch.equal(u.sign(), s.sign())  # it descends the window's sum
    assert u.abs().sum() > 2 * lazy.abs().sum()  # lazy normalises the sum away


@pytest.mark.parametrize("name", ["lazy", "linear", "catchup", "catchup_sqrt", "linear_per_step", "linear_noise",
                                  "linear_keep_d"])
def test_rules_are_selectable(name):
    assert ScapeConfig(update=name).update == name
    assert UPDATE_RULES[name].name == name


def test_a_rule_missing_part_of_the_protocol_is_refused():
    class NoStatistics:
        name, uses_windows, default_score = "broken", False, "momentum"

        def update(self, s, n, m, stats, *, beta1, beta2, eps):
            return s, m, stats

    with pytest.raises(TypeError, match="statistics"):
        register_update_rule(NoStatistics())


def test_catchup_of_one_step_is_lazy():
    s, _, m = entries(3)
    one = torch.ones_like(s)
    a = UPDATE_RULES["lazy"].update(s, one, m, {}, **HP)
    b = UPDATE_RULES["catchup"].update(s, one, m, {}, **HP)
    torch.testing.assert_close(a[0], b[0])
    torch.testing.assert_close(a[1], b[1])


def test_catchup_replays_dense_adams_on_a_constant_gradient():
    n, g = 6, 0.4
    m0 = torch.tensor([0.05])
    total, m, _ = UPDATE_RULES["catchup"].update(torch.tensor([n * g]), torch.tensor([float(n)]), m0.clone(), {}, **HP)
    theta, want_m = torch.zeros(1, dtype=torch.float64), m0.double()
    for _ in range(n):
        theta, want_m = reference.adams(theta, want_m, torch.tensor([g], dtype=torch.float64), lr=1.0,
                                        weight_decay=0.0, **HP)
    torch.testing.assert_close(-total.double(), theta, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(m.double(), want_m, rtol=1e-5, atol=1e-7)
