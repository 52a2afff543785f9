"""On a GPU: replicated state stays bit-identical, sparsity 0 is dense AdamS, resume is exact (skipped without one).

Two ranks share one GPU over gloo (it carries CUDA tensors), each with its own batches, under bf16
autocast: every rank's gradients differ (and the attention backward may differ run to run, which is
fine: gradients are rank-local), but every computation of replicated state (the masks, ``m``, the rule's
statistics, the windows, the parameters) must give the same bits on both. ``kernels="compiled"`` runs
Triton kernels here, generated from the same passes as the CPU's C++; they are compiled and run under
torch's deterministic algorithms whatever the caller set (``scape_core.kernels.deterministic``).

    python -m pytest -q tests/test_cuda.py          # on a machine with a GPU (a few minutes: the compiles)
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.parallel import DistributedDataParallel as DDP

from benchmarks.bench_common import GPT
from scape_core import AdamS, ScapeAdamS, ScapeState, load_checkpoint, save_checkpoint, scape_hook
from tests.dist import run_distributed

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

VOCAB, WIDTH, LAYERS, CONTEXT = 256, 64, 2, 32
VARIANTS = {f"{kernels} {selection} {wire}": dict(kernels=kernels, selection=selection, wire=wire)
            for kernels, selection, wire in itertools.product(("eager", "compiled"), ("groups", "topk"),
                                                              ("native", "int4"))}
VARIANTS["eager sharded"] = dict(shard_optimizer=True)
VARIANTS["eager ramp"] = dict(ramp_steps=4)
STEPS = 10


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(VOCAB, WIDTH, LAYERS, heads=2, context=CONTEXT).cuda()


def _step(ddp: DDP, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(VOCAB, (4, CONTEXT), generator=g).cuda()
    exact = torch.are_deterministic_algorithms_enabled()  # the math attention: a reproducible backward
    backends = [SDPBackend.MATH] if exact else list(SDPBackend)
    with torch.autocast("cuda", dtype=torch.bfloat16), sdpa_kernel(backends):
        loss = ddp(x, x.roll(-1, 1))
    loss.backward()
    opt.step()
    opt.zero_grad()


def _setup(**fields) -> tuple[GPT, DDP, ScapeState, ScapeAdamS]:
    model = _model()
    ddp = DDP(model, device_ids=[0], bucket_cap_mb=0.05)  # several buckets
    state = ScapeState(ddp, **{"sparsity": 0.99, "warmup_steps": 2, "ramp_steps": 0, **fields})
    ddp.register_comm_hook(state, scape_hook)
    return model, ddp, state, ScapeAdamS(ddp.parameters(), state, lr=3e-3, weight_decay=0.1)


def _replicated(state: ScapeState, opt: ScapeAdamS, model: GPT) -> torch.Tensor:
    """Every replicated value of this rank, flat, on the CPU: parameters, m, statistics, windows (not sharded),
    the scheduled masks."""
    parts = [p.detach().float().reshape(-1) for p in model.parameters()]
    if not state.sharded:  # sharded: each rank keeps its own rows of these
        parts += [opt.momentum_buffer.view(-1), *[b.view(-1) for b in opt.statistics.values()]]
        if state.buffers.windows is not None:
            parts.append(state.buffers.windows.view(-1))
    parts += [m.cols.float().view(-1) for _, m in sorted(state.masks.items())]
    return torch.cat([p.cpu() for p in parts])


def _replicas(rank: int, world: int, names: list[str]) -> dict:
    torch.cuda.set_device(0)
    out = {}
    for name in names:
        model, ddp, state, opt = _setup(**VARIANTS[name])
        for t in range(STEPS):
            _step(ddp, opt, t, rank)
        mine = _replicated(state, opt, model)
        every = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        out[name] = dict(same=all(torch.equal(every[0], e) for e in every), sparse=not state.is_dense(state.step - 1),
                         skipped=state.skipped_steps, compiled=state.kernels.built)
        state.wait()
    return out


@pytest.fixture(scope="module")
def replicas() -> dict:
    return run_distributed(_replicas, list(VARIANTS))[0]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_replicas_are_bit_identical_on_one_gpu(replicas, name):
    r = replicas[name]
    assert r["sparse"] and r["skipped"] == 0, r
    assert r["same"], f"{name}: the ranks' replicated state differs"
    if VARIANTS[name].get("kernels") == "compiled":
        assert {"stage", "finish", "pick" if VARIANTS[name]["selection"] == "groups" else "score"} <= set(
            r["compiled"]), r["compiled"]


def _reproducible() -> None:
    """The model's own forward and backward reproducible run to run (the exact comparisons need the same
    gradients twice): torch's deterministic algorithms (SCAPE's eager step must run under them too),
    cuBLAS's fixed workspace, and the math attention (see _step)."""
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # before the first cuBLAS call of this process
    torch.use_deterministic_algorithms(True)
    torch.cuda.set_device(0)


def _dense_against_adams(rank: int, world: int) -> bool:
    _reproducible()
    model, ddp, state, opt = _setup(sparsity=0.0)
    reference = _model()
    ref_ddp = DDP(reference, device_ids=[0])
    ref_opt = AdamS(ref_ddp.parameters(), lr=3e-3, weight_decay=0.1)
    for t in range(6):
        _step(ddp, opt, t, rank)
        _step(ref_ddp, ref_opt, t, rank)
    state.wait()
    return all(torch.equal(p, q) for p, q in zip(model.parameters(), reference.parameters()))


def test_sparsity_zero_is_dense_adams_on_one_gpu():
    assert all(run_distributed(_dense_against_adams))


def _resume(rank: int, world: int, tmp: str) -> bool:
    _reproducible()
    path = Path(tmp) / "ckpt.pt"
    model, ddp, state, opt = _setup()
    for t in range(5):
        _step(ddp, opt, t, rank)
    save_checkpoint(path, state, model=model, optimizer=opt)
    for t in range(5, 9):
        _step(ddp, opt, t, rank)
    full = [p.detach().clone() for p in model.parameters()]
    state.wait()
    model, ddp, state, opt = _setup()
    load_checkpoint(path, state, model=model, optimizer=opt)
    for t in range(5, 9):
        _step(ddp, opt, t, rank)
    state.wait()
    return all(torch.equal(p, q) for p, q in zip(full, model.parameters()))


def test_resume_is_exact_on_one_gpu(tmp_path):
    assert all(run_distributed(_resume, str(tmp_path)))
