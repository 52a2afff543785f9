"""FSDP2 across two nodes: stock 2-D HSDP + AdamS against SCAPE on the replicate dimension (one rank's worker).

Started by ``benchmarks/multinode.py fsdp`` under torchrun on 2 namespace nodes x 2 ranks: the
mesh is ``(replicate, shard) = (2, 2)``, so the shard group is a node's 2 ranks (its loopback) and
the replicate group crosses the shaped veth. Methods, on copies of the same GPT and the same
per-rank batches, interleaved in rounds so that their ratios share the machine's noise:

    HSDP + AdamS   fully_shard on the 2-D mesh (FSDP2's own HSDP: reduce-scatter in the node,
                   all-reduce across nodes), scape_core.AdamS
    SCAPE 99%      scape_fsdp(sparsity=0.99): fully_shard on mesh["shard"], SCAPE across
                   "replicate" (the default wire at 99%: int4)
    SCAPE 90%      the same at 90% (the default wire there: native fp32)

Per timed step: the slowest rank's wall time, and the bytes each node's veth and loopback sent
(``/sys/class/net/<if>/statistics/tx_bytes``, read by the node's local rank 0 between barriers).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from benchmarks.bench_common import batches, count_params, end_rank, median, start_rank  # noqa: E402

METHODS = ("HSDP + AdamS", "SCAPE 99%", "SCAPE 90%")
BASELINE = "HSDP + AdamS"


def tx_bytes(interface: str) -> int:
    return int(Path(f"/sys/class/net/{interface}/statistics/tx_bytes").read_text())


def build(name: str, model: torch.nn.Module, mesh, args: argparse.Namespace):
    """The sharded model and its optimizer for method ``name``."""
    from torch.distributed.fsdp import fully_shard

    from scape_core import AdamS, scape_fsdp
    model = copy.deepcopy(model)
    if name == BASELINE:
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, AdamS(model.parameters(), lr=3e-4, weight_decay=0.1)
    sparsity = float(name.split()[1].rstrip("%")) / 100
    return scape_fsdp(model, mesh, sparsity=sparsity, lr=3e-4, weight_decay=0.1, shard_modules=model.blocks,
                      warmup_steps=args.scape_warmup, ramp_steps=0)


def worker(args: argparse.Namespace) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    rank, world, data, base = start_rank(args.params, args.context, args.layers)
    local = int(os.environ["LOCAL_RANK"])
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    mesh = init_device_mesh("cpu", (world // per_node, per_node), mesh_dim_names=("replicate", "shard"))
    methods = {name: build(name, base, mesh, args) for name in args.methods}
    stream = {name: batches(data, args.batch, args.context, seed=1000 * rank) for name in methods}  # same batches
    interfaces = ("lo", args.link)

    def step(name: str) -> None:
        model, opt = methods[name]
        x, y = next(stream[name])
        model(x, y).backward()
        opt.step()
        opt.zero_grad()

    for name in methods:
        for _ in range(args.warm):
            step(name)
    times = {name: [] for name in methods}
    sent = {name: [] for name in methods}  # per timed step: this node's (lo, link) bytes, local rank 0 only
    for _ in range(args.rounds):
        for name in methods:
            for _ in range(args.steps):
                dist.barrier()
                before = [tx_bytes(i) for i in interfaces] if local == 0 else [0, 0]
                start = time.perf_counter()
                step(name)
                times[name].append(time.perf_counter() - start)
                dist.barrier()
                after = [tx_bytes(i) for i in interfaces] if local == 0 else [0, 0]
                sent[name].append([a - b for a, b in zip(after, before)])
    every = [None] * world
    dist.all_gather_object(every, dict(times=times, sent=sent, local=local,
                                       stats={n: m[1].scape.stats() for n, m in methods.items() if n != BASELINE}))
    if rank == 0:
        out = {"params": count_params(base), "batch": args.batch, "context": args.context, "steps": args.steps,
               "rounds": args.rounds, "warm": args.warm, "mesh": [world // per_node, per_node], "methods": {}}
        for name in methods:
            slowest = [max(r["times"][name][i] for r in every) for i in range(len(times[name]))]
            nodes = [r["sent"][name] for r in every if r["local"] == 0]
            both = [[sum(node[i][k] for node in nodes) for k in (0, 1)] for i in range(len(slowest))]
            out["methods"][name] = {"step_s": slowest, "time_s": median(slowest),
                                    "veth_bytes": median([b[1] for b in both]),
                                    "lo_bytes": median([b[0] for b in both]),
                                    "scape_stats": every[0]["stats"].get(name)}
        base_t = out["methods"].get(BASELINE, {}).get("step_s")
        for name, m in out["methods"].items():
            if base_t:
                m["hsdp_over_this"] = median([b / t for b, t in zip(base_t, m["step_s"])])  # paired, per round
        Path(args.result).write_text(json.dumps(out, indent=1))


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--params", type=float, default=25e6)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--batch", type=int, default=1, help="per-rank batch (sequences)")
    p.add_argument("--steps", type=int, default=1, help="timed steps per method per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warm", type=int, default=3, help="untimed steps per method first")
    p.add_argument("--scape-warmup", type=int, default=2, help="SCAPE's dense warm-up (< --warm)")
    p.add_argument("--methods", default=",".join(METHODS))


def worker_argv(args: argparse.Namespace, link: str, result: str) -> list[str]:
    return [str(Path(__file__).resolve()), "--params", str(args.params), "--layers", str(args.layers),
            "--context", str(args.context), "--batch", str(args.batch), "--steps", str(args.steps),
            "--rounds", str(args.rounds), "--warm", str(args.warm), "--scape-warmup", str(args.scape_warmup),
            "--methods", ",".join(args.methods), "--link", link, "--result", result]


def table(report: dict) -> str:
    """Markdown: step time, paired speed against HSDP, bytes across the veth and inside the nodes."""
    rows = report["methods"]
    dense = rows.get(BASELINE, {}).get("veth_bytes")
    lines = ["| method | step (s, median) | HSDP / this (paired) | across the veth / step (both nodes) | "
             "% of HSDP's | inside the nodes (lo) / step |", "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        pct = f"{100 * r['veth_bytes'] / dense:.2f}%" if dense else "-"
        lines.append(f"| {name} | {r['time_s']:.3f} | {r.get('hsdp_over_this', float('nan')):.2f}x | "
                     f"{r['veth_bytes'] / 1e6:.2f} MB | {pct} | {r['lo_bytes'] / 1e6:.2f} MB |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_args(parser)
    parser.add_argument("--link", default="mn0")
    parser.add_argument("--result", required=True)
    ns = parser.parse_args()
    ns.methods = [m.strip() for m in ns.methods.split(",")]
    worker(ns)
    dist.barrier()
    end_rank()
