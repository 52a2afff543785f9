"""The CPU's C loops (scape_core/fused.py, the linear rule's in update_rules.py) against the torch operators they
stand for: the same values at the same places, on tensors with padding, skipped steps and non-finite gradients."""

from __future__ import annotations

import pytest
import torch

from scape_core import fused, native
from scape_core.layout import FlatLayout
from scape_core.masks import Mask
from scape_core.update_rules import UPDATE_RULES, masked_update_pass

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler")


def _case(seed: int, chunk: int = 16):
    """Three tensors on a padded layout (their last rows shorter), their gradients, a residual and a mask's
    entries (its shape's order: a short row's padding slots are not entries)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"a": (5, 7), "b": (16,), "c": (3, 11)}
    params = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    layout = FlatLayout(params, chunk)
    grads = [torch.randn(s, generator=g) for s in shapes.values()]
    residual = torch.randn(layout.rows, chunk, generator=g)
    shape = layout.mask_shape(0.3)
    cols = torch.stack([torch.randperm(chunk, generator=g)[:shape.k].sort().values for _ in range(layout.rows)])
    entries = Mask(0.3, cols.to(torch.int16)).flat(layout)
    return layout, shape, list(params), params, grads, residual, entries


def _staged(layout: FlatLayout, names: list[str], tensors: list[torch.Tensor]) -> torch.Tensor:
    staging = layout.zeros()  # what the reference's staging buffer holds: padding 0
    for name, t in zip(names, tensors):
        layout.view(staging, name).copy_(t.reshape(-1))
    return staging.view(-1)


@pytest.mark.parametrize("seed", range(3))
def test_gather_and_stage_read_what_the_staging_buffer_would(seed):
    layout, shape, names, _, grads, residual, entries = _case(seed)
    table = fused.RowTable.of(layout, names)
    flat = _staged(layout, names, grads)
    assert torch.equal(fused.gather(grads, table, shape, entries), flat[entries])
    send, finite = fused.stage(grads, table, shape, residual, entries)
    assert bool(finite) and torch.equal(send, flat[entries] + residual.view(-1)[entries])
    grads[1][3] = float("inf")
    send, finite = fused.stage(grads, table, shape, residual, entries)
    assert not bool(finite) and send.isnan().all()
    grads[1][3], grads[0][0, 0], grads[0][0, 1] = 0.0, 3e38, 3e38  # finite, but their fp32 sum is not
    assert not bool(fused.stage(grads, table, shape, None, entries)[1])


@pytest.mark.parametrize("ok", [True, False])
@pytest.mark.parametrize("kept", [True, False])
def test_finish_adds_the_residual_and_leaves_the_mean_on_the_mask(ok, kept):
    layout, shape, names, _, grads, residual, entries = _case(4)
    table = fused.RowTable.of(layout, names)
    mean = torch.randn(entries.numel()) if ok else torch.zeros(entries.numel())
    rounding = torch.randn(entries.numel()) if kept else None
    flat, before = _staged(layout, names, grads), residual.clone().view(-1)
    fused.finish(grads, table, shape, residual, entries, mean, rounding, torch.tensor(ok))
    want = before.clone()
    if ok:
        want += flat
        want[entries] = rounding if kept else 0.0
    assert torch.equal(residual.view(-1), want)
    on_mask = torch.zeros_like(flat)
    on_mask[entries] = mean
    assert torch.equal(_staged(layout, names, grads), on_mask * (_staged(layout, names, [torch.ones_like(t)
                                                                                          for t in grads])))


def test_update_decays_every_coordinate_and_moves_the_entries():
    layout, shape, names, params, _, _, entries = _case(5)
    tensors = list(params.values())
    table = fused.RowTable.of(layout, names)
    u = torch.randn(entries.numel())
    before = _staged(layout, names, tensors)
    groups = torch.tensor([0, 1, 0], dtype=torch.int32)  # "b" in a group without decay
    fused.update(tensors, table, shape, groups, torch.tensor([-0.01, 0.0]), torch.tensor([True, False]),
                 torch.tensor([-0.1, -0.2]), torch.tensor(True), entries, u)
    decay = _staged(layout, names, [torch.full_like(t, 0.99 if i != 1 else 1.0) for i, t in enumerate(tensors)])
    scale = _staged(layout, names, [torch.full_like(t, -0.1 if i != 1 else -0.2) for i, t in enumerate(tensors)])
    want = before * decay
    want[entries] += scale[entries] * u
    assert torch.allclose(_staged(layout, names, tensors), want, rtol=1e-6, atol=1e-7)
    again = [t.clone() for t in tensors]
    fused.update(again, table, shape, groups, torch.tensor([-0.01, 0.0]), torch.tensor([True, False]),
                 torch.tensor([-0.1, -0.2]), torch.tensor(False), entries, torch.zeros_like(u))  # a skipped step
    assert all(torch.equal(a, b) for a, b in zip(again, tensors))


@pytest.mark.parametrize("applied", ["all", "none", "each"])
def test_the_linear_rules_c_loop_writes_the_same_state(applied):
    rule, g = UPDATE_RULES["linear"], torch.Generator().manual_seed(6)
    n, e = 4000, 700
    m = torch.randn(n, generator=g) * (torch.rand(n, generator=g) > 0.2)
    sq = torch.rand(n, generator=g) * (torch.rand(n, generator=g) > 0.3)  # some first windows
    windows = torch.randint(0, 50, (n,), generator=g).float()
    at = torch.randperm(n, generator=g)[:e].sort().values
    s = torch.randn(e, generator=g)
    s[3] = float("nan")  # a skipped step's value: written nowhere it is not applied
    flags = {"all": torch.tensor(True), "none": torch.tensor(False), "each": torch.rand(e, generator=g) > 0.4}
    mask = flags[applied]
    if applied != "none":
        s[3] = 1.0
    ref = [t.clone() for t in (m, sq, windows)]
    u_ref = masked_update_pass(rule, ref[0], {"sq": ref[1]}, ref[2], at, s, mask, torch.tensor(60.0), 0.9, 0.95,
                               1e-8)
    out = [t.clone() for t in (m, sq, windows)]
    u = rule.fused(out[0], {"sq": out[1]}, out[2], at, s, mask, 60, beta1=0.9, beta2=0.95, eps=1e-8)
    assert all(torch.equal(a, b) for a, b in zip(ref, out))  # m, sq and the windows: bit for bit
    assert torch.allclose(u, u_ref, rtol=2e-7, atol=0)  # u: torch's square root may round otherwise


def _train(rank: int, world: int, with_c: bool, wire: str) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from scape_core import ScapeAdamS, ScapeState, scape_hook
    from tests.models import batch, loss_fn, make_model

    if not with_c:  # as a machine without a C compiler: the staging buffer's torch operators throughout
        native._library, native._unavailable = None, "torch operators (test)"
    model = make_model()
    ddp = DDP(model, bucket_cap_mb=0.01)
    state = ScapeState(ddp, sparsity=0.99, warmup_steps=2, ramp_steps=3, chunk_size=64, wire=wire,
                       replica_check_every=1)
    ddp.register_comm_hook(state, scape_hook)
    opt = ScapeAdamS(ddp.parameters(), state, lr=1e-2, weight_decay=0.1)
    for t in range(10):
        loss_fn(ddp, *batch(t, rank)).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.05)  # between backward and step: read from p.grad
        opt.step()
        opt.zero_grad()
    out = dict(params=[p.detach().clone() for p in model.parameters()], residual=state.buffers.residual.clone(),
               m=opt.momentum_buffer.clone(), staging=state.buffers.staging_buffer is not None)
    state.wait()
    return out


@pytest.mark.parametrize("wire", ["native", "int4"])
def test_the_c_loops_train_as_the_staging_buffers_operators(wire):
    """Ten steps (a ramp, then 99%, a clip between backward and step, the replicas checked every step) through
    the C loops and through torch's operators: the same training to fp32 rounding, each run's ranks identical."""
    from tests.dist import run_distributed

    fast, slow = (run_distributed(_train, with_c, wire) for with_c in (True, False))
    for rank in range(2):
        assert not fast[rank]["staging"] and slow[rank]["staging"]  # the C path keeps no staging buffer
        for a, b in zip(fast[rank]["params"], slow[rank]["params"]):
            assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
        assert torch.allclose(fast[rank]["m"], slow[rank]["m"], rtol=1e-3, atol=1e-6)
        assert torch.allclose(fast[rank]["residual"], slow[rank]["residual"], rtol=1e-3, atol=1e-5)
