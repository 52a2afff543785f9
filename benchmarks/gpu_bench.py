"""What SCAPE's own work costs on one device, against a dense step: the step, the memory, the launches.

World size 1 (NCCL on a GPU, gloo on the CPU): the all-reduce moves nothing, so the step times
compare what each method computes. Methods, on the same model, weights and batches:
``DDP + AdamW`` (torch's fused AdamW where the device has it), ``DDP + AdamS``, ``SCAPE 90%``,
``SCAPE 99%`` (core defaults after a short warm-up, no ramp: every timed step is sparse), the
same with ``selection="topk"`` and with ``kernels="compiled"`` (its compile in the warm-up steps),
and ``SCAPE 99% lazy``. Per method: the median step over ``--steps`` timed steps after ``--warm``,
the peak memory (GPU: ``max_memory_allocated``; CPU: the bytes of optimizer and SCAPE state),
and from ``torch.profiler`` over two steps: kernel launches and host synchronizations per step
(GPU), top-level torch operators per step (both). On a GPU a sparse step also runs under
``torch.cuda.set_sync_debug_mode("error")``, which fails on any host synchronization.

``--ops`` counts the operators SCAPE adds to a step (a sparse step minus the same model's DDP +
AdamS step) for two models of the same size, one of ~20 parameter tensors and one of ~400:
they should not differ (issue 14: within 10%).

    python benchmarks/gpu_bench.py                       # GPT-2 small's shape on a GPU, ~3 min on an H200
    python benchmarks/gpu_bench.py --shape tiny --ops     # anywhere; the CPU figures of docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
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
from scape_core import AdamS, ScapeAdamS, ScapeState, scape_hook  # noqa: E402

SHAPES = {  # vocab, width, layers, heads, context, batch
    "gpt2": (50_304, 768, 12, 12, 1024, 8),
    "tiny": (512, 128, 4, 4, 64, 4),
}
# " topk": selection="topk" (the default picks one per group); " compiled": kernels="compiled" (its first steps compile)
METHODS = ("DDP + AdamW", "DDP + AdamS", "SCAPE 90%", "SCAPE 99%", "SCAPE 99% topk", "SCAPE 99% compiled",
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
                       selection="topk" if method.endswith(" topk") else "groups",
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
        tensors += [t for t in (scape.residual_buffer, scape.window_buffer) if t is not None]
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
        stats = opt.scape.stats()
        row["sparse"] = not opt.scape.is_dense(opt.scape.step - 1) and stats["skipped_steps"] == 0
        opt.scape.wait()
    del ddp, opt
    return row


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


def report(res: dict[str, Any]) -> str:
    rows = res["methods"]
    dense = rows["DDP + AdamW"]["step_s"]
    gpu = res["device"].startswith("cuda")
    lines = [f"{res['shape']} ({res['params'] / 1e6:.1f}M parameters, {res['tensors']} tensors) "
             f"on {res['device_name']}, "
             f"world size 1; medians of {res['steps']} steps after {res['warm']}\n",
             "| method | step | x dense AdamW | peak memory | optimizer + SCAPE state | operators / step"
             + (" | kernel launches / step | host syncs / step |" if gpu else " |"),
             "|---|---|---|---|---|---|" + ("---|---|" if gpu else "")]
    for name, r in rows.items():
        mem = f"{r['memory_bytes'] / 1e9:.2f} GB" if r["memory_bytes"] else "-"
        line = (f"| {name} | {1000 * r['step_s']:.1f} ms | {r['step_s'] / dense:.2f} | {mem} | "
                f"{r['state_bytes'] / res['params']:.1f} B/param | {r['operators']:.0f}")
        if gpu:
            line += f" | {r['kernel_launches']:.0f} | {r['host_syncs']:.0f}"
        lines.append(line + " |")
    for name, r in rows.items():
        if "sync_check" in r:
            lines.append(f"\n{name}: {r['sync_check']}")
    if "ops" in res:
        o = res["ops"]
        lines.append(f"\nOperators SCAPE adds to a sparse step (minus DDP + AdamS's): {o['20']['added_by_scape']:.0f} "
                     f"with {o['20']['tensors']} tensors, {o['400']['added_by_scape']:.0f} with {o['400']['tensors']} "
                     f"tensors (ratio {o['ratio_400_to_20']:.2f}; about {o['20']['numel'] / 1e6:.1f}M values each)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default=None, help="default: gpt2 on a GPU, tiny on the CPU")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warm", type=int, default=6, help="untimed steps first (SCAPE's warm-up included)")
    p.add_argument("--scape-warmup", type=int, default=3)
    p.add_argument("--ops", action="store_true", help="also count the operators SCAPE adds for ~20 and ~400 tensors")
    p.add_argument("--json", type=Path, default=Path("runs/gpu_bench.json"))
    p.add_argument("--profile-out", type=Path, default=None, help="write the profiler tables here")
    args = p.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    shape = args.shape or ("gpt2" if device.type == "cuda" else "tiny")
    if args.warm <= args.scape_warmup:
        raise SystemExit("--warm must exceed --scape-warmup, so that every timed SCAPE step is sparse")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    vocab, width, layers, heads, context, batch = SHAPES[shape]
    torch.manual_seed(0)
    base = GPT(vocab, width, layers, heads, context)
    g = torch.Generator().manual_seed(1)
    batches = [tuple(torch.randint(vocab, (batch, context), generator=g).to(device) for _ in range(2))
               for _ in range(4)]
    res: dict[str, Any] = {"shape": shape, "device": str(device), "params": sum(p.numel() for p in base.parameters()),
                           "tensors": len(list(base.parameters())), "steps": args.steps, "warm": args.warm,
                           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else
                           machine()["cpu"], "machine": machine(), "core": core_version(), "methods": {}}
    t0 = time.time()
    for method in args.methods:
        res["methods"][method] = run_method(method, base, batches, device, args)
        print(f"{method}: {1000 * res['methods'][method]['step_s']:.1f} ms", flush=True)
    if args.ops:
        res["ops"] = op_counts(device)
    res["seconds"] = round(time.time() - t0)
    text = report(res)
    print(text)
    tables = {m: r.pop("table") for m, r in res["methods"].items()}
    if args.profile_out:
        args.profile_out.parent.mkdir(parents=True, exist_ok=True)
        args.profile_out.write_text("\n\n".join(f"== {m}\n{t}" for m, t in tables.items()))
    res["report"] = text
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(res, indent=1))
    print(f"\n{res['seconds']}s; wrote {args.json}")
    dist.destroy_process_group()
    return res


if __name__ == "__main__":
    main()
