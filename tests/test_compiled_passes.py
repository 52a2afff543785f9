"""The compiled passes' plumbing, cheaply: what ``kernels="compiled"`` keys, caches and restores, checked
without compiling (``torch.compile`` or ``compile_kernel`` replaced by the plain function), so these run in
the default suite. The compiles themselves are in the ``-m slow`` tests (``test_arithmetic.py``'s compiled
cases, ``test_fsdp.py``, ``test_adams.py``)."""

from __future__ import annotations

import pytest
import torch

from scape_core import kernels
from scape_core.adams import adams_pass
from scape_core.kernels import Kernels, compile_kernel, deterministic
from scape_core.optimizer import sparse_step_pass, update_pass
from tests.dist import run_distributed
from tests.models import batch, loss_fn, make_model


def _setting() -> tuple[bool, bool]:
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


@pytest.mark.parametrize("mode, warn_only", [(False, False), (True, True), (True, False)])
def test_deterministic_restores_the_mode_and_warn_only(mode, warn_only):
    """``deterministic()`` turns torch's deterministic algorithms on (not warn-only) for a pass and gives back
    both the user's mode and its ``warn_only``, after a pass and after one that raised."""
    before = _setting()
    try:
        torch.use_deterministic_algorithms(mode, warn_only=warn_only)
        with deterministic():
            assert _setting() == (True, False)
        assert _setting() == (mode, warn_only)
        with pytest.raises(ZeroDivisionError), deterministic():
            1 / 0
        assert _setting() == (mode, warn_only)
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_a_compiled_pass_runs_deterministic_and_restores_warn_only(monkeypatch):
    """Each call of a compiled pass (its first, which compiles, and the later ones) runs under
    ``deterministic()`` and leaves the user's ``use_deterministic_algorithms(True, warn_only=True)`` as it was
    (here ``torch.compile`` returns the function itself: the wrapper is what is checked)."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: fn)
    before = _setting()
    seen = []

    def probe(x: torch.Tensor) -> torch.Tensor:
        seen.append(_setting())
        return x + 1

    run = compile_kernel(probe, "probe")
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        for _ in range(3):
            run(torch.zeros(2))
            assert _setting() == (True, True)
        assert seen == [(True, False)] * 3
        assert run.first_call_seconds is not None
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


def test_two_states_passes_compile_separate_code_objects(monkeypatch):
    """dynamo keeps its graphs per code object (8 at most; past it ``fullgraph=True`` fails): every state, and
    every key of a state, compiles its own copy of a pass's code, never the module function's own. Checked on
    what ``compile_kernel`` hands ``torch.compile``, without compiling (the compiled twin is ``-m slow``)."""
    handed = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: handed.append(fn) or fn)
    first, second = Kernels("compiled"), Kernels("compiled")
    for state in (first, second):
        state.get("AdamS", adams_pass, 1)
        state.get("AdamS", adams_pass, 2)  # another key of the same state (another set of shapes)
        state.get("AdamS", adams_pass, 1)  # built once per key
        state.get("sparse_step", sparse_step_pass, 1)
        state.get("update", update_pass, 1)
    codes = [fn.__code__ for fn in handed]
    assert len(handed) == 2 * 4
    assert len({id(code) for code in codes}) == len(codes), "two passes share one code object"
    assert not {id(adams_pass.__code__), id(sparse_step_pass.__code__), id(update_pass.__code__)} & {
        id(code) for code in codes}
    assert first.get("AdamS", adams_pass, 1) is not second.get("AdamS", adams_pass, 1)
    assert Kernels("eager").get("AdamS", adams_pass, 1) is adams_pass  # eager: the function itself


# ----------------------------------------------------------------------------------------
GROUP_LR = (1e-2, 2.5e-3)  # the first layer's group and the rest's
GROUP_WD = (0.1, 0.0)


def _two_groups(rank: int, world: int) -> dict:
    """The same 10 steps (3 dense, 7 sparse at 90%) with eager kernels and with the compiled path's passes run
    uncompiled (``compile_kernel`` returns the pure function): two parameter groups of different lr and
    weight decay. Returns both runs' parameters and which passes each built."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from scape_core import ScapeAdamS, ScapeState, scape_hook

    kernels.compile_kernel = lambda fn, name: fn  # the compiled path's keys, scalars and passes, no compiler
    out = {}
    for mode in ("eager", "compiled"):
        model = make_model()
        ddp = DDP(model)
        state = ScapeState(ddp, sparsity=0.9, warmup_steps=3, ramp_steps=0, kernels=mode, wire="native",
                           selection="topk")
        ddp.register_comm_hook(state, scape_hook)
        first = list(model[0].parameters())
        rest = [p for p in model.parameters() if all(p is not q for q in first)]
        opt = ScapeAdamS([{"params": first, "lr": GROUP_LR[0], "weight_decay": GROUP_WD[0]},
                          {"params": rest, "lr": GROUP_LR[1], "weight_decay": GROUP_WD[1]}], state)
        for step in range(10):
            loss_fn(ddp, *batch(step, rank)).backward()
            opt.step()
            opt.zero_grad()
        out[mode] = dict(params=[p.detach().clone() for p in model.parameters()], built=state.kernels.built)
    return out


def test_the_compiled_sparse_step_applies_each_groups_lr_as_eager():
    """The compiled sparse step (:meth:`ScapeAdamS._sparse_compiled`: per-group decay factors and ``-lr``
    scalars read by :func:`scape_core.optimizer.update_pass`) moves two parameter groups of different lr and
    weight decay as the eager step does. One ``-lr`` slot shared by the groups (the last group's lr for all)
    fails it. The passes run uncompiled: what is pinned is the plumbing, not inductor."""
    for out in run_distributed(_two_groups):
        assert {"sparse_step", "update"} <= set(out["compiled"]["built"]), out["compiled"]["built"]
        for p, q in zip(out["compiled"]["params"], out["eager"]["params"]):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
