"""Optimizer + SCAPE state per rank, from the tensors allocated; bytes per sparse step, sharded or not.

Every method trains the same GPT (``bench_common.GPT``, ~25M parameters) for a few steps on W
gloo ranks (CPU, one thread each): AdamW, AdamS, torch's ZeroRedundancyOptimizer + AdamW, SCAPE
and sharded SCAPE (99%, one dense step, then sparse). Then every tensor reachable from the
optimizer and from SCAPE's state is counted once per storage (parameters, their gradients and
DDP's buckets excluded) and divided by the number of parameters: bytes per parameter per rank,
with the named buffers (m, sq, windows, residual; the scratch: the CPU's score workspace and the eager
step's staging buffer, which hold nothing between steps and are not counted as state) and the rest
(masks, index tensors). SCAPE's counters give the bytes each rank hands to collectives per sparse step,
by collective; the wire column is a ring's (all-reduce ``2 (W - 1) / W`` of what each rank
hands, all-gather ``W - 1`` times).

    python benchmarks/memory_bench.py                         # W = 2 and 4, ~25M GPT (a few minutes)
    python benchmarks/memory_bench.py --params 1e6 --worlds 2 --json /tmp/m.json   # smoke test
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from torch import nn

from benchmarks.bench_common import RESULTS, batches, core_version, count_params, end_rank, launch, machine, start_rank

METHODS = ("AdamW", "AdamS", "ZeRO + AdamW", "SCAPE 99%", "SCAPE 99% sharded")
STEPS = 6  # SCAPE: 1 dense, the ramp's 3 stages (25%, 6.25%, 1.6%: a step each), 2 at 1% (counted for bytes)
RAMP_STEPS = 3


def held_storages(roots: Iterable[Any], exclude: set[int]) -> dict[int, int]:
    """``{storage address: bytes}`` of every tensor reachable from ``roots`` through attributes,
    dicts, lists and tuples (modules and storages in ``exclude`` are not followed or counted)."""
    seen: set[int] = set()
    out: dict[int, int] = {}
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (nn.Module, type, str, bytes, int, float, bool)) or obj is None:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            if storage.data_ptr() not in exclude and storage.nbytes():
                out[storage.data_ptr()] = storage.nbytes()
        elif isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return out


def storage_of(t: torch.Tensor | None) -> list[int]:
    return [] if t is None else [t.untyped_storage().data_ptr()]


def build(name: str, base: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    from scape_core import AdamS, ScapeAdamS, ScapeState, scape_hook

    hp = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    ddp = DDP(copy.deepcopy(base))
    if name == "AdamW":
        return ddp, torch.optim.AdamW(ddp.parameters(), **hp), None
    if name == "AdamS":
        return ddp, AdamS(ddp.parameters(), **hp), None
    if name == "ZeRO + AdamW":
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **hp), None
    # wire="native" in both modes (what "auto" is when sharded): the same masks and bytes to compare
    state = ScapeState(ddp, sparsity=0.99, warmup_steps=1, ramp_steps=RAMP_STEPS, wire="native",
                       shard_optimizer=name.endswith("sharded"))
    ddp.register_comm_hook(state, scape_hook)
    return ddp, ScapeAdamS(ddp.parameters(), state, **hp), state


def held_now(ddp: nn.Module, opt: torch.optim.Optimizer, state: Any) -> dict[int, int]:
    """What the optimizer and SCAPE's state hold now (parameters, gradients and DDP's buckets aside)."""
    exclude = {ptr for p in ddp.module.parameters() for ptr in storage_of(p) + storage_of(p.grad)}
    if state is not None:
        exclude |= {ptr for v in state.buckets.views.values() for ptr in storage_of(v)}  # DDP's buckets
    return held_storages([opt, state], exclude)


def measure(name: str, base: nn.Module, data: Any) -> dict[str, Any]:
    ddp, opt, state = build(name, base)
    counted, peak = [], 0
    for step in range(STEPS):
        if step in (1, STEPS - 2) and state is not None:  # after the dense step; before the last 2 sparse ones
            counted.append(dict(state.comm.counters))
        x, y = next(data)
        ddp(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        peak = max(peak, sum(held_now(ddp, opt, state).values()))  # between steps (the ramp's denser masks)
    if state is not None:
        state.wait()
    held = held_now(ddp, opt, state)
    n = count_params(ddp.module)
    row: dict[str, Any] = {"params": n, "total": sum(held.values()) / n, "peak": peak / n}
    if state is not None:
        named = {"m": opt.momentum_buffer, **opt.statistics, "windows": state.buffers.windows,
                 "residual": state.buffers.residual, "score workspace": state.selector.scratch,
                 "overdue workspace": state.selector.late_scratch, "staging": state.buffers.staging_buffer}
        for key, t in named.items():
            row[key] = held.pop(t.untyped_storage().data_ptr(), 0) / n if t is not None else 0.0
        row["other"] = sum(held.values()) / n
        scratch = row["score workspace"] + row["overdue workspace"] + row["staging"]  # holds nothing between steps
        row["state"] = row["total"] - scratch
        row["bytes_dense_step"] = {k: counted[0][k] for k in ("bytes_sent", "shard_bytes", "mask_bytes", "dense_bytes")}
        after, before = state.comm.counters, counted[1]
        sparse_steps = 2
        per_step = {k: (after[k] - before[k]) / sparse_steps for k in ("bytes_sent", "mask_bytes", "shard_bytes",
                                                                      "dense_bytes")}
        per_step["all_reduce"] = per_step["bytes_sent"] - per_step["mask_bytes"] - per_step["shard_bytes"]
        w = state.comm.world_size
        per_step["wire"] = 2 * (w - 1) / w * per_step["all_reduce"] + (w - 1) * (per_step["mask_bytes"]
                                                                               + per_step["shard_bytes"])
        row["bytes_per_sparse_step"] = per_step
    else:
        row["state"] = row["total"]
    return row


def worker(args: argparse.Namespace) -> None:
    rank, world, text, base = start_rank(args.params, args.context, args.layers)
    out = {}
    for name in args.methods:
        out[name] = measure(name, base, batches(text, 1, args.context, seed=rank))
    rows: list[Any] = [None] * world
    dist.all_gather_object(rows, out)
    if rank == 0:
        Path(args.result).write_text(json.dumps({"world_size": world, "ranks": rows}))
    dist.destroy_process_group()


def table(results: dict[str, Any]) -> str:
    """Markdown: bytes per parameter per rank (the largest over ranks) per method and world size."""
    worlds = sorted(results, key=int)
    keys = ("m", "sq", "windows", "residual", "other", "score workspace", "overdue workspace", "staging", "total",
            "peak")
    lines = ["| method | W | state B/param (max over ranks) | target | " + " | ".join(keys) + " |",
             "|---|---|---|---|" + "---|" * len(keys)]
    for name in METHODS:
        for w in worlds:
            ranks = [r[name] for r in results[w]["ranks"] if name in r]
            if not ranks:
                continue
            worst = max(ranks, key=lambda r: r["state"])
            target = f"{4 + 12 / int(w):.2f}" if name.endswith("sharded") else ""
            parts = " | ".join(f"{worst[k]:.3f}" if k in worst else "" for k in keys)
            lines.append(f"| {name} | {w} | {worst['state']:.3f} | {target} | {parts} |")
    return "\n".join(lines)


def bytes_table(results: dict[str, Any]) -> str:
    """Markdown: bytes per sparse step per rank, by collective, sharded against replicated SCAPE."""
    lines = ["| method | W | all-reduce (values) | all-gather u | all-gather masks | handed, total | "
             "x replicated | ring wire / rank | x replicated |", "|---|---|---|---|---|---|---|---|---|"]
    for w in sorted(results, key=int):
        base = results[w]["ranks"][0].get("SCAPE 99%", {}).get("bytes_per_sparse_step")
        for name in ("SCAPE 99%", "SCAPE 99% sharded"):
            row = results[w]["ranks"][0].get(name)
            if row is None:
                continue
            b = row["bytes_per_sparse_step"]
            handed = b["bytes_sent"] / base["bytes_sent"] if base else float("nan")
            wire = b["wire"] / base["wire"] if base else float("nan")
            lines.append(f"| {name} | {w} | {b['all_reduce']:,.0f} | {b['shard_bytes']:,.0f} | "
                         f"{b['mask_bytes']:,.0f} | "
                         f"{b['bytes_sent']:,.0f} | {handed:.3f} | {b['wire']:,.0f} | {wire:.3f} |")
    lines += ["", "| method | W | dense step: all-reduce | all-gather parameters | x DDP handed | x DDP ring wire |",
              "|---|---|---|---|---|---|"]
    for w in sorted(results, key=int):
        for name in ("SCAPE 99%", "SCAPE 99% sharded"):
            row = results[w]["ranks"][0].get(name)
            if row is None:
                continue
            d, n = row["bytes_dense_step"], int(w)
            reduced = d["bytes_sent"] - d["shard_bytes"] - d["mask_bytes"]  # the first mask's all-gather aside
            ring = (2 * (n - 1) / n * reduced + (n - 1) * d["shard_bytes"]) / (2 * (n - 1) / n * d["dense_bytes"])
            lines.append(f"| {name} | {w} | {reduced:,.0f} | {d['shard_bytes']:,.0f} | "
                         f"{(reduced + d['shard_bytes']) / d['dense_bytes']:.3f} | {ring:.3f} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=25e6)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--worlds", default="2,4")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--json", default=str(RESULTS / "memory_bench.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.methods = [m.strip() for m in args.methods.split(",")]
    if args.worker:
        worker(args)
        end_rank()
    t0 = time.time()
    results = {}
    for w in [int(x) for x in args.worlds.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "r.json"
            argv = [str(Path(__file__).resolve()), "--worker", "--params", str(args.params), "--layers",
                    str(args.layers), "--context", str(args.context), "--methods", ",".join(args.methods),
                    "--result", str(result)]
            print(f"[{time.time() - t0:4.0f}s] W = {w}: {args.methods}", flush=True)
            try:
                launch(argv, w, args.timeout)
            except (RuntimeError, TimeoutError) as e:  # one line, not a traceback
                sys.exit(f"memory_bench STOPPED: {e} (--timeout for a longer limit, --methods to run fewer)")
            results[str(w)] = json.loads(result.read_text())
    params = results[next(iter(results))]["ranks"][0][args.methods[0]]["params"]
    report = {"command": " ".join(["python", "benchmarks/memory_bench.py"] + sys.argv[1:]), "machine": machine(),
              "core": core_version(), "params": params, "results": results}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"\nGPT {params / 1e6:.1f}M parameters; {time.time() - t0:.0f}s; {core_version()}\n")
    print(table(results))
    print()
    print(bytes_table(results))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
