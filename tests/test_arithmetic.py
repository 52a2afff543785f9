"""The core's arithmetic, one step at a time, against the contract's formulas (tests/reference.py).

Two gloo ranks train a small model with the real hook and optimizer; each step records what it
read (the state before, every rank's local gradient, the mask) and what it wrote (the state
after), through ``tests/probe.py``. The test process then recomputes every step from the
contract in float64 and compares: parameters, m, sq, windows and residuals after each step, and
each mask against the top-k of the contract's score computed from the state it was selected on.
Comparing step by step (not whole trajectories) keeps the tolerances tight: a rounding
difference never grows into a different mask.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from scape_core import ScapeAdamS, ScapeConfig, ScapeState, scape_hook
from tests import probe, reference
from tests.dist import run_distributed
from tests.models import batch, make_model

BETAS, EPS, WD = (0.9, 0.95), 1e-8, 0.1
CASES = {  # every sparse case runs at its named density (ramp_steps=0) unless it tests the ramp
    "linear90": dict(config=dict(sparsity=0.9, warmup_steps=3, ramp_steps=0), steps=24, bucket_cap_mb=0.01),
    "linear99_ramp": dict(config=dict(sparsity=0.99, warmup_steps=2, ramp_steps=9, wire="native"), steps=20),
    "lazy80_delay0_refresh2": dict(config=dict(sparsity=0.8, warmup_steps=2, ramp_steps=0, update="lazy",
                                               mask_delay=0, mask_refresh=2), steps=14, bucket_cap_mb=0.01),
    "dense": dict(config=dict(sparsity=0.0), steps=10),
    # rank 1's loss is non-finite at a dense step (1) and at a sparse step (6): both steps are skipped
    "skips": dict(config=dict(sparsity=0.9, warmup_steps=3, ramp_steps=0), steps=10, nonfinite_at=(1, 6)),
    # rank 1's last layer alone (one bucket of several) gets a NaN gradient at a sparse step: the step is dropped whole
    "skip_one_bucket": dict(config=dict(sparsity=0.9, warmup_steps=3, ramp_steps=0), steps=9, bucket_cap_mb=0.01,
                            poison={6: (1, float("nan"), "all")}),
    # the same on a rounding wire (the NaN travels in one block's scale)
    "skip_one_bucket_int8": dict(config=dict(sparsity=0.9, warmup_steps=3, ramp_steps=0, wire="int8", wire_block=16),
                                 steps=9, bucket_cap_mb=0.01, poison={6: (1, float("nan"), "all")}),
    # one coordinate of the last layer off the step's mask, +inf on rank 1, then -inf on rank 0: the values
    # exchanged would stay finite, only the rank's own check of its gradients sees it
    "inf_off_mask": dict(config=dict(sparsity=0.9, warmup_steps=3, ramp_steps=0), steps=9, bucket_cap_mb=0.01,
                         poison={5: (1, float("inf"), "one"), 6: (0, float("-inf"), "one")}),
    "bf16": dict(config=dict(sparsity=0.9, warmup_steps=2, ramp_steps=0), steps=12, dtype=torch.bfloat16),
    # shard_optimizer: each rank keeps m, sq, windows of its block of rows (64-wide: blocks cut parameters)
    "linear99_ramp_sharded": dict(config=dict(sparsity=0.99, warmup_steps=2, ramp_steps=9, chunk_size=64,
                                              shard_optimizer=True), steps=20, bucket_cap_mb=0.01),
    "lazy80_delay0_refresh2_sharded": dict(config=dict(sparsity=0.8, warmup_steps=2, ramp_steps=0, update="lazy",
                                                       mask_delay=0, mask_refresh=2, shard_optimizer=True), steps=14),
    "skips_sharded": dict(config=dict(sparsity=0.9, warmup_steps=3, ramp_steps=0, shard_optimizer=True), steps=10,
                          nonfinite_at=(1, 6)),
    # encoded wires (blocks of 16 values: several per bucket); the int4 case skips a sparse step
    "int8": dict(config=dict(sparsity=0.8, warmup_steps=2, ramp_steps=0, wire="int8", wire_block=16), steps=12,
                 bucket_cap_mb=0.01),
    "int4": dict(config=dict(sparsity=0.9, warmup_steps=2, ramp_steps=0, wire="int4", wire_block=16), steps=12,
                 nonfinite_at=(6,)),
    "bfloat16_wire": dict(config=dict(sparsity=0.9, warmup_steps=2, ramp_steps=0, wire="bfloat16"), steps=12,
                          bucket_cap_mb=0.01),
}
# kernels="compiled" (scape_core.kernels): the same contract through the fused passes
COMPILED = ["linear90", "skips", "skip_one_bucket", "dense", "int4", "bf16", "linear99_ramp_sharded"]
CASES.update({f"{case}_compiled": {**CASES[case], "config": {**CASES[case]["config"], "kernels": "compiled"}}
              for case in COMPILED})
# selection="groups" (the default is "topk"): one pick per group of a row (ramp, partitioned lazy scores, int4)
GROUPS = ["linear99_ramp", "lazy80_delay0_refresh2_sharded", "int4", "linear90_compiled"]
CASES.update({f"{case}_groups": {**CASES[case], "config": {**CASES[case]["config"], "selection": "groups"}}
              for case in GROUPS})
SHARDED = ["linear99_ramp_sharded", "lazy80_delay0_refresh2_sharded"]
# -m slow: each compiles its passes afresh (15-20 s in a fresh clone)
SLOW = {"skips_compiled", "bf16_compiled", "linear90_compiled_groups"}


def lr_at(step: int) -> float:
    return 1e-2 * (1 - step / 40)  # changes every step: the core must read the group's lr each step


def recording_hook(local: dict, names: dict):
    """``scape_hook``, after copying this rank's local gradients (what the hook receives)."""

    def hook(state, bucket):
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            local[names[id(p)]] = g.detach().reshape(-1).double().clone()
        return scape_hook(state, bucket)

    return hook


def _record(rank: int, world: int, cases: dict) -> dict:
    out = {}
    for case, spec in cases.items():
        dtype = spec.get("dtype", torch.float32)
        model = make_model(dtype=dtype)
        ddp = DDP(model, bucket_cap_mb=spec.get("bucket_cap_mb", 25))
        state = ScapeState(ddp, config=ScapeConfig(**spec["config"]), replica_check_every=3)  # never fires
        local: dict = {}
        ddp.register_comm_hook(state, recording_hook(local, {id(p): n for n, p in state.params.items()}))
        opt = ScapeAdamS(ddp.parameters(), state, lr=lr_at(0), betas=BETAS, eps=EPS, weight_decay=WD)
        records = []
        for t in range(spec["steps"]):
            for group in opt.param_groups:
                group["lr"] = lr_at(t)
            before = probe.snapshot(state, opt)
            x, y = batch(t, rank, dtype=dtype)
            loss = (ddp(x) - y).float().pow(2).mean()
            if rank == 1 and t in spec.get("nonfinite_at", ()):
                loss = loss * float("inf")
            poison = _poison(model[-1].weight, state, t, rank, spec.get("poison", {}).get(t))
            loss.backward()
            if poison is not None:
                poison.remove()
            used = probe.mask(state, t)
            groups = None if used is None else probe.selection_groups(state, t)
            encoded = used is not None and state.config.resolved_wire != "native"
            compact = probe.wire_segments(state) if encoded else None
            synced = {n: p.grad.detach().reshape(-1).double().clone() for n, p in state.params.items()}
            opt.step()
            opt.zero_grad()
            records.append(dict(before=before, grads=dict(local), mask=used, groups=groups, compact=compact,
                                lr=lr_at(t), synced=synced, after=probe.snapshot(state, opt)))
        out[case] = dict(records=records, skipped=state.stats()["skipped_steps"], kernels=state.kernels.built,
                         plans=probe.shard_plans(state), buckets=[plan.names for plan in state.buckets.plans.values()])
    return out


def _poison(param: torch.nn.Parameter, state: ScapeState, step: int, rank: int, what: tuple | None):
    """A gradient hook on ``param`` for ``what`` = ``(rank, value, "all" | "one")`` at this step: every
    coordinate, or the first one off the step's mask, becomes ``value`` on that rank (None: no hook)."""
    if what is None or what[0] != rank:
        return None
    _, value, where = what
    if where == "all":
        return param.register_hook(lambda g: torch.full_like(g, value))
    free = torch.ones(param.numel(), dtype=torch.bool)
    free[probe.mask(state, step)[state.names[id(param)]]] = False
    at = int(free.nonzero()[0])

    def one(g: torch.Tensor) -> torch.Tensor:
        g = g.clone()
        g.view(-1)[at] = value
        return g

    return param.register_hook(one)


@pytest.fixture(scope="module")
def default_runs() -> list[dict]:
    return run_distributed(_record, {case: spec for case, spec in CASES.items() if case not in SLOW})


@pytest.fixture(scope="module")
def slow_runs() -> list[dict]:
    return run_distributed(_record, {case: CASES[case] for case in SLOW})


@pytest.fixture
def runs(request: pytest.FixtureRequest) -> list[dict]:
    """Every rank's records of the cases the test asks for (the slow cases' run only when one is)."""
    case = request.node.callspec.params.get("case") if hasattr(request.node, "callspec") else None
    return request.getfixturevalue("slow_runs" if case in SLOW else "default_runs")


def slow(case: str) -> Any:
    """``case`` as a parameter marked ``slow``."""
    return pytest.param(case, marks=pytest.mark.slow)


def _maybe_slow(case: str) -> Any:
    """``case``, marked ``slow`` if it is one of :data:`SLOW`."""
    return slow(case) if case in SLOW else case


@pytest.mark.parametrize("case", [slow(f"{c}_compiled") if f"{c}_compiled" in SLOW else f"{c}_compiled"
                                  for c in COMPILED])
def test_compiled_cases_ran_the_compiled_passes(runs, default_runs, case):
    eager = case.removesuffix("_compiled")
    groups = CASES[case]["config"].get("selection") == "groups"
    want = {"AdamS", "stage", "residual", "finish"} | ({"pick"} if groups else set())  # top-k: the C pick scores
    want |= {"masked_update"} if "sharded" in case else {"sparse_step", "update"}
    if eager == "dense":
        want = {"AdamS"}
    elif eager == "int4":
        want |= {"wire", "wire_own", "wire_decode"}
    for r, e in zip(runs, default_runs):
        assert want <= set(r[case]["kernels"]), (case, r[case]["kernels"])
        assert groups or eager == "dense" or "score" not in r[case]["kernels"]  # no stored score on the CPU
        assert not e[eager]["kernels"], eager  # eager: none


def steps_of(runs: list[dict], case: str) -> list[list[dict]]:
    """Per step, every rank's record."""
    return [list(recs) for recs in zip(*[r[case]["records"] for r in runs])]


def close(got: torch.Tensor, want: torch.Tensor, what: str, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    torch.testing.assert_close(got, want.to(got.dtype), rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("case", ["linear90", "linear99_ramp", "lazy80_delay0_refresh2", "dense", *SHARDED,
                                  "linear90_compiled", "dense_compiled", "linear99_ramp_sharded_compiled",
                                  *[_maybe_slow(f"{c}_groups") for c in GROUPS if c != "int4"]])
def test_every_step_follows_the_contract(runs, case):
    cfg = ScapeConfig(**CASES[case]["config"])
    checked = {"dense": 0, "sparse": 0}
    for t, recs in enumerate(steps_of(runs, case)):
        mask = recs[0]["mask"]
        assert all(_same_mask(r["mask"], mask) for r in recs), f"step {t}: ranks used different masks"
        want = reference.step([r["before"] for r in recs], [r["grads"] for r in recs], mask, rule=cfg.update,
                              lr=recs[0]["lr"], beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD)
        for rank, (rec, exp) in enumerate(zip(recs, want)):
            got = rec["after"]
            for name in exp["param"]:
                where = f"{case} step {t} rank {rank} {name}"
                close(got["param"][name], exp["param"][name], f"{where} parameter")
                close(got["m"][name], exp["m"][name], f"{where} m")
                close(got["residual"][name], exp["residual"][name], f"{where} residual")
                if mask is not None and cfg.update == "linear":
                    close(got["sq"][name], exp["sq"][name], f"{where} sq")
                    assert torch.equal(got["last_sync"][name], exp["last_sync"][name]), f"{where} window"
        checked["dense" if mask is None else "sparse"] += 1
    if cfg.dense:
        assert checked == {"dense": CASES[case]["steps"], "sparse": 0}
    else:
        assert checked["dense"] == cfg.warmup_steps and checked["sparse"] >= 8


@pytest.mark.parametrize("case", ["linear90", "linear99_ramp", "lazy80_delay0_refresh2", *SHARDED,
                                  "linear90_compiled", "linear99_ramp_sharded_compiled",
                                  *[_maybe_slow(f"{c}_groups") for c in GROUPS]])
def test_masks_are_the_picks_of_the_contract_score(runs, case):
    """``selection="groups"``: the best of each group of a row's score; ``"topk"``: the row's ``k`` best."""
    cfg = ScapeConfig(**CASES[case]["config"])
    steps = steps_of(runs, case)
    checked = 0
    for target, recs in enumerate(steps):
        mask = recs[0]["mask"]
        source = target - 1 - cfg.mask_delay  # the step whose end selected this mask
        if mask is None or source < 0:
            continue
        if (target - cfg.warmup_steps) % cfg.mask_refresh:  # not a refresh step: the last mask again
            assert _same_mask(mask, steps[target - 1][0]["mask"]), f"step {target}: mask not reused"
            continue
        density = reference.density_at(target, sparsity=cfg.sparsity, warmup_steps=cfg.warmup_steps,
                                       ramp_steps=cfg.ramp_steps)
        if cfg.resolved_wire != "native":  # an encoded wire's coordinates for the bytes: the core's count (its test)
            density = cfg.schedule.density_at(target)
        scheduled = steps[target - 1][0]["mask"] if cfg.mask_delay else None  # already flushing: last choice
        for group in recs[0]["groups"]:
            state = steps[source][group.rank or 0]["after"]
            part = slice(group.start, group.start + group.size)
            m = state["m"][group.name][part]
            if cfg.resolved_score == "age_momentum":
                last = state["last_sync"].get(group.name)
                last = torch.full_like(m, source, dtype=torch.int64) if last is None else last[part]
                limit = reference.max_window(cfg.chunk_size, density, cfg.max_window)
                score = reference.age_momentum_score(m, last, target, limit)
            else:
                score = reference.momentum_residual_score(m, state["residual"][group.name][part], BETAS[0])
            picked = _inside(mask[group.name], group.start, group.size)
            excluded = None if scheduled is None else _inside(scheduled[group.name], group.start, group.size)
            k = reference.topk_count(group.size, density)
            rule = reference.groups_violation if cfg.selection == "groups" else reference.topk_violation
            violation = rule(score, picked, k, excluded)
            assert violation <= 1e-5, (f"{case}: mask of step {target}, {group}: not the {cfg.selection} picks "
                                       f"({k}) of the contract's score (violation {violation})")
        checked += 1
    assert checked >= 5


def test_ramp_densities_follow_the_contract(runs):
    cfg = ScapeConfig(**CASES["linear99_ramp"]["config"])
    seen = []
    for t, recs in enumerate(steps_of(runs, "linear99_ramp")):
        if recs[0]["mask"] is not None:
            numel = sum(g.size for g in recs[0]["groups"])
            want = sum(reference.topk_count(g.size, reference.density_at(
                t, sparsity=cfg.sparsity, warmup_steps=cfg.warmup_steps, ramp_steps=cfg.ramp_steps))
                for g in recs[0]["groups"])
            assert sum(i.numel() for i in recs[0]["mask"].values()) == want, f"step {t}"
            seen.append(round(want / numel, 3))
    assert seen[:3] == [seen[0]] * 3 and seen[0] > seen[3] > seen[6] > seen[9]  # 25%, 6.25%, 1.6%, then 1%


def test_shard_plans_of_the_ramps_past_densities_are_dropped(runs):
    cfg = ScapeConfig(**CASES["linear99_ramp_sharded"]["config"])
    assert len(cfg.schedule.densities()) == 4 and CASES["linear99_ramp_sharded"]["steps"] > 2 + 9  # past the ramp
    for r in runs:
        assert r["linear99_ramp_sharded"]["plans"] == [cfg.schedule.density]  # 25%, 6.25%, 1.6% built, then dropped
        assert r["linear99_ramp"]["plans"] == []  # replicated: no shard plans


@pytest.mark.parametrize("case", ["skips", "skips_sharded", slow("skips_compiled")])
def test_skipped_steps_change_nothing_and_lose_nothing(runs, case):
    steps = steps_of(runs, case)
    skip = CASES[case]["nonfinite_at"]
    for t in skip:  # every rank: the state after a skipped step is the state before it
        for rank, rec in enumerate(steps[t]):
            b, a = rec["before"], rec["after"]
            for name in b["param"]:
                where = f"skipped step {t} rank {rank} {name}"
                assert torch.equal(a["param"][name], b["param"][name]), f"{where}: parameter moved"
                assert torch.equal(a["m"][name], b["m"][name]), f"{where}: m moved"
                for key in ("sq", "last_sync"):
                    if name in b[key]:
                        assert torch.equal(a[key][name], b[key][name]), f"{where}: {key} moved"
                close(a["residual"][name], b["residual"][name], f"{where}: residual (this step's gradient "
                      "must be dropped, the sent values restored)")
    assert all(r[case]["skipped"] == len(skip) for r in runs)
    # conservation over the run: applied + mean residual = sum of the mean gradients of the applied steps
    names = steps[0][0]["before"]["param"]
    for name in names:
        applied = sum(recs[0]["synced"][name] for t, recs in enumerate(steps) if t not in skip)
        grads = sum(sum(r["grads"][name] for r in recs) / len(recs) for t, recs in enumerate(steps) if t not in skip)
        residual = sum(r["after"]["residual"][name] for r in steps[-1]) / len(steps[-1])
        close(applied + residual, grads, f"conservation of {name}", rtol=1e-5, atol=1e-5)
    assert any(r["after"]["residual"][n].abs().sum() > 0 for r in steps[-1] for n in names)  # really held back


@pytest.mark.parametrize("case", ["skip_one_bucket", "skip_one_bucket_compiled", "skip_one_bucket_int8",
                                  "inf_off_mask"])
def test_a_non_finite_gradient_anywhere_drops_the_whole_step_on_every_rank(runs, case):
    """At each poisoned step (one bucket of several, or one coordinate off the mask, on one rank) every rank
    skips, and the step is dropped whole, as a dense step or torch's GradScaler drops one: parameters, m and
    every rank's residual, in the poisoned bucket and in the clean ones, stay as before the step. Over the run
    applied + mean residual = the mean gradients of the steps that were not dropped."""
    steps = steps_of(runs, case)
    bad = sorted(CASES[case]["poison"])
    poisoned = next(names for names in runs[0][case]["buckets"] if "4.weight" in names)
    assert len(runs[0][case]["buckets"]) > 1 and len(poisoned) < len(steps[0][0]["before"]["param"])
    skipped = [r[case]["skipped"] for r in runs]
    assert skipped == [len(bad)] * len(runs), f"{case}: skipped steps per rank {skipped}, want {len(bad)}"
    for t in bad:
        for rank, rec in enumerate(steps[t]):
            for name in rec["before"]["param"]:
                where = f"{case} step {t} rank {rank} {name}"
                assert torch.equal(rec["after"]["param"][name], rec["before"]["param"][name]), where
                assert torch.equal(rec["after"]["m"][name], rec["before"]["m"][name]), where
                close(rec["after"]["residual"][name], rec["before"]["residual"][name], f"{where}: residual")
    for name in steps[0][0]["before"]["param"]:
        applied = sum(recs[0]["synced"][name] for t, recs in enumerate(steps) if t not in bad)
        grads = sum(sum(r["grads"][name] for r in recs) / len(recs) for t, recs in enumerate(steps) if t not in bad)
        residual = sum(r["after"]["residual"][name] for r in steps[-1]) / len(steps[-1])
        close(applied + residual, grads, f"{case}: conservation of {name}", rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["bf16", slow("bf16_compiled")])
def test_bf16_parameters_follow_the_contract_to_bf16_rounding(runs, case):
    steps = steps_of(runs, case)
    for t, recs in enumerate(steps):
        mask = recs[0]["mask"]
        assert all(torch.equal(a, b) for a, b in zip(recs[0]["after"]["param"].values(),
                                                     recs[1]["after"]["param"].values())), f"step {t}: replicas"
        want = reference.step([r["before"] for r in recs], [r["grads"] for r in recs], mask, rule="linear",
                              lr=recs[0]["lr"], beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD,
                              wire=torch.bfloat16)
        for rank, (rec, exp) in enumerate(zip(recs, want)):
            for name in exp["param"]:
                where = f"bf16 step {t} rank {rank} {name}"
                # stored in bf16 (8-bit mantissa), rounded after the decay and after the update: within
                # 2 ulps of the larger of theta before and after (a step across zero keeps the first's
                # ulp), plus 1 ulp of the step itself (it travels through the bf16 bucket, as the values do)
                got, ref, was = rec["after"]["param"][name], exp["param"][name], rec["before"]["param"][name]
                step = (ref - (1 - recs[0]["lr"] * WD) * was).abs()
                err = ((got - ref).abs() - 2 ** -7 * torch.maximum(was.abs(), ref.abs()) - 2 ** -8 * step).max()
                assert err <= 1e-7, f"{where} parameter: off by more than 2 bf16 ulps ({err})"
                close(rec["after"]["m"][name], exp["m"][name], f"{where} m", rtol=1e-4, atol=1e-6)
                close(rec["after"]["residual"][name], exp["residual"][name], f"{where} residual", rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("case", ["int8", "int4", "bfloat16_wire", "int4_compiled", "int4_groups"])
def test_encoded_wires_follow_the_contract(runs, case):
    """Each rank sends its values within half a step of its block's grid, the owner's mean is rounded
    once more, every rank keeps its own rounding (the owner also W times the second), conservation
    holds at every step, and the rule moves every replica alike from the delivered mean."""
    cfg = ScapeConfig(**CASES[case]["config"])
    skip = CASES[case].get("nonfinite_at", ())
    checked = 0
    for t, recs in enumerate(steps_of(runs, case)):
        for name in recs[0]["after"]["param"]:
            for key in ("param", "m"):
                assert torch.equal(recs[0]["after"][key][name], recs[1]["after"][key][name]), f"{case} step {t}: {key}"
        mask = recs[0]["mask"]
        if t in skip:  # a non-finite gradient on one rank: nothing moves, nothing is lost
            for rec in recs:
                for name in rec["before"]["param"]:
                    assert torch.equal(rec["after"]["param"][name], rec["before"]["param"][name])
                    close(rec["after"]["residual"][name], rec["before"]["residual"][name], f"{case} skipped step {t}")
            continue
        if mask is None:
            continue
        a = [{n: r["before"]["residual"][n] + r["grads"][n] for n in r["grads"]} for r in recs]
        synced = recs[0]["synced"]
        for buf in recs[0]["compact"]:
            mean, off, keep = reference.encoded_exchange([_at(a_r, buf) for a_r in a], buf.owner, buf.block, cfg.wire)
            got = _at(synced, buf)
            slack = 1e-6 * (1 + mean.abs())  # fp32 arithmetic
            assert ((got - mean).abs() <= off + slack).all(), f"{case} step {t}: delivered mean off its grid"
            kept = [_at(r["after"]["residual"], buf) for r in recs]
            for rank, k in enumerate(kept):
                assert (k.abs() <= keep[rank] + slack).all(), \
                    f"{case} step {t} rank {rank}: keeps more than its rounding"
            close(sum(kept) / len(kept) + got, mean, f"{case} step {t}: conservation on the mask", atol=1e-6)
        exchanged = {n: synced[n][mask[n]] for n in mask}
        want = reference.step([r["before"] for r in recs], [r["grads"] for r in recs], mask, rule=cfg.update,
                              lr=recs[0]["lr"], beta1=BETAS[0], beta2=BETAS[1], eps=EPS, weight_decay=WD,
                              exchanged=exchanged)
        for rank, (rec, exp) in enumerate(zip(recs, want)):
            for name in exp["param"]:
                where = f"{case} step {t} rank {rank} {name}"
                close(rec["after"]["param"][name], exp["param"][name], f"{where} parameter")
                close(rec["after"]["m"][name], exp["m"][name], f"{where} m")
                close(rec["after"]["sq"][name], exp["sq"][name], f"{where} sq")
                assert torch.equal(rec["after"]["last_sync"][name], exp["last_sync"][name]), f"{where} window"
                off_mask = torch.ones_like(exp["param"][name], dtype=torch.bool)
                off_mask[mask[name]] = False
                close(rec["after"]["residual"][name][off_mask], exp["residual"][name][off_mask], f"{where} residual")
        checked += 1
    assert checked >= 8


def _at(values: dict[str, torch.Tensor], buf: probe.Compact) -> torch.Tensor:
    """``values`` (per parameter name) at the positions of a compact buffer."""
    out = torch.empty(len(buf.names), dtype=torch.float64)
    for name in set(buf.names):
        pos = torch.tensor([i for i, n in enumerate(buf.names) if n == name])
        out[pos] = values[name][buf.index[pos]].double()
    return out


def _inside(indices: torch.Tensor, start: int, size: int) -> torch.Tensor:
    return indices[(indices >= start) & (indices < start + size)] - start


def _same_mask(a: dict | None, b: dict | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
