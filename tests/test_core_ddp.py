"""scape_core on real DDP: 2 gloo processes on CPU."""

import copy
import math
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from scape_core import AdamS, ScapeAdamS, ScapeState, gather_state_dict, scape_hook
from tests.dist import run_distributed
from tests.models import batch, loss_fn, make_model


def scape_setup(model, sparsity, warmup=3, ddp_kwargs=None, ramp_steps=0, **cfg):
    """DDP + SCAPE at ``sparsity`` from the first step after ``warmup`` (no ramp unless asked for)."""
    ddp = DDP(model, **(ddp_kwargs or {}))
    state = ScapeState(ddp, sparsity=sparsity, warmup_steps=warmup, ramp_steps=ramp_steps, **cfg)
    ddp.register_comm_hook(state, scape_hook)
    opt = ScapeAdamS(ddp.parameters(), state, lr=1e-2, weight_decay=0.1)
    return ddp, state, opt


def train(ddp, opt, rank, steps, start=0):
    for step in range(start, start + steps):
        loss_fn(ddp, *batch(step, rank)).backward()
        opt.step()
        opt.zero_grad()


def snapshot(model, opt):
    return ([p.detach().clone() for p in model.parameters()],
            [opt.state[p]["exp_avg"].clone() for p in model.parameters()])


# ----------------------------------------------------------------------------------------
def _dense_vs_ddp(rank, world):
    ref = make_model()
    ref_ddp = DDP(ref)
    ref_opt = AdamS(ref_ddp.parameters(), lr=1e-2, weight_decay=0.1)
    model = make_model()
    ddp, state, opt = scape_setup(model, sparsity=0.0)
    train(ref_ddp, ref_opt, rank, 20)
    train(ddp, opt, rank, 20)
    return max((p - q).abs().max().item() for p, q in zip(ref.parameters(), model.parameters())), state.stats()


def test_sparsity_zero_is_dense_ddp_plus_adams():
    (diff, stats), _ = run_distributed(_dense_vs_ddp)
    assert diff <= 1e-6
    assert stats["hook_calls"] >= 20 and stats["compression"] == 1.0


# ----------------------------------------------------------------------------------------
VARIANTS = {
    "default": {},
    "buckets": {"bucket_cap_mb": 0.01},
    "bucket_view": {"gradient_as_bucket_view": True, "bucket_cap_mb": 0.01},
    "static_graph": {"static_graph": True},
}


def _variants(rank, world, sparsity, wire):
    out = {}
    for name, kw in VARIANTS.items():
        model = make_model()
        ddp, state, opt = scape_setup(model, sparsity, warmup=5, ddp_kwargs=kw, wire=wire)
        train(ddp, opt, rank, 5)
        before = state.stats()
        train(ddp, opt, rank, 45, start=5)
        after = state.stats()
        sparse = {k: after[k] - before[k] for k in ("bytes_sent", "dense_bytes", "hook_calls", "steps")}
        # one plan per live bucket: none left from before DDP's bucket rebuild (it would hold the old buffer)
        assert sorted(n for plan in state.buckets.plans.values() for n in plan.names) == sorted(state.params), name
        out[name] = snapshot(model, opt) + (sparse,)
    return out


@pytest.mark.parametrize("sparsity, wire, bound", [(0.9, "native", 0.1 + 0.04), (0.99, "native", 0.01 + 0.01),
                                                  (0.99, "auto", 0.01 + 0.005)])  # auto: int4 at 99%
def test_replicas_identical_and_bytes_bounded(sparsity, wire, bound):
    r0, r1 = run_distributed(_variants, sparsity, wire)
    for name in VARIANTS:
        (p0, m0, sent), (p1, m1, _) = r0[name], r1[name]
        assert all(torch.equal(a, b) for a, b in zip(p0, p1)), f"{name}: parameters differ across ranks"
        assert all(torch.equal(a, b) for a, b in zip(m0, m1)), f"{name}: momenta differ across ranks"
        ratio = sent["bytes_sent"] / sent["dense_bytes"]
        assert 0.99 * (1 - sparsity) <= ratio <= bound, (name, ratio)
        # every DDP layout trains to the same parameters: state is keyed by name, not bucket (an encoded
        # wire cuts its scale blocks and owners' segments per bucket, so its rounding depends on the buckets)
        if wire == "native":
            assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(p0, r0["default"][0])), name
    assert r0["buckets"][2]["hook_calls"] > r0["buckets"][2]["steps"]  # really several buckets


# ----------------------------------------------------------------------------------------
def conservation_error(state, sum_applied, sum_mean_grad) -> float:
    """Largest |applied + mean residual - sum of mean gradients| over every parameter (collective)."""
    err = 0.0
    for name, a, want in zip(state.params, sum_applied, sum_mean_grad):
        e = state.residual(name).view_as(a).clone()
        dist.all_reduce(e)
        err = max(err, (a + e / state.comm.world_size - want).abs().max().item())
    return err


def _conservation(rank, world):
    model = make_model()
    ddp, state, opt = scape_setup(model, 0.9, warmup=2)
    params = list(model.parameters())
    sum_mean_grad = [torch.zeros_like(p) for p in params]
    sum_applied = [torch.zeros_like(p) for p in params]
    for step in range(15):
        x, y = batch(step, rank)
        local = torch.autograd.grad(loss_fn(model, x, y), params)
        for s, g in zip(sum_mean_grad, local):
            g = g.clone()
            dist.all_reduce(g)
            s.add_(g / world)
        loss_fn(ddp, x, y).backward()
        for s, p in zip(sum_applied, params):
            s.add_(p.grad)
        opt.step()
        opt.zero_grad()
    err = conservation_error(state, sum_applied, sum_mean_grad)
    return err, sum(float(r.abs().sum()) for r in state.residuals.values())


def test_error_feedback_conserves_gradient_mass():
    (err, residual_mass), _ = run_distributed(_conservation)
    assert residual_mass > 0  # something really was held back
    assert err < 1e-5


# ----------------------------------------------------------------------------------------
def _resume(rank, world, wire="native"):
    model = make_model()
    ddp, state, opt = scape_setup(model, 0.9, wire=wire)
    train(ddp, opt, rank, 20)
    straight = snapshot(model, opt)

    model = make_model()
    ddp, state, opt = scape_setup(model, 0.9, wire=wire)
    train(ddp, opt, rank, 10)
    ckpt = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "scape": gather_state_dict(state)})
    model = make_model(seed=123)  # a fresh run, then everything restored
    model.load_state_dict(ckpt["model"])
    ddp, state, opt = scape_setup(model, 0.9, wire=wire)
    opt.load_state_dict(ckpt["opt"])
    state.load_state_dict(ckpt["scape"])
    train(ddp, opt, rank, 10, start=10)
    resumed = snapshot(model, opt)
    return straight, resumed, ckpt["scape"]


def _resume_one_rank(rank, world, full):
    model = make_model()
    ddp, state, opt = scape_setup(model, 0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state.load_state_dict(full)
    mean_ok = all(torch.allclose(state.residuals[n], (full["residuals"][0][n] + full["residuals"][1][n]) / 2)
                  for n in full["residuals"][0])
    train(ddp, opt, rank, 3, start=full["step"])
    return [str(w.message) for w in caught], mean_ok, state.step


def test_checkpoint_resume_is_bit_for_bit_and_survives_world_size_change():
    (straight, resumed, full), (straight1, resumed1, _) = run_distributed(_resume)
    for a, b in zip(straight[0] + straight[1], resumed[0] + resumed[1]):
        assert torch.equal(a, b)
    assert len(full["residuals"]) == 2 and full["step"] == 10
    (caught, mean_ok, step), = run_distributed(_resume_one_rank, full, world_size=1)
    assert any("world size 2" in w for w in caught)
    assert mean_ok and step == 13


def test_checkpoint_resume_is_bit_for_bit_on_an_encoded_wire():
    (straight, resumed, _), _ = run_distributed(_resume, "int4")  # the same buckets: the same rounding
    for a, b in zip(straight[0] + straight[1], resumed[0] + resumed[1]):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------
def _accumulation(rank, world):
    big = make_model()
    ddp, _, opt = scape_setup(big, 0.9)
    for step in range(10):
        x, y = batch(step, rank, n=16)
        loss_fn(ddp, x, y).backward()
        opt.step()
        opt.zero_grad()
    acc = make_model()
    ddp, state, opt = scape_setup(acc, 0.9)
    for step in range(10):
        x, y = batch(step, rank, n=16)
        with ddp.no_sync():
            (loss_fn(ddp, x[:8], y[:8]) / 2).backward()
        (loss_fn(ddp, x[8:], y[8:]) / 2).backward()
        opt.step()
        opt.zero_grad()
    return max((p - q).abs().max().item() for p, q in zip(big.parameters(), acc.parameters())), state.stats()


def test_no_sync_accumulation_matches_one_big_batch():
    (diff, stats), _ = run_distributed(_accumulation)
    assert diff < 1e-5
    assert stats["steps"] == 10


# ----------------------------------------------------------------------------------------
def _nonfinite(rank, world, at_step):
    model = make_model()
    ddp, state, opt = scape_setup(model, 0.9, warmup=3)
    for step in range(12):
        loss = loss_fn(ddp, *batch(step, rank))
        if step == at_step and rank == 1:
            loss = loss * float("inf")
        loss.backward()
        opt.step()
        opt.zero_grad()
    finite = all(torch.isfinite(t).all() for t in list(model.parameters()) + list(state.residuals.values())
                 + [opt.state[p]["exp_avg"] for p in model.parameters()])
    return snapshot(model, opt), finite, state.stats()["skipped_steps"]


@pytest.mark.parametrize("at_step", [1, 7])  # a dense warm-up step and a sparse step
def test_nonfinite_gradient_on_one_rank_skips_everywhere(at_step):
    (s0, finite0, skipped0), (s1, finite1, skipped1) = run_distributed(_nonfinite, at_step)
    assert finite0 and finite1 and skipped0 == skipped1 == 1
    assert all(torch.equal(a, b) for a, b in zip(s0[0] + s0[1], s1[0] + s1[1]))


# ----------------------------------------------------------------------------------------
def _misuse(rank, world):
    errors = {}
    model = make_model()
    ddp, state, opt = scape_setup(model, 0.9)
    loss_fn(ddp, *batch(0, rank)).backward()
    try:  # a second synchronized backward with no optimizer step in between
        loss_fn(ddp, *batch(1, rank)).backward()
    except RuntimeError as e:
        errors["hook_without_step"] = str(e)

    model = make_model()
    ddp = DDP(model)
    state = ScapeState(ddp, sparsity=0.9)
    opt = ScapeAdamS(ddp.parameters(), state)
    loss_fn(ddp, *batch(0, rank)).backward()
    try:
        opt.step()
    except RuntimeError as e:
        errors["step_without_hook"] = str(e)
    try:
        ScapeAdamS([nn.Parameter(torch.zeros(3))], state)
    except ValueError as e:
        errors["foreign_parameter"] = str(e)
    try:
        ScapeAdamS(model.parameters(), object())
    except TypeError as e:
        errors["not_a_state"] = str(e)
    try:
        ScapeState(ddp, sparsity=1.5)
    except ValueError as e:
        errors["sparsity"] = str(e)
    try:
        ScapeState(ddp, warmup_steps=-2)
    except ValueError as e:
        errors["warmup"] = str(e)
    try:
        ScapeAdamS(ddp.parameters(), state, lr=-1.0)
    except ValueError as e:
        errors["lr"] = str(e)
    other = nn.Sequential(nn.Linear(16, 8))
    other_state = ScapeState(DDP(other), sparsity=0.9)
    saved = copy.deepcopy(state.state_dict())
    try:
        other_state.load_state_dict(saved)
    except ValueError as e:
        errors["other_model"] = str(e)
    try:
        ScapeState(ddp, sparsity=0.5).load_state_dict(saved)
    except ValueError as e:
        errors["other_sparsity"] = str(e)
    try:
        state.load_state_dict({"step": 3})
    except ValueError as e:
        errors["not_scape"] = str(e)
    errors["other_state_untouched"] = other_state.step == 0 and not other_state.residuals
    model = make_model()  # groups may differ in lr and weight decay, not in betas or eps (one masked update)
    ddp = DDP(model)
    state = ScapeState(ddp, sparsity=0.9, warmup_steps=0, ramp_steps=0)
    ddp.register_comm_hook(state, scape_hook)
    layers = list(model.children())
    opt = ScapeAdamS([{"params": layers[0].parameters(), "betas": (0.8, 0.95)},
                      {"params": [p for m in layers[1:] for p in m.parameters()], "weight_decay": 0.0}], state)
    loss_fn(ddp, *batch(0, rank)).backward()
    try:
        opt.step()
    except ValueError as e:
        errors["group_betas"] = str(e)
    return errors


def test_misuse_gives_clear_errors():
    errors, _ = run_distributed(_misuse)
    assert "twice without ScapeAdamS.step()" in errors["hook_without_step"]
    assert "register_comm_hook" in errors["step_without_hook"]
    assert "not synchronized" in errors["foreign_parameter"]
    assert "ScapeState" in errors["not_a_state"]
    assert "sparsity" in errors["sparsity"] and "warmup_steps" in errors["warmup"] and "lr" in errors["lr"]
    assert "another model" in errors["other_model"]
    assert "sparsity=0.9" in errors["other_sparsity"]
    assert "not a SCAPE state" in errors["not_scape"]
    assert errors["other_state_untouched"] is True
    assert "same betas and eps in every parameter group" in errors["group_betas"]


# ----------------------------------------------------------------------------------------
def _collectives(rank, world):
    import scape_core.hook as hook_module
    from scape_core.compat import ALL_GATHER

    calls = {"all_reduce": [], "all_gather": 0, "all_to_all": []}
    real_reduce, real_gather = hook_module.dist.all_reduce, getattr(dist, ALL_GATHER)
    real_to_all = hook_module.dist.all_to_all_single

    def counting_reduce(tensor, *args, **kwargs):
        calls["all_reduce"].append(tensor.numel())
        return real_reduce(tensor, *args, **kwargs)

    def counting_gather(*args, **kwargs):
        calls["all_gather"] += 1
        return real_gather(*args, **kwargs)

    def counting_to_all(output, tensor, *args, **kwargs):
        calls["all_to_all"].append(tensor.numel() * tensor.element_size())
        return real_to_all(output, tensor, *args, **kwargs)

    hook_module.dist.all_reduce = counting_reduce
    setattr(dist, ALL_GATHER, counting_gather)
    hook_module.dist.all_to_all_single = counting_to_all
    try:
        out = {}
        for score in ("age_momentum", "momentum_residual"):  # replicated: no mask exchange; per rank: one
            model = make_model()
            ddp, state, opt = scape_setup(model, 0.99, warmup=3, ddp_kwargs={"bucket_cap_mb": 0.01}, score=score,
                                          wire="native")
            train(ddp, opt, rank, 3)
            calls["all_reduce"].clear()
            calls["all_gather"], before = 0, state.stats()["hook_calls"]
            train(ddp, opt, rank, 10, start=3)
            out[score] = dict(sparse=list(calls["all_reduce"]), gathers=calls["all_gather"],
                              mask_bytes=state.stats()["mask_bytes"], hook_calls=state.stats()["hook_calls"] - before)
        # an encoded wire: per sparse step one all-to-all and one all-gather, no all-reduce
        model = make_model()
        ddp, state, opt = scape_setup(model, 0.99, warmup=3, ddp_kwargs={"bucket_cap_mb": 0.01}, wire="int4")
        train(ddp, opt, rank, 3)
        calls["all_reduce"].clear()
        calls["all_gather"], calls["all_to_all"], before = 0, [], state.stats()
        train(ddp, opt, rank, 10, start=3)
        after = state.stats()
        out["int4"] = dict(reduces=len(calls["all_reduce"]), gathers=calls["all_gather"],
                           to_all=list(calls["all_to_all"]),
                           hook_calls=after["hook_calls"] - before["hook_calls"],
                           bytes=after["bytes_sent"] - before["bytes_sent"])
        # with a ramp: 2 steps each at 25%, 6.25%, 1.5625%, then 1% (values per step, all buckets)
        ramped = make_model()
        ddp, state, opt = scape_setup(ramped, 0.99, warmup=3, ramp_steps=6, wire="native")
        calls["all_reduce"].clear()
        for step in range(11):
            before = len(calls["all_reduce"])
            train(ddp, opt, rank, 1, start=step)
            out.setdefault("ramp", []).append(sum(calls["all_reduce"][before:]))
        return out, [p.numel() for p in model.parameters()]
    finally:
        hook_module.dist.all_reduce = real_reduce
        setattr(dist, ALL_GATHER, real_gather)
        hook_module.dist.all_to_all_single = real_to_all


def expected_values(numels: list[int], density: float, chunk: int = 4096) -> int:
    """Every row of ``chunk`` coordinates of a parameter exchanges ceil(density * its length)."""
    return sum((n // chunk) * math.ceil(density * chunk - 1e-9) + (math.ceil(density * (n % chunk) - 1e-9))
               for n in numels)


def test_one_compact_all_reduce_per_step_and_masks_exchanged_only_when_the_score_is_per_rank():
    (out, numels), _ = run_distributed(_collectives)
    n = sum(numels)
    for score, gathers in (("age_momentum", 0), ("momentum_residual", 10)):
        sparse = out[score]["sparse"]
        # several buckets, one all-reduce per step of the whole mask: 1% of every row, rounded up
        assert sparse == [expected_values(numels, 0.01)] * 10
        assert out[score]["hook_calls"] >= 20  # every bucket still went through the hook
        assert out[score]["gathers"] == gathers  # one mask all-gather after each step, only for a per-rank score
        assert (out[score]["mask_bytes"] > 0) == (gathers > 0)
    encoded = out["int4"]
    assert encoded["reduces"] == 0 and encoded["hook_calls"] >= 20  # several buckets, 10 steps
    assert len(encoded["to_all"]) == encoded["gathers"] == 10  # one exchange per step
    assert sum(encoded["to_all"]) == encoded["bytes"]  # the bytes counted are the bytes handed over
    ramp = out["ramp"]
    assert ramp[:3] == [n, n, n]  # dense warm-up
    for i, density in enumerate([0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, 0.01, 0.01]):
        assert ramp[3 + i] == expected_values(numels, density), (i, ramp)


# ----------------------------------------------------------------------------------------
def _fp16_large_gradients(rank, world):
    torch.manual_seed(0)
    model = nn.Linear(1000, 100, bias=False).half()
    ddp, state, opt = scape_setup(model, 0.9, warmup=1)
    for step in range(4):
        model.weight.grad = None
        (ddp(torch.ones(1, 1000, dtype=torch.float16)).float().sum() * 2.0).backward()  # grads: 2.0 each
        opt.step()
    return state.stats()["skipped_steps"], bool(torch.isfinite(model.weight).all())


def test_fp16_gradients_summing_past_fp16_range_are_not_skipped():
    for skipped, finite in run_distributed(_fp16_large_gradients):
        assert skipped == 0 and finite  # 100k gradients of 2.0 sum past 65504: still a finite step


# ----------------------------------------------------------------------------------------
DEVICE_READS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "equal")  # the ops a GPU must sync for


def _device_reads(rank, world):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):
        """Records every op whose result the host must wait for (item/bool, data-dependent shapes)."""

        def __init__(self):
            super().__init__()
            self.reads = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if any(name in str(func) for name in DEVICE_READS):
                self.reads.append(str(func))
            return func(*args, **(kwargs or {}))

    out = {}
    for score, sharded, wire in (("age_momentum", False, "native"), ("momentum_residual", False, "native"),
                                 ("age_momentum", True, "native"), ("age_momentum", False, "int4"),
                                 ("age_momentum", True, "int4")):
        model = make_model()
        ddp, state, opt = scape_setup(model, 0.9, warmup=2, ddp_kwargs={"bucket_cap_mb": 0.01}, score=score,
                                      shard_optimizer=sharded, chunk_size=64 if sharded else 4096, wire=wire)
        train(ddp, opt, rank, 4)
        watch = Watch()
        with watch:  # a sparse step: the hook (gloo's callback thread aside) and the optimizer
            train(ddp, opt, rank, 2, start=4)
        out[f"{score}{' sharded' * sharded}{'' if wire == 'native' else ' ' + wire}"] = watch.reads
    dense = make_model()
    ddp, state, opt = scape_setup(dense, 0.9, warmup=5)
    watch = Watch()
    with watch:  # the check itself works: a dense step reads its verdict on the host
        train(ddp, opt, rank, 1)
    out["dense"] = watch.reads
    return out


def test_sparse_steps_never_wait_on_the_device():
    for reads in run_distributed(_device_reads):
        for case in ("age_momentum", "momentum_residual", "age_momentum sharded", "age_momentum int4",
                     "age_momentum sharded int4"):
            assert reads[case] == [], (case, reads[case])
        assert any("_local_scalar_dense" in r for r in reads["dense"])
