"""AdamS against a direct transcription of its formula, and its two code paths."""

import copy

import pytest
import torch

from scape_core import AdamS, ScapeConfig


def transcription(theta, grads, lr, b1, b2, eps, wd):
    """The contract's formula, coordinate by coordinate, in float64."""
    theta = [float(x) for x in theta]
    m = [0.0] * len(theta)
    for g in grads:
        for j, gj in enumerate(g):
            v = b2 * m[j] ** 2 + (1 - b2) * gj ** 2  # previous momentum
            m[j] = b1 * m[j] + (1 - b1) * gj
            theta[j] = (1 - lr * wd) * theta[j] - lr * m[j] / (v ** 0.5 + eps)
    return torch.tensor(theta), torch.tensor(m)


@pytest.mark.parametrize("foreach, kernels", [(False, "eager"), (True, "eager"), (True, "compiled")])
def test_adams_matches_formula(foreach, kernels):
    torch.manual_seed(0)
    theta0 = torch.randn(7, dtype=torch.float64)
    grads = [torch.randn(7, dtype=torch.float64) for _ in range(5)]
    p = torch.nn.Parameter(theta0.clone())
    opt = AdamS([p], lr=0.1, betas=(0.8, 0.9), eps=1e-3, weight_decay=0.5, foreach=foreach, kernels=kernels)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    want_theta, want_m = transcription(theta0, grads, 0.1, 0.8, 0.9, 1e-3, 0.5)
    torch.testing.assert_close(p.detach(), want_theta.double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(opt.state[p]["exp_avg"].double(), want_m, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kernels", ["eager", "compiled"])
def test_foreach_equals_reference_and_groups(kernels):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Linear(4, 3))
    twin = copy.deepcopy(model)
    def groups(m):
        return [{"params": m[0].parameters(), "weight_decay": 0.1}, {"params": m[1].parameters(), "lr": 0.05}]

    a = AdamS(groups(model), lr=0.01, foreach=True, kernels=kernels)
    b = AdamS(groups(twin), lr=0.01, foreach=False)
    for _ in range(4):
        x = torch.randn(8, 5)
        for mod, opt in ((model, a), (twin, b)):
            opt.zero_grad()
            mod(x).pow(2).mean().backward()
            opt.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_bf16_parameters_keep_fp32_state():
    p = torch.nn.Parameter(torch.randn(16).bfloat16())
    opt = AdamS([p], lr=1e-2)
    p.grad = torch.randn(16).bfloat16()
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.float32
    assert p.dtype == torch.bfloat16 and torch.isfinite(p).all()


def test_state_dict_round_trip():
    torch.manual_seed(2)
    p = torch.nn.Parameter(torch.randn(6))
    opt = AdamS([p], lr=0.1)
    p.grad = torch.randn(6)
    opt.step()
    saved, theta = copy.deepcopy(opt.state_dict()), p.detach().clone()
    q = torch.nn.Parameter(theta.clone())
    other = AdamS([q], lr=0.1)
    other.load_state_dict(saved)
    g = torch.randn(6)
    p.grad, q.grad = g.clone(), g.clone()
    opt.step()
    other.step()
    assert torch.equal(p, q)


@pytest.mark.parametrize("kwargs, word", [
    (dict(lr=-1.0), "lr"), (dict(betas=(1.0, 0.9)), "betas[0]"), (dict(betas=(0.9, -0.1)), "betas[1]"),
    (dict(eps=-1e-8), "eps"), (dict(weight_decay=-0.1), "weight_decay"), (dict(betas=(0.9,)), "betas"),
])
def test_bad_hyperparameters_name_the_argument(kwargs, word):
    with pytest.raises(ValueError, match=word.replace("[", r"\[").replace("]", r"\]")):
        AdamS([torch.nn.Parameter(torch.zeros(2))], **kwargs)


def test_sparse_gradient_rejected():
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = AdamS(emb.parameters())
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(TypeError, match="sparse gradients"):
        opt.step()


def test_a_compiler_that_fails_says_so_and_names_the_eager_kernels(monkeypatch):
    def no_compiler(fn, **kwargs):
        def call(*args, **kw):
            raise OSError("no C++ compiler found")
        return call

    monkeypatch.setattr(torch, "compile", no_compiler)
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    with pytest.raises(RuntimeError, match=r"kernels='compiled'.*AdamS.*OSError: no C\+\+ compiler.*kernels='eager'"):
        AdamS([p], kernels="compiled").step()
    with pytest.raises(ValueError, match="kernels"):
        AdamS([p], kernels="fused")


@pytest.mark.parametrize("kwargs, exc, word", [
    (dict(kernels="triton"), ValueError, "kernels"),
    (dict(sparsity=1.0), ValueError, "sparsity"), (dict(sparsity=-0.1), ValueError, "sparsity"),
    (dict(sparsity="0.9"), TypeError, "sparsity"), (dict(warmup_steps=-1), ValueError, "warmup_steps"),
    (dict(warmup_steps=1.5), TypeError, "warmup_steps"), (dict(mask_delay=2), ValueError, "mask_delay"),
    (dict(mask_refresh=0), ValueError, "mask_refresh"), (dict(score="grad"), ValueError, "score"),
    (dict(update="nope"), ValueError, "update"), (dict(error_feedback=1), TypeError, "error_feedback"),
])
def test_bad_config_names_the_field(kwargs, exc, word):
    with pytest.raises(exc, match=word):
        ScapeConfig(**kwargs)


def _many_groups() -> tuple[torch.nn.Module, list[dict]]:
    """Ten parameter groups of different shapes: layer-wise learning rates."""
    model = torch.nn.Sequential(*[torch.nn.Linear(3 + i, 4 + i) for i in range(10)])
    return model, [{"params": list(m.parameters()), "lr": 1e-3 * (i + 1)} for i, m in enumerate(model)]


def _steps(opt: AdamS, model: torch.nn.Module) -> None:
    for step in range(2):
        for p in model.parameters():
            p.grad = torch.full_like(p, 0.1 * (step + 1))
        opt.step()


def test_compiled_adams_keys_a_copy_per_group_shapes(monkeypatch):
    """One compiled copy per set of shapes (dynamo keeps 8 graphs per copy), not one for
    all groups; here without compiling (each copy is the eager pass), the compile itself in the slow twin."""
    import scape_core.kernels as kernels
    made = []
    monkeypatch.setattr(kernels, "compile_kernel", lambda fn, name: made.append(name) or fn)
    model, groups = _many_groups()
    ref_model = copy.deepcopy(model)
    _steps(AdamS(groups, kernels="compiled"), model)
    _steps(AdamS([{**g, "params": list(m.parameters())} for g, m in zip(groups, ref_model)]), ref_model)
    assert made == ["AdamS"] * 10
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q)


@pytest.mark.slow  # ten compiles (~1-2 min on a CPU)
def test_compiled_adams_with_ten_parameter_groups_of_different_shapes():
    model, groups = _many_groups()
    ref_model = copy.deepcopy(model)
    _steps(AdamS(groups, kernels="compiled"), model)
    _steps(AdamS([{**g, "params": list(m.parameters())} for g, m in zip(groups, ref_model)]), ref_model)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
