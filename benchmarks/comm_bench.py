"""What goes over the wire per optimizer step, and what it costs on a fast and a slow link.

Methods, all on the same GPT, initial weights and per-rank batches, interleaved in one run so
their ratios share the machine's noise (the default runs the five of README's table, marked *;
``--methods all`` runs every one, the compiled ones compiling for minutes first):

    no-comm + AdamS *   the same per-rank step with no collective at all (the bound)
    DDP + AdamW *       dense all-reduce (torch's allreduce_hook, counted)
    DDP + AdamS         the same, with SCAPE's base optimizer
    PowerSGD r4 + AdamW torch's powerSGD_hook, rank 4, error feedback, warm start, one DDP
                        bucket (its chained collectives race across buckets on gloo)
    SCAPE 90% / 99% *   scape_hook + ScapeAdamS (99%: the examples' default, int4 values)
    SCAPE 99% native *  the same with fp32 values on the wire (``wire="native"``)
    SCAPE 99% sharded   the same with shard_optimizer=True (each rank keeps 1/W of the optimizer
                        state; owners' updates and masks are all-gathered)
    ... compiled        ``kernels="compiled"`` (SCAPE) / ``AdamS(kernels="compiled")`` (the bound)

Per step: median wall time (slowest rank) and, because the machine may be shared, the
median of per-round ratios against the bound and against dense DDP (the i-th timed step of
every method ran in the same round); the main thread's CPU seconds (insensitive to load);
bytes per step, counted one way for every method: what one rank hands to collectives, as
``ScapeState.stats()`` counts it (an all-reduce by its input; an encoded wire's all-to-all and
all-gather as the one all-reduce of the encoded buffer, whose traffic they equal) -- SCAPE's
counters for SCAPE, for the others a wrapper around every torch.distributed collective (it also
checks SCAPE's: equal on the native wire, ``(W + 1) / W`` of it on an encoded one, which hands
the whole buffer to the all-to-all and a segment to the all-gather: ``handed_bytes``); and the
bytes that crossed the loopback interface (both ranks together, ``/sys/class/net/lo/statistics``),
which measure the same share.

Links: ``loopback`` (unshaped) and ``slow`` (``tc tbf`` at ``--gbit`` per rank per direction).
Both run inside a network namespace created here (root only), so the interface counters see
only this benchmark; every process talks to 127.0.0.1 only, and the namespace is removed at
the end. Without root (or ``ip``/``tc``), only the unshaped link runs, on the host's loopback,
and the interface column is marked as shared with whatever else uses it.

    sudo python benchmarks/comm_bench.py --links slow --batches 1 --rounds 6   # README's table (minutes)
    sudo python benchmarks/comm_bench.py                      # ~25M GPT, both links, per-rank batch 1 and 4
    sudo python benchmarks/comm_bench.py --methods all --timeout 2400   # every method, compiled ones too
    python benchmarks/comm_bench.py --params 5e6 --steps 2 --rounds 1   # smoke test

While it runs it prints what rank 0 is doing every 20 s. A link that outlives ``--timeout`` ends
the run with one line naming the method and the limit; the rounds every method finished by then
are reported. Results go to ``runs/comm_bench.json`` and ``.png`` (untracked) unless ``--json`` /
``--plot`` say otherwise.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from torch import nn

from benchmarks.bench_common import (
    RESULTS,
    batches,
    core_version,
    count_params,
    end_rank,
    launch,
    machine,
    median,
    report_status,
    scape_fields,
    start_rank,
)

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("no-comm + AdamS", "DDP + AdamW", "DDP + AdamS", "PowerSGD r4 + AdamW", "SCAPE 90%", "SCAPE 99%",
           "SCAPE 99% native", "SCAPE 99% sharded",
           "no-comm + AdamS compiled", "SCAPE 90% compiled", "SCAPE 99% compiled")
GROUPS = ("SCAPE 90% groups", "SCAPE 99% groups", "SCAPE 99% native groups")  # --methods only: selection="groups"
DEFAULT_METHODS = ("no-comm + AdamS", "DDP + AdamW", "SCAPE 90%", "SCAPE 99%", "SCAPE 99% native")  # README's table
COMPILED = " compiled"  # a method name's suffix: ScapeConfig(kernels="compiled") / AdamS(kernels="compiled")
DENSE = "DDP + AdamW"
BYTES = ("per optimizer step, what one rank hands to collectives as ScapeState.stats() counts it (an encoded wire's "
         "all-to-all + all-gather as the one all-reduce of the encoded buffer whose traffic they equal); the lo "
         "column is what crossed the interface")
BOUND = "no-comm + AdamS"


# ----- counting what is handed to collectives ---------------------------------------------
class CollectiveCounter:
    """Wraps torch.distributed's collectives; counts the tensors this rank hands over, per method."""

    INPUT_ARG = {"all_reduce": 0, "broadcast": 0, "all_gather": 1, "all_gather_into_tensor": 1,
                 "all_gather_single": 1, "reduce_scatter_tensor": 1, "all_to_all_single": 1}

    def __init__(self) -> None:
        self.method: str | None = None
        self.totals: dict[str, dict[str, int]] = defaultdict(lambda: dict(calls=0, values=0, bytes=0))

    def install(self) -> None:
        for op, arg in self.INPUT_ARG.items():
            if hasattr(dist, op):  # all_gather_single: torch >= 2.13
                setattr(dist, op, self._wrap(getattr(dist, op), arg))

    def _wrap(self, fn: Callable, arg: int) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            if self.method is not None:
                t = args[arg] if len(args) > arg else kwargs.get("tensor", kwargs.get("input_tensor"))
                c = self.totals[self.method]
                c["calls"] += 1
                c["bytes"] += t.numel() * t.element_size()
                if t.is_floating_point():  # mask payloads are bytes, not values
                    c["values"] += t.numel()
            return fn(*args, **kwargs)
        return counted


COUNTER = CollectiveCounter()


# ----- methods ------------------------------------------------------------------------------
@dataclass
class Method:
    name: str
    model: nn.Module
    opt: torch.optim.Optimizer
    scape: Any = None  # ScapeState for SCAPE methods
    data: Any = None  # per-batch-size iterators, identical seeds for every method
    times: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    cpu: dict[int, list[float]] = field(default_factory=lambda: defaultdict(list))
    windows: dict[int, list[dict[str, int]]] = field(default_factory=lambda: defaultdict(list))
    loss: float = float("nan")

    def step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
        """Wall seconds, and this thread's CPU seconds (what the step costs whatever the machine's load)."""
        t0, c0 = time.perf_counter(), time.thread_time()
        loss = self.model(x, y)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.loss = float(loss.detach())
        return time.perf_counter() - t0, time.thread_time() - c0


def build(name: str, base: nn.Module, warmup_steps: int) -> Method:
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    from scape_core import AdamS, ScapeAdamS, ScapeState, scape_hook

    hp = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    model = copy.deepcopy(base)
    kernels = "compiled" if name.endswith(COMPILED) else "eager"
    if name.removesuffix(COMPILED) == BOUND:
        return Method(name, model, AdamS(model.parameters(), kernels=kernels, **hp))
    # torch's PowerSGD hook launches its P/Q all-reduces from completion callbacks; on gloo those
    # race with the next bucket's all-reduce and the ranks' collectives mismatch. One bucket avoids it.
    ddp = DDP(model, bucket_cap_mb=1e4) if name.startswith("PowerSGD") else DDP(model)
    if name.startswith("DDP"):
        ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        opt = torch.optim.AdamW if name.endswith("AdamW") else AdamS
        return Method(name, ddp, opt(ddp.parameters(), **hp))
    if name.startswith("PowerSGD"):
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                            start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return Method(name, ddp, torch.optim.AdamW(ddp.parameters(), **hp))
    sparsity = float(name.split()[1].rstrip("%")) / 100
    options = {"shard_optimizer": True} if name.endswith("sharded") else {}
    if " native" in name:  # fp32 values on the wire instead of the default int4 at 99%
        options["wire"] = "native"
    if " groups" in name:  # ScapeConfig(selection="groups"): one pick per group of each row, not its top-k
        options["selection"] = "groups"
    state = ScapeState(ddp, sparsity=sparsity, **scape_fields(warmup_steps), **options, kernels=kernels)
    ddp.register_comm_hook(state, scape_hook)
    return Method(name, ddp, ScapeAdamS(ddp.parameters(), state, **hp), scape=state)


def tx_bytes(iface: str = "lo") -> int:
    """Bytes sent through ``iface`` of this process's network namespace (-1 if there is none)."""
    path = Path(f"/sys/class/net/{iface}/statistics/tx_bytes")
    return int(path.read_text()) if path.exists() else -1


def counters(ifaces: dict[str, str]) -> dict[str, int]:
    """``{key: tx_bytes(interface)}`` for ``ifaces`` such as ``{"lo_bytes": "lo"}``."""
    return {key: tx_bytes(name) for key, name in ifaces.items()}


def window(m: Method, batch: int, steps: int, ifaces: dict[str, str], barrier_bytes: dict[str, int]) -> None:
    """``steps`` timed steps of ``m``, between barriers so the interface counters belong to it."""
    before = m.scape.stats() if m.scape is not None else None
    dist.barrier()
    tx0 = counters(ifaces)
    counted0 = dict(COUNTER.totals[m.name])
    COUNTER.method = m.name
    for _ in range(steps):
        x, y = next(m.data[batch])
        wall, cpu = m.step(x, y)
        m.times[batch].append(wall)
        m.cpu[batch].append(cpu)
    COUNTER.method = None
    dist.barrier()  # gloo's barrier also waits for collectives still in flight (SCAPE's mask)
    tx1 = counters(ifaces)
    w = {k: COUNTER.totals[m.name][k] - counted0.get(k, 0) for k in ("calls", "values", "bytes")}
    w.update(steps=steps, **{k: tx1[k] - tx0[k] - barrier_bytes[k] for k in ifaces})
    if before is not None:
        after = m.scape.stats()
        w.update({f"scape_{k}": after[k] - before[k] for k in ("values_sent", "bytes_sent", "mask_bytes")
                  if k in after})
    m.windows[batch].append(w)


def worker(args: argparse.Namespace) -> None:
    rank, world, data, base = start_rank(args.params, args.context, args.layers)
    status = args.status if rank == 0 else None
    report_status(status, f"building {len(args.methods)} methods")
    methods = [build(name, base, args.scape_warmup) for name in args.methods]
    for m in methods:
        m.data = {b: batches(data, b, args.context, seed=1000 * rank + b) for b in args.batches}
    COUNTER.install()

    # the interfaces of this rank's namespace: its loopback, and the link to other nodes if any
    ifaces = {"lo_bytes": "lo", **({"link_bytes": args.link} if args.link else {})}
    dist.barrier()
    empty = []
    for _ in range(3):  # what two barriers and a counter read cost on each interface
        t0 = counters(ifaces)
        dist.barrier()
        dist.barrier()
        t1 = counters(ifaces)
        empty.append({k: t1[k] - t0[k] for k in ifaces})
    barrier_bytes = {k: min(e[k] for e in empty) for k in ifaces}

    for i, m in enumerate(methods):  # untimed: DDP's bucket rebuild, PowerSGD's and SCAPE's dense warm-up
        compiling = ", compiling its kernels" if m.name.endswith(COMPILED) else ""
        report_status(status, f"warm-up of {m.name} ({i + 1} of {len(methods)}: {args.warm} untimed steps{compiling})")
        for _ in range(args.warm):
            m.step(*next(m.data[args.batches[0]]))
    for batch in args.batches:
        for r in range(args.rounds):
            order = methods[r % len(methods):] + methods[:r % len(methods)]  # rotate: no fixed slot
            for m in order:
                report_status(status, f"per-rank batch {batch}, round {r + 1} of {args.rounds}: {m.name}")
                window(m, batch, args.steps, ifaces, barrier_bytes)
            out = gather(methods, rank, world, ifaces)  # after every round: what a stopped run keeps
            if rank == 0:
                out.update(params=count_params(base), context=args.context, barrier_bytes=barrier_bytes)
                Path(args.result).write_text(json.dumps(out))
    dist.destroy_process_group()


def gather(methods: list[Method], rank: int, world: int, ifaces: dict[str, str]) -> dict[str, Any]:
    """Every rank's timings so far, combined on rank 0 (per step: the slowest rank; CPU: the median);
    the interface counters summed over nodes. Every rank calls it; the others get ``{}``."""
    # each node's local rank 0 read its own namespace's interfaces; the other ranks' reads repeat them
    leader = int(os.environ.get("LOCAL_RANK", rank)) == 0
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {m.name: (dict(m.times), dict(m.cpu), dict(m.windows) if leader else None)
                                      for m in methods})
    if rank != 0:
        return {}
    nodes = sum(1 for g in gathered if g[methods[0].name][2] is not None) if methods else 1
    out: dict[str, Any] = {"world_size": world, "nodes": nodes, "methods": {}}
    for m in methods:
        per_step = {b: [max(g[m.name][0][b][i] for g in gathered) for i in range(len(ts))] for b, ts in m.times.items()}
        cpu = {b: [median([g[m.name][1][b][i] for g in gathered]) for i in range(len(cs))] for b, cs in m.cpu.items()}
        windows = node_sums([g[m.name][2] for g in gathered if g[m.name][2] is not None], list(ifaces))
        out["methods"][m.name] = {"times": per_step, "cpu": cpu, "windows": windows, "final_loss": m.loss}
    return out


def node_sums(per_node: list[dict[int, list[dict[str, int]]]], keys: list[str]) -> dict[int, list[dict[str, int]]]:
    """The first node's windows with the interface counters ``keys`` summed over every node."""
    out = copy.deepcopy(per_node[0])
    for batch, windows in out.items():
        for i, w in enumerate(windows):
            for k in keys:
                w[k] = sum(node[batch][i][k] for node in per_node)
    return out


# ----- the slow link: a network namespace with a rate-limited loopback ----------------------
class Namespace:
    """A network namespace whose only interface is its own loopback; removed by :meth:`remove`.

    ``stale_prefix``: names ``<stale_prefix><pid>[-...]`` whose pid is gone were left by a killed
    run of the same harness and are removed by :meth:`create`; no other namespace is touched.
    """

    def __init__(self, name: str, stale_prefix: str = "scape-bench-") -> None:
        self.name = name
        self.stale_prefix = stale_prefix
        self.created = False

    @staticmethod
    def unavailable(install: bool = True) -> str | None:
        """Why namespaces cannot be used here, or None; installs iproute2 (apt) if root lacks it and ``install``."""
        if os.geteuid() != 0:
            return "not root: creating a network namespace and shaping its interfaces needs root"
        if not (shutil.which("ip") and shutil.which("tc")):
            if not install:
                return "`ip`/`tc` missing (install iproute2)"
            print("`ip`/`tc` missing: installing iproute2 with apt-get", flush=True)
            try:
                subprocess.run(["apt-get", "install", "-y", "--no-install-recommends", "iproute2"],
                               check=True, timeout=300, stdout=subprocess.DEVNULL)
            except (OSError, subprocess.SubprocessError) as e:
                return f"`ip`/`tc` missing and installing iproute2 failed ({e})"
        return None

    def _ip(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", *cmd], check=check, timeout=30, capture_output=True, text=True)

    def create(self) -> None:
        self._ip("netns", "del", self.name, check=False)  # a stale one of the same name
        listed = self._ip("netns", "list", check=False).stdout.split()
        for stale in listed:  # left by a run that was killed (its pid is gone)
            pid = stale.removeprefix(self.stale_prefix).split("-")[0]
            if stale.startswith(self.stale_prefix) and pid.isdigit() and not Path(f"/proc/{pid}").exists():
                self._ip("netns", "del", stale, check=False)
        r = self._ip("netns", "add", self.name, check=False)
        if r.returncode:
            raise RuntimeError(f"cannot create network namespace {self.name}: {r.stderr.strip()}")
        self.created = True
        self._ip("netns", "exec", self.name, "ip", "link", "set", "lo", "up")

    def shape(self, rate_mbit: float | None) -> None:
        """Rate-limit the namespace's loopback (``None``: remove the limit)."""
        tc = ["ip", "netns", "exec", self.name, "tc", "qdisc"]
        subprocess.run(tc + ["del", "dev", "lo", "root"], timeout=30, capture_output=True)
        if rate_mbit is not None:
            subprocess.run(tc + ["add", "dev", "lo", "root", "tbf", "rate", f"{rate_mbit:g}mbit",
                                 "burst", "512kb", "latency", "100ms"], check=True, timeout=30)

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def pids(self) -> list[int]:
        """Every process running inside the namespace."""
        return [int(p) for p in self._ip("netns", "pids", self.name, check=False).stdout.split()]

    def remove(self) -> None:
        """Kill what still runs inside (a namespace lives on while a process holds it), then delete it."""
        if self.created:
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self._ip("netns", "del", self.name, check=False)
            self.created = False


# ----- report -------------------------------------------------------------------------------
def summarize(raw: dict[str, Any], batches_: list[int]) -> dict[str, Any]:
    """Per link, batch and method: median step time and per-step communication."""
    out: dict[str, Any] = {}
    for link, res in raw.items():
        for b in batches_:
            methods = {name: m for name, m in res.get("methods", {}).items() if m["windows"].get(str(b))}
            if not methods:  # a stopped run: no round of this batch finished
                continue
            rows = {}
            for name, m in methods.items():
                ws = m["windows"][str(b)]
                steps = sum(w["steps"] for w in ws)
                times = m["times"][str(b)]
                row = {"time_s": median(times), "times": times, "cpu_s": median(m["cpu"][str(b)])}
                for k in ("values", "bytes", "lo_bytes", "link_bytes", "scape_values_sent", "scape_bytes_sent",
                          "scape_mask_bytes"):
                    if k in ws[0]:
                        row[k] = sum(w[k] for w in ws) / steps
                row["handed_bytes"] = row["bytes"]  # the wrapper's raw count, kept as a check
                if "scape_bytes_sent" in row:  # one way for every method: as ScapeState.stats() counts
                    row["bytes"], row["values"] = row["scape_bytes_sent"], row["scape_values_sent"]
                rows[name] = row
            out[f"{link}/{b}"] = rows
    return out


def ratio(rows: dict[str, Any], a: str, b: str) -> float:
    """Step time of ``a`` over ``b``: the median of per-round ratios (the i-th steps of all methods
    ran in the same interleaved round, so slow drift in the machine's load cancels); NaN where either did not
    run (``--methods`` without it)."""
    if a not in rows or b not in rows:
        return float("nan")
    ta, tb = rows[a].get("times"), rows[b].get("times")
    if ta and tb and len(ta) == len(tb):
        return median([x / y for x, y in zip(ta, tb)])
    return rows[a]["time_s"] / rows[b]["time_s"]


def times(r: float) -> str:
    """A ratio as the tables print it (``-`` where it is NaN: a method not run)."""
    return "-" if r != r else f"{r:.2f}x"


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def tables(summary: dict[str, Any], links: dict[str, str], default_batch: int, context: int,
           shared_lo: bool = False) -> str:
    lines = []
    for key, rows in summary.items():
        link, b = key.split("/")
        dense_bytes = rows.get(DENSE, {}).get("bytes")
        default = " (default)" if int(b) == default_batch else ""
        lines += [f"\n**{links[link]}, per-rank batch {b} x {context} tokens{default}**\n",
                  "| method | step (s, median) | / no-comm (paired) | DDP+AdamW / this (paired) | CPU s / step | "
                  "values sent / step | bytes sent / step (one rank) | % of dense | "
                  f"bytes on lo / step ({'host lo, SHARED' if shared_lo else 'both ranks'}) |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for name, r in rows.items():
            t = r["time_s"]
            pct = f"{100 * r['bytes'] / dense_bytes:.2f}%" if dense_bytes and "bytes" in r else "-"
            lines.append(
                f"| {name} | {t:.3f} | {times(ratio(rows, name, BOUND))} | {times(ratio(rows, DENSE, name))} | "
                f"{r.get('cpu_s', float('nan')):.3f} | "
                f"{r.get('values', 0):,.0f} | "
                f"{fmt_bytes(r.get('bytes', 0))} | {pct} | {fmt_bytes(max(r.get('lo_bytes', 0), 0))} |")
    return "\n".join(lines)


def results(summary: dict[str, Any], slow: str | None, default_batch: int) -> list[str]:
    """What the run measured, in words: SCAPE 99%'s share of dense bytes and its step against the others."""
    lines = []
    for key, rows in summary.items():
        if key.startswith("loopback/") and "SCAPE 99%" in rows and DENSE in rows:
            pct = 100 * rows["SCAPE 99%"]["bytes"] / rows[DENSE]["bytes"]
            lo = 100 * rows["SCAPE 99%"]["lo_bytes"] / max(rows[DENSE]["lo_bytes"], 1)
            lines.append(f"- SCAPE 99% hands {pct:.2f}% of dense DDP's bytes to the collectives a step ({key}; "
                         f"{lo:.2f}% crossed the interface)")
            break
    for key, rows in summary.items():
        if slow is None or not key.startswith(f"{slow}/") or "SCAPE 99%" not in rows:
            continue
        s = "SCAPE 99%"
        tag = " (default batch)" if key == f"{slow}/{default_batch}" else ""
        said = []
        if DENSE in rows:
            said.append(f"SCAPE 99%'s step is {ratio(rows, DENSE, s):.2f}x faster than dense DDP + AdamW's")
        if BOUND in rows:
            said.append(f"it takes {ratio(rows, s, BOUND):.2f}x the step without communication")
        if "PowerSGD r4 + AdamW" in rows:
            said.append(f"PowerSGD rank 4 takes {ratio(rows, 'PowerSGD r4 + AdamW', s):.2f}x its time")
        if f"{s} sharded" in rows:
            b = rows[f"{s} sharded"]["bytes"] / max(rows[s]["bytes"], 1)
            said.append(f"sharded, {ratio(rows, f'{s} sharded', s):.2f}x its time for {b:.2f}x its bytes")
        lines.append(f"- {key}{tag}: " + "; ".join(said))
    return lines


def plot(summary: dict[str, Any], links: dict[str, str], context: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(next(iter(summary.values())))
    keys = list(summary)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        link, b = key.split("/")
        xs = [j + i * width for j in range(len(names))]
        rows = summary[key]
        label = f"{links[link]}, batch {b}x{context} (bound {rows[BOUND]['time_s']:.2f} s)" if BOUND in rows else key
        ax1.bar(xs, [ratio(rows, n, BOUND) if BOUND in rows else rows[n]["time_s"] for n in names], width, label=label)
    ax1.axhline(1.25, color="k", ls="--", lw=0.8)
    ax1.set_ylim(top=ax1.get_ylim()[1] * 1.4)  # room for the legend above the bars
    ax1.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, rotation=25, ha="right")
    ax1.set_ylabel("step time / no-comm bound (median of per-round ratios)")
    ax1.set_title("Step time relative to no communication (dashed: 1.25x)")
    ax1.legend(fontsize=7)
    first = next((k for k in keys if k.startswith("loopback/")), keys[0])
    handed = [summary[first][n].get("bytes", 0) for n in names]
    wire = [max(summary[first][n].get("lo_bytes", 0), 0) for n in names]
    xs = range(len(names))
    ax2.bar([x - 0.2 for x in xs], handed, 0.4, label="sent, as ScapeState.stats() counts (one rank)")
    ax2.bar([x + 0.2 for x in xs], wire, 0.4, label="on the loopback interface (both ranks)")
    ax2.set_yscale("log")
    ax2.set_ylim(bottom=1e5)
    for x, h in zip(xs, handed):
        ax2.text(x, 1.3e5, "0" if h == 0 else f"{100 * h / max(handed):.1f}%", ha="center", fontsize=8)
    ax2.set_xticks(list(xs), names, rotation=25, ha="right")
    ax2.set_ylabel("bytes per optimizer step")
    ax2.set_title("Bytes per step")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# ----- driver -------------------------------------------------------------------------------
def add_run_args(p: argparse.ArgumentParser, methods: Sequence[str] = DEFAULT_METHODS, batches: str = "1,4") -> None:
    """The options of one timed run (model, batches, schedule, methods); multinode.py takes them too."""
    p.add_argument("--params", type=float, default=25e6, help="model size target (parameters)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--context", type=int, default=128, help="tokens per sequence")
    p.add_argument("--batches", default=batches, help="per-rank batch sizes (sequences), comma-separated")
    p.add_argument("--default-batch", type=int, default=1, help="the batch the targets are judged at")
    p.add_argument("--steps", type=int, default=1, help="timed steps per method per window")
    p.add_argument("--rounds", type=int, default=4, help="interleaved windows per method per batch")
    p.add_argument("--warm", type=int, default=3, help="untimed steps per method first")
    p.add_argument("--scape-warmup", type=int, default=2, help="SCAPE's dense warm-up (< --warm)")
    p.add_argument("--methods", default=",".join(methods),
                   help=f"comma-separated method names (default: {', '.join(methods)}), or 'all' for these "
                        f"{len(METHODS)}: {', '.join(METHODS)} (the compiled ones compile for minutes first: give "
                        "--timeout 2400 or more)".replace("%", "%%"))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_args(p)
    p.add_argument("--gbit", type=float, default=1.0, help="slow link: Gbit/s per rank per direction")
    p.add_argument("--links", default="loopback,slow")
    p.add_argument("--timeout", type=float, default=540, help="seconds per link before every rank is killed")
    p.add_argument("--json", default=str(RESULTS / "comm_bench.json"), help="the report (default: untracked runs/)")
    p.add_argument("--plot", default=str(RESULTS / "comm_bench.png"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--status", help=argparse.SUPPRESS)  # worker: where rank 0 says what it is doing
    p.add_argument("--link", default="", help=argparse.SUPPRESS)  # worker: the inter-node interface to count
    return check_run_args(p, p.parse_args(argv))


def check_run_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Parse the lists of :func:`add_run_args` and refuse inconsistent values (``p.error``)."""
    args.batches = [int(b) for b in str(args.batches).split(",")]
    if args.methods == "all":
        args.methods = list(METHODS)
    args.methods = [m.strip() for m in args.methods.split(",")] if isinstance(args.methods, str) else args.methods
    unknown = set(args.methods) - set(METHODS) - set(GROUPS)
    if unknown:
        p.error(f"--methods: unknown {sorted(unknown)}; choose from {list(METHODS) + list(GROUPS)}")
    if args.scape_warmup >= args.warm:
        p.error("--scape-warmup must be below --warm, so that every timed SCAPE step is sparse")
    if args.default_batch not in args.batches:
        p.error(f"--default-batch {args.default_batch} is not in --batches {args.batches}")
    return args


def worker_argv(args: argparse.Namespace) -> list[str]:
    """One rank's command line (after ``python``) for the run ``args`` describes; ``--result`` and
    ``--status`` are added by :func:`measure`."""
    return [str(Path(__file__).resolve()), "--worker", "--params", str(args.params), "--layers", str(args.layers),
            "--context", str(args.context), "--batches", ",".join(map(str, args.batches)),
            "--default-batch", str(args.default_batch), "--steps", str(args.steps), "--rounds", str(args.rounds),
            "--warm", str(args.warm), "--scape-warmup", str(args.scape_warmup), "--methods", ",".join(args.methods)]


class Stopped(RuntimeError):
    """A run that failed or outlived its limit (``timed_out``); ``partial``: rank 0's result of the rounds
    every method finished."""

    def __init__(self, reason: str, partial: dict[str, Any], timed_out: bool) -> None:
        super().__init__(reason)
        self.partial, self.timed_out = partial, timed_out


def measure(run: Callable[[list[str], Path], None], argv: list[str]) -> dict[str, Any]:
    """``run(argv + ["--result", FILE, "--status", STATUS], STATUS)`` (it starts the ranks; rank 0 writes
    what it is doing to STATUS); rank 0's result and the load average around it.

    Raises :class:`Stopped` (with the rounds every method finished) if ``run`` raises ``RuntimeError``
    or ``TimeoutError``.
    """
    with tempfile.TemporaryDirectory() as tmp:
        result, status = Path(tmp) / "result.json", Path(tmp) / "status.txt"
        load = os.getloadavg()[0]
        try:
            run(argv + ["--result", str(result), "--status", str(status)], status)
        except (RuntimeError, TimeoutError) as e:
            partial = json.loads(result.read_text()) if result.exists() else {}
            raise Stopped(str(e), partial, timed_out=isinstance(e, TimeoutError)) from None
        raw = json.loads(result.read_text())
    raw["loadavg"] = [round(load, 2), round(os.getloadavg()[0], 2)]  # machine noise
    print(f"  load average (1 min) before/after: {raw['loadavg']}", flush=True)
    return raw


def rounds_done(raw: dict[str, Any]) -> str:
    """What a stopped link's partial result holds, for the line that ends the run."""
    method = next(iter(raw.get("methods", {}).values()), None)
    if method is None:
        return "no method finished a timed round"
    return "the tables above keep " + ", ".join(f"the {len(ws)} round(s) every method finished at per-rank batch {b}"
                                                for b, ws in method["windows"].items())


def main() -> None:
    args = parse()
    if args.worker:
        worker(args)
        end_rank()
    links = [link.strip() for link in args.links.split(",")]
    world = 2
    rate_mbit = args.gbit * 1000 * world  # every rank's traffic crosses the one shared loopback queue
    names = {"loopback": "loopback (unshaped)", "slow": f"{args.gbit:g} Gbit/s per rank (tbf {rate_mbit:g} mbit on lo)"}
    why = Namespace.unavailable()
    if why:
        print(f"NOTE: no network namespace ({why}). The slow link is skipped; the unshaped link runs on "
              "the host loopback, whose interface counters include any other traffic on it.", flush=True)
        links = [link for link in links if link != "slow"]
    ns = Namespace(f"scape-bench-{os.getpid()}")
    raw: dict[str, Any] = {}
    stopped = None
    t_start = time.time()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` removes the namespace
    try:
        if not why:
            ns.create()
        for link in links:
            if not why:
                ns.shape(rate_mbit if link == "slow" else None)
            print(f"[{time.time() - t_start:5.0f}s] link {names[link]}: 2 ranks, {len(args.methods)} methods "
                  f"({', '.join(args.methods)}), limit {args.timeout:g} s", flush=True)

            def run(argv: list[str], status: Path) -> None:
                launch(argv, world, args.timeout, prefix=None if why else ns.prefix(), status=status,
                       label=f"{link} link")
            try:
                raw[link] = measure(run, worker_argv(args))
            except Stopped as e:
                hint = " (--timeout; --methods to run fewer)" if e.timed_out else ""
                stopped = f"{e}{hint}; {rounds_done(e.partial)}"
                if e.partial.get("methods"):
                    raw[link] = e.partial
                break
    except KeyboardInterrupt:
        stopped = "interrupted (Ctrl-C)"
    finally:
        ns.remove()
    report_results(args, raw, names, shared_lo=bool(why), seconds=time.time() - t_start, stopped=stopped)
    if stopped:
        print(f"\ncomm_bench STOPPED: {stopped}", flush=True)
        sys.exit(1)


def report_results(args: argparse.Namespace, raw: dict[str, Any], names: dict[str, str], shared_lo: bool,
                   seconds: float, stopped: str | None) -> None:
    """Write the JSON (and the plot) of what ran, and print its tables and targets."""
    summary = summarize(raw, args.batches)
    if not summary:
        print("no method finished a timed round: nothing to report", flush=True)
        return
    params = next(iter(raw.values()))["params"]
    report = {"command": " ".join(["python", "benchmarks/comm_bench.py"] + sys.argv[1:]), "machine": machine(),
              "core": core_version(), "stopped": stopped,
              "params": params, "links": {link: names[link] for link in raw},
              "namespace": None if shared_lo else "isolated",
              "default_batch": args.default_batch, "context": args.context, "summary": summary, "raw": raw}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1))
    Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
    plot(summary, names, args.context, Path(args.plot))
    partial = " (PARTIAL: the run stopped, see below)" if stopped else ""
    print(f"\nGPT {params / 1e6:.1f}M parameters, 2 ranks (gloo, 1 thread each), {seconds:.0f}s; "
          f"machine {machine()}; {core_version()}{partial}")
    print(f"bytes: {BYTES}")
    print(tables(summary, names, args.default_batch, args.context, shared_lo=shared_lo))
    print("\nResults:")
    print("\n".join(results(summary, "slow" if "slow" in raw else None, args.default_batch)))
    print(f"\nwrote {args.json} and {args.plot}", flush=True)


if __name__ == "__main__":
    main()
