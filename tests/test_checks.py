"""Damaged checkpoints, long skip streaks, world size 1, and the resume checks
(another rank's state, another chunk_size, an in-place reload). 2 gloo processes on CPU, one
launch for the core's cases (see docs/reliability.md, "Damage, streaks, one process")."""

from __future__ import annotations

import copy
import warnings
import zipfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from scape_core import gather_state_dict, load_checkpoint, save_checkpoint
from scape_core.checkpoint import verify_file, verify_folder
from scape_core.state import SINGLE_PROCESS
from scape_core.streak import NOT_FINITE
from tests.dist import failure, run_distributed
from tests.test_core_ddp import batch, loss_fn, make_model, scape_setup, snapshot, train


def flip_bytes_of(path: str, tensor: torch.Tensor, count: int = 400) -> str:
    """Invert ``count`` bytes inside ``tensor``'s record of the torch file at ``path``; returns the record's name."""
    data = bytearray(Path(path).read_bytes())
    raw = tensor.detach().contiguous().cpu().numpy().tobytes()
    at = data.find(raw)
    assert at >= 0 and data.find(raw, at + 1) < 0, "the tensor's bytes must appear once in the file"
    for i in range(at + 16, at + 16 + min(count, len(raw) - 16)):
        data[i] ^= 0xFF
    Path(path).write_bytes(bytes(data))
    with zipfile.ZipFile(path) as archive:  # the record holding the flipped bytes
        return max((i for i in archive.infolist() if i.header_offset < at), key=lambda i: i.header_offset).filename


def unchanged(before, model, opt, state) -> bool:
    params, moments, residuals, step = before
    now_params, now_moments = snapshot(model, opt)
    return (all(torch.equal(a, b) for a, b in zip(params + moments, now_params + now_moments))
            and all(torch.equal(residuals[n], r) for n, r in state.residuals.items()) and step == state.step)


def everything(model, opt, state):
    return (*snapshot(model, opt), {n: r.clone() for n, r in state.residuals.items()}, state.step)


# ----------------------------------------------------------------------------------------
def _damaged_plain(rank, world, tmp):
    model = make_model()
    ddp, state, opt = scape_setup(model, 0.9)
    train(ddp, opt, rank, 6)
    path = f"{tmp}/plain.pt"
    save_checkpoint(path, state, model=model, optimizer=opt)
    verify_file(path)  # intact
    dist.barrier()
    entry = flip_bytes_of(path, model[0].weight) if rank == 0 else None
    dist.barrier()
    silently = torch.load(path, weights_only=False)["model"]["0.weight"].abs().max().item()  # torch reads it
    before = everything(model, opt, state)
    error = failure(lambda: load_checkpoint(path, state, model=model, optimizer=opt))
    return dict(entry=entry, error=error, silently=silently, same=unchanged(before, model, opt, state))


def _damaged_fabric(rank, world, tmp):
    import lightning as L

    from lightning_scape import ScapeFabricStrategy

    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=ScapeFabricStrategy(sparsity=0.9, warmup_steps=2,
                                                                                 ramp_steps=0))
    fabric.launch()  # the ranks are already launched (tests/dist.py): this only connects Fabric to them
    torch.manual_seed(0)
    net = make_model()
    model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    for t in range(5):
        fabric.backward(loss_fn(model, *batch(t, rank)))
        opt.step()
        opt.zero_grad()
    path = f"{tmp}/fabric.pt"
    fabric.save(path, {"model": model, "optimizer": opt})
    # the SCAPE state's residual of 0.weight: damage inside what only SCAPE reads
    residual = fabric.strategy.scape_state.residual("0.weight")
    gathered = [torch.empty_like(residual) for _ in range(world)]
    dist.all_gather(gathered, residual)
    entry = flip_bytes_of(path, gathered[1]) if rank == 0 else None
    dist.barrier()
    state = fabric.strategy.scape_state
    before = everything(net, opt, state)
    error = failure(lambda: fabric.load(path, {"model": model, "optimizer": opt}))
    return dict(entry=entry, error=error, same=unchanged(before, net, opt, state))


def _another_ranks_state(rank, world):
    model = make_model()
    ddp, state, opt = scape_setup(model, 0.9)
    train(ddp, opt, rank, 5)
    own = [None] * world
    dist.all_gather_object(own, state.state_dict())
    before = everything(model, opt, state)
    error = failure(lambda: state.load_state_dict(own[1 - rank]))
    same = unchanged(before, model, opt, state)
    ok = failure(lambda: state.load_state_dict(own[rank]))  # its own state loads
    return dict(error=error, same=same, own=ok)


def _another_chunk_size(rank, world):
    model = make_model()
    ddp, state, opt = scape_setup(model, 0.9, chunk_size=64)
    train(ddp, opt, rank, 5)
    saved = gather_state_dict(state)
    model = make_model()
    ddp, state, opt = scape_setup(model, 0.9)  # chunk_size 4096
    train(ddp, opt, rank, 5)
    masks = {s: m.cols.clone() for s, m in state.masks.items()}
    before = everything(model, opt, state)
    error = failure(lambda: state.load_state_dict(saved))
    same_masks = masks.keys() == state.masks.keys() and all(torch.equal(masks[s], m.cols)
                                                            for s, m in state.masks.items())
    same = unchanged(before, model, opt, state) and same_masks
    return dict(error=error, same=same)


def _in_place_reload(rank, world):
    model = make_model()
    ddp, state, opt = scape_setup(model, 0.9, ddp_kwargs={"bucket_cap_mb": 0.01})
    train(ddp, opt, rank, 14)
    straight = snapshot(model, opt), {n: r.clone() for n, r in state.residuals.items()}

    model = make_model()
    ddp, state, opt = scape_setup(model, 0.9, ddp_kwargs={"bucket_cap_mb": 0.01})
    train(ddp, opt, rank, 7)
    saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict(), "scape": gather_state_dict(state)})
    plans = len(state.buckets.plans)
    train(ddp, opt, rank, 3, start=7)  # runs on past the checkpoint: everything moves
    model.load_state_dict(saved["model"])  # into the same running model, optimizer and state
    opt.load_state_dict(saved["opt"])
    state.load_state_dict(saved["scape"])
    train(ddp, opt, rank, 7, start=7)
    resumed = snapshot(model, opt), {n: r.clone() for n, r in state.residuals.items()}
    same = (all(torch.equal(a, b) for a, b in zip(straight[0][0] + straight[0][1], resumed[0][0] + resumed[0][1]))
            and all(torch.equal(straight[1][n], resumed[1][n]) for n in straight[1]))
    return dict(same=same, plans=plans, step=state.step)


def _streaks(rank, world):
    """Rank 1's loss is non-finite at steps 3-9 and 12-16 (two streaks of 7 and 5); the adapters' way (stats()
    every step) and a plain loop's (no stats(): a copy of the counters started at step 25 is read at step 50)."""
    out = {}
    for calls_stats in (True, False):
        model = make_model()
        ddp, state, opt = scape_setup(model, 0.9, warmup=2)
        streaks = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for t in range(26 if calls_stats else 50):
                loss = loss_fn(ddp, *batch(t, rank))
                if rank == 1 and (3 <= t <= 9 or 12 <= t <= 16):
                    loss = loss * float("inf")
                loss.backward()
                opt.step()
                opt.zero_grad()
                if calls_stats:
                    streaks.append(state.stats()["skipped_streak"])
        out[calls_stats] = dict(warnings=[str(w.message) for w in caught if "SCAPE" in str(w.message)],
                                streaks=streaks, skipped=state.stats()["skipped_steps"])
    return out


def _core_launch(rank, world, tmp):
    return dict(damaged_plain=_damaged_plain(rank, world, tmp), another_rank=_another_ranks_state(rank, world),
                chunk=_another_chunk_size(rank, world), in_place=_in_place_reload(rank, world),
                streaks=_streaks(rank, world), damaged_fabric=_damaged_fabric(rank, world, tmp))


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    return run_distributed(_core_launch, str(tmp_path_factory.mktemp("checks")))


def test_a_damaged_checkpoint_is_refused_naming_file_and_entry(core, tmp_path):
    entry = core[0]["damaged_plain"]["entry"]
    assert entry.split("/")[-2:-1] == ["data"]  # a tensor record, not the pickle
    for r in core:
        got = r["damaged_plain"]
        assert got["silently"] > 10  # torch.load alone accepts it: the weights are |w| < 1 before
        assert got["error"].startswith("ValueError: checkpoint ") and "plain.pt" in got["error"], got["error"]
        assert f"its entry {entry!r} does not match the CRC-32" in got["error"] and got["same"]
    # a truncated file is refused by the same check; a folder is checked file by file
    path = tmp_path / "t.pt"
    torch.save({"w": torch.ones(100)}, path)
    path.write_bytes(path.read_bytes()[:300])
    with pytest.raises(ValueError, match="truncated"):
        verify_folder(tmp_path)


def test_a_damaged_fabric_checkpoint_is_refused_before_anything_loads(core):
    entry = core[0]["damaged_fabric"]["entry"]
    for r in core:
        got = r["damaged_fabric"]
        assert "fabric.pt" in got["error"] and f"its entry {entry!r}" in got["error"] and got["same"], got


def test_another_ranks_own_state_is_refused_saying_gather_state_dict(core):
    for rank, r in enumerate(core):
        got = r["another_rank"]
        assert got["error"] == (f"ValueError: this SCAPE state is rank {1 - rank} of world size 2; to resume on rank "
                                f"{rank} of 2, save with gather_state_dict()")
        assert got["same"] and got["own"] == "no error"


def test_another_chunk_size_is_refused_and_the_run_is_unchanged(core):
    for r in core:
        assert r["chunk"]["error"] == ("ValueError: SCAPE state was saved with chunk_size=64, this run uses "
                                       "chunk_size=4096") and r["chunk"]["same"]


def test_an_in_place_reload_continues_bit_for_bit(core):
    for r in core:
        assert r["in_place"]["plans"] > 1 and r["in_place"]["step"] == 14 and r["in_place"]["same"]


def test_a_long_skip_streak_warns_once_per_streak(core):
    for rank, r in enumerate(core):
        every_step, plain = r["streaks"][True], r["streaks"][False]
        assert every_step["skipped"] == plain["skipped"] == 12
        assert every_step["streaks"][:12] == [0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 0, 0]
        assert every_step["streaks"][12:18] == [1, 2, 3, 4, 5, 0]
        streak = [w for w in every_step["warnings"] if "consecutive optimizer steps were skipped" in w]
        assert streak == ([f"SCAPE: 5 consecutive optimizer steps were skipped (steps {a}..{b}): the gradients did "
                           f"not pass SCAPE's finiteness check at each ({NOT_FINITE}), so nothing is being learned. "
                           "Check the loss, its scale and the learning rate; stats()['skipped_streak'] counts the "
                           "current streak" for a, b in ((3, 7), (12, 16))] if rank == 0 else [])
        own = [w for w in every_step["warnings"] if "own gradients" in w]
        # sparse from step 2 (warmup=2): each rank knows what it sent, so rank 1 names itself
        named = [f"SCAPE: rank 1's own gradients failed the finiteness check in 5 of the 5 consecutive skipped steps "
                 f"(steps {a}..{b}): {NOT_FINITE}" for a, b in ((3, 7), (12, 16))]
        assert own == ([] if rank == 0 else named)
        # no stats(): both streaks are reported at step 50 (from the copy of step 25), in one warning for the latest
        late = [w for w in plain["warnings"] if "consecutive optimizer steps were skipped" in w]
        assert late == ([streak[-1]] if rank == 0 else [])


# ----------------------------------------------------------------------------------------
def _damaged_accelerate(tmp):
    """Accelerate on one process (SCAPE inactive; the folder check is the same at any world size)."""
    from accelerate import Accelerator

    from accelerate_scape import ScapePlugin

    accelerator = Accelerator(cpu=True)
    net = make_model()
    model, opt = ScapePlugin().prepare(accelerator, net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    for t in range(3):
        accelerator.backward(loss_fn(model, *batch(t, 0)))
        opt.step()
        opt.zero_grad()
    accelerator.save_state(tmp)
    entry = flip_bytes_of(f"{tmp}/optimizer.bin", opt.optimizer.state[net[0].weight]["exp_avg"])
    before = snapshot(net, opt.optimizer)
    error = failure(lambda: accelerator.load_state(tmp))
    after = snapshot(net, opt.optimizer)
    return dict(entry=entry, error=error, same=all(torch.equal(a, b) for a, b in zip(before[0] + before[1],
                                                                                      after[0] + after[1])))


def _one_process(rank, world, tmp):
    out = {"accelerate": _damaged_accelerate(tmp)}
    for name, cfg in (("replicated", {}), ("sharded", {"shard_optimizer": True})):
        model = make_model()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp, state, opt = scape_setup(model, 0.9, warmup=2, **cfg)
        train(ddp, opt, rank, 6)
        out[name] = dict(warnings=[str(w.message) for w in caught], stats=state.stats(),
                         sparse=state.sparse_started)
    import lightning as L

    from lightning_scape import ScapeFabricStrategy

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fabric = L.Fabric(accelerator="cpu", devices=1, strategy=ScapeFabricStrategy(sparsity=0.9, warmup_steps=2))
        fabric.launch()
        net = make_model()
        model, opt = fabric.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    out["fabric"] = dict(warnings=[str(w.message) for w in caught], stats=fabric.strategy.scape_state.stats(),
                         sparse=True)
    return out


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    (result,) = run_distributed(_one_process, str(tmp_path_factory.mktemp("one")), world_size=1)
    return result


def test_a_damaged_accelerate_checkpoint_is_refused_before_anything_loads(one):
    damaged = one["accelerate"]
    assert "optimizer.bin" in damaged["error"] and f"its entry {damaged['entry']!r}" in damaged["error"], damaged
    assert damaged["same"]


def test_world_size_1_says_so_and_reports_nothing_sent(one):
    for name, got in one.items():
        if name == "accelerate":
            continue
        assert got["sparse"]
        assert [w for w in got["warnings"] if w.startswith("SCAPE: world size 1")] == [SINGLE_PROCESS], name
        stats = got["stats"]
        assert stats["bytes_sent"] == stats["values_sent"] == stats["dense_bytes"] == stats["mask_bytes"] == 0, name
        assert stats["compression"] == 1.0 and stats["steps"] == (0 if name == "fabric" else 6), name
