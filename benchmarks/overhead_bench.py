"""What SCAPE's own work costs per step, against a dense DDP step, on a ~10M-parameter GPT.

Two ranks (gloo, CPU, one thread each) on the host loopback train the same model with
dense DDP + AdamS and with SCAPE (90%, 99%), interleaved. SCAPE's pieces are timed with
``time.perf_counter`` by wrapping the core's functions (nothing in ``scape_core`` changes):

    hook        scape_hook's work on the backward: compact (gather g + residual on the mask),
                launch the all-reduce; plus finish (the residual update, the mean scattered
                back), which runs in gloo's callback thread
    selection   MaskSelector.choose: score and top-k (and, for scores that read the
                residual, launch the mask all-gather); plus finish_pending: wait for it.
                The top-k's C pick on the CPU scores inside it: its time is all "topk"
    optimizer   the update itself (ScapeAdamS._sparse, or AdamS.step for dense)
    wire        an encoded wire's passes (encode, the owner's mean, decode; inside the hook)

Overhead = hook + selection per step, as a fraction of the median dense DDP step (target
<= 10%). Medians over steps, in wall time and in CPU time of the thread that ran the piece
(``time.thread_time``: what the work costs whatever else the machine runs). ``--profile``
adds a torch.profiler table of two SCAPE 99% steps. ``--index-work`` profiles a few more steps
of each SCAPE method (torch.profiler, every thread) and reports the index work over the
entries: the self time of the index operators (gathers, scatters) per step, and the wire's passes.

    python benchmarks/overhead_bench.py                 # ~10M GPT, per-rank batch 2 x 256
    python benchmarks/overhead_bench.py --profile
    python benchmarks/overhead_bench.py --params 25e6 --batch 1 --context 128 --selections topk,groups --index-work
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import statistics
import sys
import tempfile
import time
import types
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.bench_common import (
    RESULTS,
    batches,
    core_version,
    count_params,
    end_rank,
    launch,
    machine,
    median,
    scape_fields,
    start_rank,
)
from scape_core.config import ScapeConfig
from scape_core.masks import SELECTIONS


class Timer:
    """Wall and CPU seconds (of the calling thread) in each named part during the current step."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)

    def wrap(self, owner: Any, attr: str, part: str) -> None:
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:  # one += per call: safe enough from gloo's callback thread
                self.wall[part] += time.perf_counter() - t0
                self.cpu[part] += time.thread_time() - c0
        setattr(owner, attr, timed)

    def take(self) -> tuple[dict[str, float], dict[str, float]]:
        out = dict(self.wall), dict(self.cpu)
        self.wall, self.cpu = defaultdict(float), defaultdict(float)
        return out


TIMER = Timer()


def instrument() -> None:
    """Wrap the core's pieces (module attributes, so the hook and the state call the wrappers)."""
    import scape_core.exchange as exchange
    import scape_core.masks as masks
    import scape_core.selection as selection
    import scape_core.state as state
    import scape_core.wire as wire
    from scape_core import AdamS, ScapeAdamS

    TIMER.wrap(exchange, "stage", "compact")  # eager kernels
    TIMER.wrap(exchange, "stage_compiled", "compact")  # compiled kernels
    TIMER.wrap(exchange, "finish", "finish")
    TIMER.wrap(exchange, "finish_compiled", "finish")
    for rule, fn in list(masks.SELECTIONS.items()):  # the row's picks (top-k or groups), inside MaskSelector.choose
        slot = types.SimpleNamespace(fn=fn)
        TIMER.wrap(slot, "fn", "topk")
        masks.SELECTIONS[rule] = slot.fn
    TIMER.wrap(selection, "select_age", "topk")  # the top-k's C pick on the CPU: its score is computed inside
    TIMER.wrap(selection.MaskSelector, "choose", "select")
    TIMER.wrap(selection.MaskSelector, "finish_pending", "mask_wait")
    TIMER.wrap(state.ScapeState, "end_step", "end_step")
    TIMER.wrap(ScapeAdamS, "_sparse", "optimizer")
    TIMER.wrap(AdamS, "step", "adams_step")  # ScapeAdamS overrides step: this is dense only
    TIMER.wrap(exchange.dist, "all_reduce", "allreduce_launch")
    for codec in (wire.WireBuffers, wire.CompiledWire):  # an encoded wire's stages (eager or compiled)
        for attr in ("send", "own_mean", "decode_gathered"):
            TIMER.wrap(codec, attr, "wire")
    TIMER.wrap(selection, "all_gather_into_tensor", "gather_launch")  # inside choose (scores read per rank)


def build(name: str, base: torch.nn.Module, warmup: int, mask_refresh: int, kernels: str = "eager") -> tuple[Any, Any]:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from scape_core import AdamS, ScapeAdamS, ScapeState, scape_hook

    hp = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    ddp = DDP(copy.deepcopy(base))
    if name == "DDP + AdamS":
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        return ddp, AdamS(ddp.parameters(), kernels=kernels, **hp)
    fields = {**scape_fields(warmup), "kernels": kernels}
    if " fp32" in name:  # the native wire (the default at 99% is int4 where the core has wires)
        fields["wire"] = "native"
    if name.split()[-1] in SELECTIONS:  # a name ending in "topk" / "groups": that ScapeConfig.selection
        fields["selection"] = name.split()[-1]
    state = ScapeState(ddp, sparsity=float(name.split()[1].rstrip("%")) / 100, mask_refresh=mask_refresh, **fields)
    ddp.register_comm_hook(state, scape_hook)
    return ddp, ScapeAdamS(ddp.parameters(), state, **hp)


def step(model: Any, opt: Any, x: torch.Tensor, y: torch.Tensor) -> dict[str, dict[str, float]]:
    """One training step; its parts' wall and CPU seconds, derived into the report's components."""
    TIMER.take()
    t0, c0 = time.perf_counter(), time.thread_time()
    model(x, y).backward()
    t1, c1 = time.perf_counter(), time.thread_time()
    opt.step()
    opt.zero_grad(set_to_none=True)
    t2, c2 = time.perf_counter(), time.thread_time()
    wall, cpu = TIMER.take()
    wall.update(step=t2 - t0, forward_backward=t1 - t0, opt_step=t2 - t1)
    cpu.update(step=c2 - c0, forward_backward=c1 - c0, opt_step=c2 - c1)
    return {"wall": derive(wall), "cpu": derive(cpu)}


def derive(p: dict[str, float]) -> dict[str, float]:
    """Raw wrapper times -> the report's components (nested wrappers subtracted once)."""
    hook = p.get("compact", 0) + p.get("allreduce_launch", 0) + p.get("finish", 0)
    selection = p.get("select", 0) + p.get("mask_wait", 0)
    optimizer = p.get("optimizer", 0) + p.get("adams_step", 0)
    return dict(step=p["step"], forward_backward=p["forward_backward"], opt_step=p["opt_step"],
                compact=p.get("compact", 0), allreduce_launch=p.get("allreduce_launch", 0), finish=p.get("finish", 0),
                hook=hook, score=p.get("select", 0) - p.get("topk", 0) - p.get("gather_launch", 0),
                topk=p.get("topk", 0), gather_launch=p.get("gather_launch", 0), mask_wait=p.get("mask_wait", 0),
                selection=selection, end_step_other=p.get("end_step", 0) - selection, optimizer=optimizer,
                wire=p.get("wire", 0), overhead=hook + selection)


def worker(args: argparse.Namespace) -> None:
    rank, _, data, base = start_rank(args.params, args.context, args.layers)
    names = ["DDP + AdamS"] + [n + ("" if rule == ScapeConfig.selection else f" {rule}")
                               for rule in args.selections.split(",")
                               for n in ("SCAPE 90%", "SCAPE 99%", "SCAPE 99% fp32")]
    runs = {n: build(n, base, args.scape_warmup, args.mask_refresh, args.kernels) for n in names}
    data_of = {n: batches(data, args.batch, args.context, seed=1000 * rank) for n in names}
    instrument()
    for n in names:
        for _ in range(args.warm):
            step(*runs[n], *next(data_of[n]))
    rows: dict[str, list[dict[str, float]]] = defaultdict(list)
    for r in range(args.rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            for _ in range(args.steps):
                rows[n].append(step(*runs[n], *next(data_of[n])))
    indexed = {}
    if args.index_work:
        for n in names:
            if n.startswith("SCAPE"):
                dist.barrier()
                indexed[n] = index_work(*runs[n], data_of[n], args.index_steps)
    table = None
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        model, opt = runs["SCAPE 99%"]
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(2):
                step(model, opt, *next(data_of["SCAPE 99%"]))
        table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dict(rows))
    indexed_all: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(indexed_all, indexed)
    compiles = {n: (opt.scape.kernels if hasattr(opt, "scape") else opt.kernels).compile_seconds
                for n, (_, opt) in runs.items()}  # the first calls of each compiled pass (in the warm steps)
    if rank == 0:
        out = {"params": count_params(base), "per_rank": gathered, "profile": table, "kernels": args.kernels,
               "compile_seconds": compiles, "index_work": indexed_all}
        Path(args.result).write_text(json.dumps(out))
    dist.destroy_process_group()


COMPONENTS = ("step", "forward_backward", "opt_step", "hook", "compact", "allreduce_launch", "finish", "wire",
              "selection", "score", "topk", "gather_launch", "mask_wait", "end_step_other", "optimizer", "overhead")
# the index operators: what "index work over the entries" counts (--index-work)
INDEX_OPS = {"index_select", "index_copy_", "index_add_", "index_put_", "_index_put_impl_", "index", "gather",
             "scatter_", "scatter_add_", "take", "put_", "index_fill_"}


def index_work(model: Any, opt: Any, data: Any, steps: int) -> dict[str, float]:
    """The median over ``steps`` steps, each profiled alone (every thread: gloo's callbacks too), of the
    self CPU ms of the index operators, and of the wire's passes (timed as the ``wire`` component)."""
    from torch.profiler import ProfilerActivity, profile

    ops, wire = [], []
    for _ in range(steps):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            wire.append(1000 * step(model, opt, *next(data))["cpu"]["wire"])
        ops.append(sum(e.self_cpu_time_total for e in prof.key_averages()
                       if e.key.removeprefix("aten::") in INDEX_OPS) / 1000)
    return {"index_ops": median(ops), "wire": median(wire)}


def report(res: dict[str, Any], args: argparse.Namespace) -> str:
    """Median wall and CPU milliseconds per component and method, and the overhead target."""
    names = list(res["per_rank"][0])
    med = {clock: {n: {c: median([r[clock][c] for rank in res["per_rank"] for r in rank[n]]) for c in COMPONENTS}
                   for n in names} for clock in ("wall", "cpu")}
    lines = [f"GPT {res['params'] / 1e6:.1f}M parameters, 2 ranks (gloo, 1 thread each), per-rank batch "
             f"{args.batch} x {args.context} tokens, mask_refresh={args.mask_refresh}; medians over "
             f"{args.rounds * args.steps} steps x 2 ranks, in ms (wall / CPU of the thread that ran it)\n",
             "| component | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for c in COMPONENTS:
        lines.append(f"| {c} | " + " | ".join(
            f"{1000 * med['wall'][n][c]:.1f} / {1000 * med['cpu'][n][c]:.1f}" for n in names) + " |")
    for clock in ("wall", "cpu"):
        dense = med[clock]["DDP + AdamS"]["step"]
        lines.append(f"| overhead / dense step ({clock}) | " + " | ".join(
            f"{100 * med[clock][n]['overhead'] / dense:.1f}%" for n in names) + " |")
        lines.append(f"| step / dense step ({clock}) | " + " | ".join(
            f"{med[clock][n]['step'] / dense:.2f}x" for n in names) + " |")
    # with mask_refresh > 1 most steps select nothing: the mean is the cost per step, the median is not
    stat, avg = ("median", median) if args.mask_refresh == 1 else ("mean", statistics.mean)
    for n in names:
        if n.startswith("SCAPE"):
            for clock in ("wall", "cpu"):
                dense = med[clock]["DDP + AdamS"]["step"]
                cost = avg([r[clock]["overhead"] for rank in res["per_rank"] for r in rank[n]])
                pct = 100 * cost / dense
                lines.append(f"\n{n} ({clock}): hook + selection = {1000 * cost:.1f} ms ({stat} per step) = "
                             f"{pct:.1f}% of the median dense step ({1000 * dense:.0f} ms) -> target <= 10%: "
                             f"{'MET' if pct <= 10 else 'NOT MET'}")
    if any(res.get("index_work") or []):
        lines += ["", index_report(res["index_work"], args.index_steps)]
    if res.get("compile_seconds"):
        firsts = [f"{n}: " + ", ".join(f"{k} {v:.1f}" for k, v in c.items()) + f" (total {sum(c.values()):.1f})"
                  for n, c in res["compile_seconds"].items() if c]
        lines.append(f"\nkernels={res.get('kernels', 'eager')}; first calls of the compiled passes (rank 0, s): "
                     + "; ".join(firsts))
    return "\n".join(lines)


def index_report(per_rank: list[dict[str, dict[str, float]]], steps: int) -> str:
    """The index work per SCAPE method (mean of the ranks), and against the same method with ``topk``."""
    names = list(per_rank[0])
    mean = {n: {k: sum(r[n][k] for r in per_rank) / len(per_rank) for k in ("index_ops", "wire")} for n in names}
    lines = [f"Index work over the entries (torch.profiler, median of {steps} steps per method, every thread, mean "
             "of the ranks; CPU ms per step): the index operators' self time, and the wire's passes",
             "", "| method | index operators | wire passes | both | both / the same method with topk |",
             "|---|---|---|---|---|"]
    for n in names:
        both = mean[n]["index_ops"] + mean[n]["wire"]
        base = None if n.endswith(" topk") else n.removesuffix(" groups") + " topk"
        ratio = ""
        if base in mean:
            ratio = f"{both / (mean[base]['index_ops'] + mean[base]['wire']):.2f}x"
        lines.append(f"| {n} | {mean[n]['index_ops']:.1f} | {mean[n]['wire']:.1f} | {both:.1f} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", type=float, default=10e6)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--batch", type=int, default=2, help="per-rank sequences")
    p.add_argument("--steps", type=int, default=3, help="timed steps per method per window")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--warm", type=int, default=4)
    p.add_argument("--scape-warmup", type=int, default=2)
    p.add_argument("--mask-refresh", type=int, default=1, help="ScapeConfig.mask_refresh (steps per new mask)")
    p.add_argument("--kernels", default="eager", choices=("eager", "compiled"),
                   help="ScapeConfig.kernels (and AdamS's) for every method; the warm steps include the compiles")
    p.add_argument("--selections", default=ScapeConfig.selection,
                   help="ScapeConfig.selection of the SCAPE methods, e.g. topk,groups")
    p.add_argument("--profile", action="store_true", help="also profile two SCAPE 99%% steps (torch.profiler)")
    p.add_argument("--index-work", action="store_true",
                   help="also profile --index-steps steps of each SCAPE method: the index operators and the wire")
    p.add_argument("--index-steps", type=int, default=7)
    p.add_argument("--timeout", type=float, default=420)
    p.add_argument("--json", default=str(RESULTS / "overhead_bench.json"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        end_rank()
    argv = [str(Path(__file__).resolve()), "--worker"] + [
        f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
        if k not in ("worker", "result", "json", "profile", "timeout", "index_work")] + (
        ["--profile"] if args.profile else []) + (["--index-work"] if args.index_work else [])
    t0, load = time.time(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        try:
            launch(argv + ["--result", str(result)], 2, args.timeout)
        except (RuntimeError, TimeoutError) as e:  # one line, not a traceback
            sys.exit(f"overhead_bench STOPPED: {e} (--timeout for a longer limit, --selections to run fewer)")
        res = json.loads(result.read_text())
    res["loadavg"] = [round(load, 2), round(os.getloadavg()[0], 2)]
    text = report(res, args) + f"\n\nload average (1 min) before/after: {res['loadavg']} on {machine()['nproc']} CPUs"
    print(text)
    if res["profile"]:
        print("\ntorch.profiler, 2 SCAPE 99% steps on rank 0, by self CPU time:\n" + res["profile"])
    summary = {"command": " ".join(["python", "benchmarks/overhead_bench.py"] + sys.argv[1:]), "machine": machine(),
               "core": core_version(),
               "seconds": round(time.time() - t0), "report": text, "raw": res}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(summary, indent=1))
    print(f"\n{time.time() - t0:.0f}s; machine {machine()}; {core_version()}; wrote {args.json}")


if __name__ == "__main__":
    main()
