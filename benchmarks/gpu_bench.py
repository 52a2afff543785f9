"""What SCAPE's own work costs on one device, against a dense step: the step, the memory, the launches.

World size 1 (NCCL on a GPU, gloo on the CPU): the all-reduce moves nothing, so the step times
compare what each method computes. Methods, on the same model, weights and batches:
``DDP + AdamW`` (torch's fused AdamW where the device has it), ``DDP + AdamS``, ``SCAPE 90%``,
``SCAPE 99%`` (core defaults after a short warm-up, no ramp: every timed step is sparse), the
same with ``selection="groups"`` and with ``kernels="compiled"`` (its compile in the warm-up steps),
and ``SCAPE 99% lazy``. Per method: the median step over ``--steps`` timed steps after ``--warm``,
the peak memory (GPU: ``max_memory_allocated``; CPU: the bytes of optimizer and SCAPE state),
the bytes one rank hands to collectives per step, and from ``torch.profiler`` over two steps
(after the timing): kernel launches and host synchronizations per step (GPU), top-level torch
operators per step (both). On a GPU a sparse step also runs under
``torch.cuda.set_sync_debug_mode("error")``, which fails on any host synchronization.

Each method runs in a process of its own (``--fresh``, the default on a GPU: a method timed after
another was profiled in the same process ran slower), and the first method is timed again at the
end, in a fresh process, as a check that the order of methods does not change the figures.

The break-even link bandwidth: the per-rank link speed below which SCAPE's step is faster than
dense DDP's, from the measured step times and the bytes each hands to collectives, for ``--world``
ranks on a ring (a rank sends ``2 (W - 1) / W`` of an all-reduce's buffer) and no overlap of
communication with computation (dense DDP overlaps its all-reduce with the backward, so this
favours SCAPE where dense DDP's communication hides behind its backward; the bound is the same
for both on a link slower than that).

``--ops`` counts the operators SCAPE adds to a step for two models of the same size, one of ~20
parameter tensors and one of ~400 (``benchmarks/op_count.py`` counts them on GPT-2's structure).

    python benchmarks/gpu_bench.py                       # GPT-2 small's shape on a GPU, ~3 min on an H200
    python benchmarks/gpu_bench.py --shape gpt2-350m --methods "DDP + AdamW" "SCAPE 99%"
    python benchmarks/gpu_bench.py --shape tiny --ops     # anywhere; the CPU figures of docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.bench_common import GPT, core_version, free_port, machine  # noqa: E402
from scape_core import AdamS, ScapeAdamS, ScapeConfig, ScapeState, scape_hook  # noqa: E402

SHAPES = {  # vocab, width, layers, heads, context, batch
    "gpt2": (50_304, 768, 12, 12, 1024, 8),  # GPT-2 small: 124M parameters, 148 tensors
    "gpt2-350m": (50_304, 1024, 24, 16, 1024, 8),  # GPT-2 medium: 355M parameters, 292 tensors
    "tiny": (512, 128, 4, 4, 64, 4),
}
# " groups": selection="groups" (the default: the row's top-k); " compiled": kernels="compiled" (first steps compile)
METHODS = ("DDP + AdamW", "DDP + AdamS", "SCAPE 90%", "SCAPE 99%", "SCAPE 99% groups", "SCAPE 99% compiled",
           "SCAPE 99% lazy")
SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy")
LAUNCH_EVENTS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx")


def build(method: str, base: nn.Module, device: torch.device, warmup: int) -> tuple[DDP, torch.optim.Optimizer]:
    model = copy.deepcopy(base).to(device)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    hp = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    if method == "DDP + AdamW":
        fused = device.type == "cuda" or hasattr(torch._C, "_fused_adamw_")  # fused CPU AdamW exists since 2.4
        return ddp, torch.optim.AdamW(ddp.parameters(), fused=fused, **hp)
    if method == "DDP + AdamS":
        return ddp, AdamS(ddp.parameters(), **hp)
    sparsity = 0.9 if "90" in method else 0.99
    state = ScapeState(ddp, sparsity=sparsity, warmup_steps=warmup, ramp_steps=0,
                       update="lazy" if "lazy" in method else "linear",
                       selection="groups" if method.endswith(" groups") else "topk",
                       kernels="compiled" if method.endswith(" compiled") else "eager")
    ddp.register_comm_hook(state, scape_hook)
    return ddp, ScapeAdamS(ddp.parameters(), state, **hp)


def make_step(ddp: DDP, opt: torch.optim.Optimizer, batches: list, device: torch.device) -> Callable[[int], None]:
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else nullcontext()

    def step(i: int) -> None:
        x, y = batches[i % len(batches)]
        with autocast:
            loss = ddp(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def timed(step: Callable[[int], None], first: int, steps: int, device: torch.device) -> list[float]:
    """Seconds per step (CUDA events on a GPU)."""
    out = []
    for i in range(first, first + steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step(i)
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end) / 1000)
        else:
            t0 = time.perf_counter()
            step(i)
            out.append(time.perf_counter() - t0)
    return out


def profile_counts(step: Callable[[int], None], first: int, device: torch.device, steps: int = 2) -> dict[str, Any]:
    """Per step: top-level torch operators, and on a GPU kernel launches and host synchronizations."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for i in range(first, first + steps):
            step(i)
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.events()
    out: dict[str, Any] = {"operators": sum(map(_outermost_op, events)) / steps}
    if device.type == "cuda":
        out["kernel_launches"] = sum(e.name in LAUNCH_EVENTS for e in events) / steps
        out["host_syncs"] = sum(e.name in SYNC_EVENTS for e in events) / steps
    out["table"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12)
    return out


def _outermost_op(event: Any) -> bool:
    """A torch operator not called by another one (what Python code launched; nested ones are its parts)."""
    if not event.name.startswith(("aten::", "c10d::")):
        return False
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(("aten::", "c10d::")):
            return False
        parent = parent.cpu_parent
    return True


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every tensor the optimizer and SCAPE keep (each storage once)."""
    seen, total = set(), 0
    tensors = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    scape = getattr(opt, "scape", None)
    if scape is not None:
        tensors += [t for t in (scape.buffers.residual, scape.buffers.windows) if t is not None]
        tensors += [m.cols for m in scape.masks.values()]
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def run_method(method: str, base: nn.Module, batches: list, device: torch.device, args: argparse.Namespace) -> dict:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    ddp, opt = build(method, base, device, warmup=args.scape_warmup)
    step = make_step(ddp, opt, batches, device)
    for i in range(args.warm):
        step(i)
    times = timed(step, args.warm, args.steps, device)
    row: dict[str, Any] = {"step_s": statistics.median(times), "steps_s": times}
    row["memory_bytes"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    row["state_bytes"] = state_bytes(opt)
    row.update(profile_counts(step, args.warm + args.steps, device))
    if device.type == "cuda" and method.startswith("SCAPE"):
        torch.cuda.synchronize()
        try:
            torch.cuda.set_sync_debug_mode("error")
            step(args.warm + args.steps + 2)
            row["sync_check"] = "no host synchronization in a sparse step"
        except RuntimeError as e:
            row["sync_check"] = f"FAILED: {e}"[:500]
        finally:
            torch.cuda.set_sync_debug_mode("default")
    if isinstance(opt, ScapeAdamS):
        if hasattr(opt.scape, "guard"):  # a core with the replica guard
            row["replica_check_s"] = replica_check_seconds(opt.scape, device)
        stats = opt.scape.stats()
        row["sparse"] = not opt.scape.is_dense(opt.scape.step - 1) and stats["skipped_steps"] == 0
        row["bytes_per_step"] = opt.scape.last_step_bytes[0]  # handed to collectives (world size 1 counts them too)
        opt.scape.wait()
    else:  # DDP's all-reduce of every gradient
        row["bytes_per_step"] = sum(p.numel() * p.element_size() for p in ddp.parameters())
    del ddp, opt
    return row


def replica_check_seconds(state: Any, device: torch.device, repeats: int = 5) -> float:
    """The median time of one replica check (:mod:`scape_core.replicas`): the fingerprints, their all-gather
    and the host's read of the verdict (at world size 1 the guard itself skips the collective: timed here)."""
    from scape_core.compat import all_gather_into_tensor

    def check() -> None:
        _, mine = state.guard.fingerprints(state.replicated())
        every = mine.new_empty(state.comm.world_size * mine.numel())
        all_gather_into_tensor(every, mine.view(-1), group=state.comm.process_group)
        bool((every.view(state.comm.world_size, -1) != mine.view(1, -1)).any().cpu())

    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        check()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def tensors_model(count: int, numel: int) -> nn.Module:
    """An MLP of ``count`` parameter tensors (weights and biases) holding about ``numel`` values in all."""
    layers = count // 2
    width = max(8, int((numel / layers) ** 0.5))
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def op_counts(device: torch.device, numel: int = 2_000_000) -> dict[str, Any]:
    """Operators SCAPE adds to a sparse step (minus DDP + AdamS's), for ~20 and ~400 parameter tensors."""
    out = {}
    for count in (20, 400):
        base = tensors_model(count, numel)
        width = base[0].in_features
        xs = [(torch.randn(16, width, device=device),) for _ in range(4)]
        counts = {}
        for method in ("DDP + AdamS", "SCAPE 99%"):
            model = copy.deepcopy(base).to(device)
            ddp = DDP(model)
            if method == "DDP + AdamS":
                opt: torch.optim.Optimizer = AdamS(ddp.parameters(), lr=1e-3)
            else:
                state = ScapeState(ddp, sparsity=0.99, warmup_steps=2, ramp_steps=0)
                ddp.register_comm_hook(state, scape_hook)
                opt = ScapeAdamS(ddp.parameters(), state, lr=1e-3, weight_decay=0.1)

            def step(i: int, ddp: DDP = ddp, opt: torch.optim.Optimizer = opt) -> None:
                ddp(*xs[i % len(xs)]).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            for i in range(5):
                step(i)
            counts[method] = profile_counts(step, 5, device)["operators"]
        out[str(count)] = {"tensors": len(list(base.parameters())), "numel": sum(p.numel() for p in base.parameters()),
                           "ddp_adams_ops": counts["DDP + AdamS"], "scape_ops": counts["SCAPE 99%"],
                           "added_by_scape": counts["SCAPE 99%"] - counts["DDP + AdamS"]}
    a, b = out["20"]["added_by_scape"], out["400"]["added_by_scape"]
    out["ratio_400_to_20"] = b / a if a else float("nan")
    return out


def break_even_gbit(dense: dict[str, Any], scape: dict[str, Any], world: int) -> float | None:
    """The per-rank link speed (Gbit/s) below which ``scape``'s step beats ``dense``'s, with ``world`` ranks
    on a ring and no overlap of communication with computation; ``None`` if SCAPE's computation is not
    slower (it then wins at every speed)."""
    extra = scape["step_s"] - dense["step_s"]
    ring = 2 * (world - 1) / world
    saved = ring * (dense["bytes_per_step"] - scape["bytes_per_step"]) * 8 / 1e9  # Gbit per step
    return saved / extra if extra > 0 else None


def report(res: dict[str, Any]) -> str:
    rows = res["methods"]
    dense_name = "DDP + AdamW" if "DDP + AdamW" in rows else next(iter(rows))
    dense = rows[dense_name]
    gpu = res["device"].startswith("cuda")
    lines = [f"{res['shape']} ({res['params'] / 1e6:.1f}M parameters, {res['tensors']} tensors) "
             f"on {res['device_name']}, world size 1, each method "
             f"{'in a fresh process' if res['fresh'] else 'in turn'}; "
             f"medians of {res['steps']} steps after {res['warm']}\n",
             "| method | step | x dense AdamW | peak memory | optimizer + SCAPE state | operators / step"
             + (" | kernel launches / step | host syncs / step |" if gpu else " |")
             + " bytes / step | break-even link |",
             "|---|---|---|---|---|---|" + ("---|---|" if gpu else "") + "---|---|"]
    for name, r in rows.items():
        mem = f"{r['memory_bytes'] / 1e9:.2f} GB" if r["memory_bytes"] else "-"
        line = (f"| {name} | {1000 * r['step_s']:.1f} ms | {r['step_s'] / dense['step_s']:.2f} | {mem} | "
                f"{r['state_bytes'] / res['params']:.1f} B/param | {r['operators']:.0f}")
        if gpu:
            line += f" | {r['kernel_launches']:.0f} | {r['host_syncs']:.0f}"
        even = break_even_gbit(dense, r, res["world"]) if name.startswith("SCAPE") else None
        link = "" if not name.startswith("SCAPE") else ("any" if even is None else f"{even:.1f} Gbit/s")
        lines.append(line + f" | {r['bytes_per_step'] / 1e6:.3g} MB | {link} |")
    lines.append(f"\nbreak-even link: the per-rank link speed below which the method's step is faster than "
                 f"{dense_name}'s, at W = {res['world']} on a ring, without overlap of communication and computation")
    for name, r in rows.items():
        if "sync_check" in r:
            lines.append(f"\n{name}: {r['sync_check']}")
        if "replica_check_s" in r:
            every = res.get("replica_check_every", 100)
            lines.append(f"{name}: one replica check {1000 * r['replica_check_s']:.2f} ms, every {every} steps "
                         f"{100 * r['replica_check_s'] / every / r['step_s']:.3f}% of a step")
    if "order_check" in res:
        o = res["order_check"]
        lines.append(f"\norder check: {o['method']} timed first {1000 * o['first_s']:.1f} ms, again last "
                     f"{1000 * o['last_s']:.1f} ms ({o['last_s'] / o['first_s']:.2f}x)")
    if "ops" in res:
        o = res["ops"]
        lines.append(f"\nOperators SCAPE adds to a sparse step (minus DDP + AdamS's): {o['20']['added_by_scape']:.0f} "
                     f"with {o['20']['tensors']} tensors, {o['400']['added_by_scape']:.0f} with {o['400']['tensors']} "
                     f"tensors (ratio {o['ratio_400_to_20']:.2f}; about {o['20']['numel'] / 1e6:.1f}M values each)")
    return "\n".join(lines)


def in_fresh_process(method: str, argv: list[str]) -> dict[str, Any]:
    """``method``'s row, measured by this script in a process of its own."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "row.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--methods", method, "--no-fresh", "--json",
               str(out)]
        env = dict(os.environ)
        env.pop("MASTER_PORT", None)  # each child picks its own
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"{method} failed (exit {done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        return json.loads(out.read_text())["methods"][method]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: gpt2 on a GPU, tiny on the CPU")
    p.add_argument("--device", default=None, help="default: cuda:0 if available, else cpu")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warm", type=int, default=6, help="untimed steps first (SCAPE's warm-up included)")
    p.add_argument("--scape-warmup", type=int, default=3)
    p.add_argument("--world", type=int, default=8, help="ranks assumed for the break-even link bandwidth")
    p.add_argument("--fresh", action=argparse.BooleanOptionalAction, default=None,
                   help="each method in a process of its own (default: on a GPU)")
    p.add_argument("--ops", action="store_true", help="also count the operators SCAPE adds for ~20 and ~400 tensors")
    p.add_argument("--json", type=Path, default=Path("runs/gpu_bench.json"))
    p.add_argument("--profile-out", type=Path, default=None, help="write the profiler tables here")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda:0" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())  # set_device needs an index
    shape = args.shape or ("gpt2" if device.type == "cuda" else "tiny")
    fresh = args.fresh if args.fresh is not None else device.type == "cuda"
    if args.warm <= args.scape_warmup:
        raise SystemExit("--warm must exceed --scape-warmup, so that every timed SCAPE step is sparse")
    vocab, width, layers, heads, context, batch = SHAPES[shape]
    torch.manual_seed(0)
    base = GPT(vocab, width, layers, heads, context)
    res: dict[str, Any] = {"shape": shape, "device": str(device), "params": sum(p.numel() for p in base.parameters()),
                           "tensors": len(list(base.parameters())), "steps": args.steps, "warm": args.warm,
                           "world": args.world, "fresh": fresh,
                           "replica_check_every": getattr(ScapeConfig(), "replica_check_every", None),
                           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else
                           machine()["cpu"], "machine": machine(), "core": core_version(), "methods": {}}
    t0 = time.time()
    if fresh:
        given = list(sys.argv[1:] if argv is None else argv)
        keep = [a for i, a in enumerate(given) if not _is_option_value(given, i, ("--methods", "--json", "--ops"))]
        child = keep + (["--device", str(device)] if "--device" not in keep else [])
        for method in args.methods:
            res["methods"][method] = in_fresh_process(method, child)
            print(f"{method}: {1000 * res['methods'][method]['step_s']:.1f} ms", flush=True)
        first = args.methods[0]
        if len(args.methods) > 1:
            again = in_fresh_process(first, child)
            res["order_check"] = {"method": first, "first_s": res["methods"][first]["step_s"],
                                  "last_s": again["step_s"]}
    else:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(free_port()))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
        g = torch.Generator().manual_seed(1)
        batches = [tuple(torch.randint(vocab, (batch, context), generator=g).to(device) for _ in range(2))
                   for _ in range(4)]
        for method in args.methods:
            res["methods"][method] = run_method(method, base, batches, device, args)
            print(f"{method}: {1000 * res['methods'][method]['step_s']:.1f} ms", flush=True)
        if args.ops:
            res["ops"] = op_counts(device)
        dist.destroy_process_group()
    res["seconds"] = round(time.time() - t0)
    text = report(res)
    print(text)
    tables = {m: r.get("table", "") for m, r in res["methods"].items()}
    if args.profile_out:
        args.profile_out.parent.mkdir(parents=True, exist_ok=True)
        args.profile_out.write_text("\n\n".join(f"== {m}\n{t}" for m, t in tables.items()))
    res["report"] = text
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=1))
    print(f"\n{res['seconds']}s; wrote {args.json}")
    return res


def _is_option_value(argv: list[str], i: int, options: tuple[str, ...]) -> bool:
    """Whether ``argv[i]`` is one of ``options`` or one of their values (the parent's, not a child's)."""
    for j in range(i, -1, -1):
        if argv[j].startswith("--"):
            return argv[j].split("=")[0] in options
    return False


if __name__ == "__main__":
    main()
