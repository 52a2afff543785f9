"""How many operators SCAPE adds to a sparse step, and whether that depends on the tensors or the buckets.

On a GPU each operator a step dispatches costs host time (a launch, or at least a dispatch), so a
step whose operator count grows with the number of parameter tensors or DDP buckets is host-bound
at GPT-2's 148 tensors (``docs/benchmarks.md``). This counts, machine-independently, with a
``TorchDispatchMode`` on the CPU (world size 1, gloo, bf16 autocast, collectives waited where they
are issued so the hook's callback is counted too; :mod:`benchmarks.traffic_bench`):

- ``operators``: every aten operator dispatched (views included: each costs the host a dispatch);
- ``kernels``: those that are not views or allocations (each one launch on a GPU, at least).

A method's *added* count is its step minus a forward + backward under DDP's own all-reduce with
no optimizer (what replacing DDP's all-reduce and an optimizer by the method costs; fused AdamW
adds 2). DDP's all-reduce is two operators per bucket and a sparse SCAPE step none, so the added
count falls a little as the buckets grow; *own* counts the operators issued from ``scape_core``'s
code (the hook, the optimizer, the selection, the wire), whatever the baseline. Cases: GPT-2
small's structure (12 layers, 148 tensors) at a small width with 13 DDP buckets; the same with
twice the tensors (24 layers, 292); 1 and 19 buckets.

    python benchmarks/op_count.py                     # every case, SCAPE 99% default and fused AdamW, ~1 min
    python benchmarks/op_count.py --cases 148x13 --methods "SCAPE 99% default"
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.bench_common import GPT, RESULTS, core_version, machine  # noqa: E402
from benchmarks.traffic_bench import TrafficCounter, init_single_rank, synchronous_collectives  # noqa: E402

# name: (layers, DDP buckets)
CASES = {"148x13": (12, 13), "292x13": (24, 13), "148x1": (12, 1), "148x19": (12, 19)}
METHODS = {  # name: ScapeConfig fields (None: not SCAPE)
    "DDP + AdamW fused": None,
    "SCAPE 99% default": {},
    "SCAPE 99% groups": {"selection": "groups"},
    "SCAPE 99% native": {"wire": "native"},
    "SCAPE 90%": {"sparsity": 0.9},
    "SCAPE 99% sharded": {"shard_optimizer": True},
}
WIDTH, VOCAB, CONTEXT, BATCH = 64, 256, 32, 2
WARM = 5  # steps before the counted one: 2 dense, then sparse


def model(layers: int) -> GPT:
    torch.manual_seed(0)
    return GPT(VOCAB, WIDTH, layers, heads=2, context=CONTEXT)


def bucket_cap_mb(base: torch.nn.Module, buckets: int) -> float:
    """A ``bucket_cap_mb`` that gives ``buckets`` DDP buckets after DDP's rebuild (searched: DDP cuts at
    parameter boundaries)."""
    total = sum(p.numel() * p.element_size() for p in base.parameters())
    if buckets == 1:
        return 2 * total / 2 ** 20
    lo, hi = total / 2 ** 20 / (4 * buckets), 4 * total / 2 ** 20 / buckets
    for _ in range(40):
        cap = (lo + hi) / 2
        found = count_buckets(base, cap)
        if found == buckets:
            return cap
        lo, hi = (cap, hi) if found > buckets else (lo, cap)
    raise RuntimeError(f"no bucket_cap_mb gives {buckets} buckets")


def count_buckets(base: torch.nn.Module, cap: float) -> int:
    ddp = DDP(copy.deepcopy(base), bucket_cap_mb=cap)
    calls = []
    ddp.register_comm_hook(None, lambda _, bucket: calls.append(1) or _done(bucket.buffer()))
    x = torch.randint(VOCAB, (BATCH, CONTEXT))
    for _ in range(2):  # DDP rebuilds its buckets after the first iteration
        calls.clear()
        ddp(x, x).backward()
    return len(calls)


def _done(t: torch.Tensor) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(t)
    return fut


def build(method: str, base: torch.nn.Module, cap: float) -> tuple[DDP, torch.optim.Optimizer | None, Any]:
    from scape_core import ScapeAdamS, ScapeState, scape_hook

    ddp = DDP(copy.deepcopy(base), bucket_cap_mb=cap)
    hp = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    if method == "baseline":
        return ddp, None, None
    fields = METHODS[method]
    if fields is None:
        return ddp, torch.optim.AdamW(ddp.parameters(), fused=True, **hp), None
    state = ScapeState(ddp, **{"sparsity": 0.99, "warmup_steps": 2, "ramp_steps": 0, **fields})
    state.selector.block_rows = state.layout.rows  # a GPU's selection: the whole layout at once (the CPU's blocks
    ddp.register_comm_hook(state, scape_hook)      # of 2^20 values each add the same operators again)
    return ddp, ScapeAdamS(ddp.parameters(), state, **hp), state


class OwnOperators(TrafficCounter):
    """A :class:`~benchmarks.traffic_bench.TrafficCounter` that also counts, views included, the operators
    issued from ``scape_core``'s code (its innermost caller there)."""

    def __init__(self) -> None:
        super().__init__(sites="scape_core")
        self.own = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func.namespace != "profiler" and self._site() != "outside":
            self.own += 1
        return super().__torch_dispatch__(func, types, args, kwargs)


def count(method: str, base: torch.nn.Module, cap: float) -> dict[str, Any]:
    ddp, opt, state = build(method, base, cap)
    g = torch.Generator().manual_seed(0)

    def step() -> None:
        x = torch.randint(VOCAB, (BATCH, CONTEXT), generator=g)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = ddp(x, x)
        loss.backward()
        if opt is not None:
            opt.step()
        ddp.zero_grad(set_to_none=True)

    with synchronous_collectives():
        for _ in range(WARM):
            step()
        counter = OwnOperators()
        with counter:
            step()
    totals = counter.totals()
    row = {"operators": totals["operators"] + totals["views"], "kernels": totals["operators"], "own": counter.own,
           "host_reads": totals["host_reads"], "by_op": totals["by_op"]}
    if state is not None:
        state.wait()
        row["sparse"] = not state.is_dense(state.step - 1) and not state.stats()["skipped_steps"]
    return row


def run(cases: list[str], methods: list[str]) -> dict[str, Any]:
    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    for case in cases:
        layers, buckets = CASES[case]
        base = model(layers)
        cap = bucket_cap_mb(base, buckets)
        baseline = count("baseline", base, cap)
        rows = {"tensors": len(list(base.parameters())), "buckets": count_buckets(base, cap),
                "params": sum(p.numel() for p in base.parameters()), "baseline": baseline, "methods": {}}
        for method in methods:
            row = count(method, base, cap)
            row["added_operators"] = row["operators"] - baseline["operators"]
            row["added_kernels"] = row["kernels"] - baseline["kernels"]
            rows["methods"][method] = row
            print(f"{case}: {method}: +{row['added_operators']} operators, +{row['added_kernels']} kernels, "
                  f"{row['own']} its own", flush=True)
        out[case] = rows
    return out


def report(res: dict[str, Any]) -> str:
    methods = list(next(iter(res.values()))["methods"])
    lines = [f"Operators added to one step (a forward + backward under DDP's all-reduce subtracted; kernels: not "
             f"views or allocations; own: issued by scape_core), GPT of width {WIDTH}, bf16 autocast, world size 1\n",
             "| method | " + " | ".join(f"{r['tensors']} tensors, {r['buckets']} buckets" for r in res.values())
             + " |", "|---|" + "---|" * len(res)]
    for m in methods:
        cells = []
        for r in res.values():
            row = r["methods"][m]
            flag = "" if row.get("sparse", True) else " (NOT sparse)"
            cells.append(f"{row['added_operators']} ({row['added_kernels']} kernels; own {row['own']}){flag}")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--methods", nargs="+", default=["DDP + AdamW fused", "SCAPE 99% default"],
                   choices=list(METHODS))
    p.add_argument("--out", type=Path, default=RESULTS / "op_count.json")
    args = p.parse_args(argv)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        init_single_rank(tmp)
        try:
            res = run(args.cases, args.methods)
        finally:
            dist.destroy_process_group()
    text = report(res)
    print(text)
    given = sys.argv[1:] if argv is None else argv
    summary = {"command": " ".join(["python", "benchmarks/op_count.py"] + given), "machine": machine(),
               "core": core_version(), "seconds": round(time.time() - t0, 1), "report": text, "cases": res}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1))
    print(f"\n{summary['seconds']}s; {core_version()}; wrote {args.out}")
    return summary


if __name__ == "__main__":
    main()
