"""Quality at a fixed token budget: dense AdamW/AdamS, SCAPE, raw top-k, and masked-update candidates.

A small character-level GPT on tiny Shakespeare (``--corpus``: or Python's documentation, or
standard-library source; ``bench_common.corpus_text``), trained by W virtual data-parallel ranks in one
process (``benchmarks/simulator.py``: SCAPE's exact arithmetic, bytes counted as the core counts
them). Every method sees the same batches for a given seed, so the final validation losses differ
only by the method. One run per (method, seed, steps) writes a JSON file; ``--report`` turns the
files into the tables and plots of ``docs/benchmarks.md``.

Methods are names from ``METHODS`` with optional ``+key=value`` overrides, e.g.
``scape99+update=catchup``, ``scape99+warmup=200+ramp=300``, ``scape99+send=momentum``,
``scape99+selection=groups``.

Example::

    python benchmarks/convergence.py --methods adams scape99 topk99 --seeds 0 1 --steps 800
    python benchmarks/convergence.py --corpus python-docs --out runs/convergence_docs --methods adams scape99
    python benchmarks/convergence.py --report --out runs/convergence      # one corpus per --out folder
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.bench_common import CORPORA, Block, corpus_ids  # noqa: E402
from benchmarks.simulator import PROTOTYPE_SCORES, SimulatedScape, SimulatedTopK, rank_gradients  # noqa: E402
from scape_core import AdamS, ScapeConfig  # noqa: E402
from scape_core.config import WIRE_BITS, WIRES  # noqa: E402

METHODS: dict[str, dict] = {
    "adamw": dict(kind="adamw"),
    "adams": dict(kind="adams"),
    "scape90": dict(kind="scape", sparsity=0.9),
    "scape99": dict(kind="scape", sparsity=0.99),
    "scape99_momentum": dict(kind="scape", sparsity=0.99, score="momentum"),
    "scape99_delay0": dict(kind="scape", sparsity=0.99, mask_delay=0),
    "topk90": dict(kind="topk", density=0.1),
    "topk99": dict(kind="topk", density=0.01),
    # per-rank density chosen so that indices + union values match SCAPE's bytes (measured, W=8)
    "topk90_eqbytes": dict(kind="topk", density=0.016),
    "topk99_eqbytes": dict(kind="topk", density=0.00125),
}


# ----- data and model ------------------------------------------------------------------
def sample(data: Tensor, n: int, context: int, gen: torch.Generator) -> tuple[Tensor, Tensor]:
    starts = torch.randint(0, len(data) - context - 1, (n,), generator=gen)
    x = torch.stack([data[s:s + context] for s in starts.tolist()])
    y = torch.stack([data[s + 1:s + context + 1] for s in starts.tolist()])
    return x, y


class GPT(nn.Module):
    """nanoGPT's shape (pre-norm blocks, tied embeddings) at character level."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:
                scaled = name.endswith(("proj.weight", "out.weight"))
                nn.init.normal_(p, std=0.02 / (math.sqrt(2 * layers) if scaled else 1))

    def forward(self, x: Tensor) -> Tensor:
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))


def lm_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    logits = model(x)
    return F.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))


@torch.no_grad()
def evaluate(model: nn.Module, batches: list[tuple[Tensor, Tensor]]) -> float:
    return sum(lm_loss(model, x, y).item() for x, y in batches) / len(batches)


# ----- methods ----------------------------------------------------------------------------
def parse_method(spec: str) -> dict:
    """``"scape99+update=catchup+warmup=200"`` -> the method's settings."""
    base, *overrides = spec.split("+")
    if base not in METHODS:
        raise SystemExit(f"unknown method {base!r}; known: {sorted(METHODS)}")
    cfg = dict(METHODS[base])
    for item in overrides:
        key, _, value = item.partition("=")
        if not value:
            raise SystemExit(f"override {item!r} in {spec!r} must be key=value")
        try:
            cfg[key] = json.loads(value)
        except json.JSONDecodeError:
            cfg[key] = value
    return cfg


def build(cfg: dict, model: nn.Module, args: argparse.Namespace):
    hp = dict(lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=args.weight_decay)
    warmup = int(cfg.get("warmup", args.scape_warmup))
    if cfg["kind"] == "adamw":
        return torch.optim.AdamW(model.parameters(), **hp)
    if cfg["kind"] == "adams":
        return AdamS(model.parameters(), **hp)
    if cfg["kind"] == "topk":
        return SimulatedTopK(model, args.world_size, float(cfg["density"]), warmup, **hp)
    # scapeXX is the contract's reading (lazy rule, residual score, no ramp) whatever the library defaults
    fields = dict(update="lazy", score="momentum_residual", ramp_steps=int(cfg.get("ramp", 0)), selection="topk")
    fields.update({k: cfg[k] for k in ("sparsity", "mask_delay", "mask_refresh", "update", "error_feedback",
                                       "chunk_size", "wire_block", "selection") if k in cfg})
    wire = cfg.get("wire", "native")  # names without a wire predate wire="auto": their values are native
    if wire in WIRES:
        fields["wire"] = wire
    if wire in WIRE_BITS:  # a name's sparsity is the coordinates' (as in every run in the docs); the core's, the bytes'
        bits = WIRE_BITS[wire] + (32 / int(cfg.get("wire_block", 128)) if wire != "bfloat16" else 0.0)
        fields["sparsity"] = 1.0 - (1.0 - float(fields["sparsity"])) * bits / 32
    if cfg.get("score") in ("momentum_residual", "momentum", "age_momentum"):
        fields["score"] = cfg["score"]
    config = ScapeConfig(warmup_steps=warmup, **fields)
    score = cfg.get("score") if cfg.get("score") in PROTOTYPE_SCORES else None
    proto = {k: cfg[k] for k in ("scope", "vector_density") if k in cfg}  # prototype switches
    if cfg.get("wire") not in (None, *WIRES):
        proto["wire"] = cfg["wire"]
    return SimulatedScape(model, args.world_size, config, send=cfg.get("send", "gradient"), score=score, **proto, **hp)


def lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warm-up over min(100, steps/10) steps, then cosine to peak/10."""
    warm = min(100, steps // 10)
    if step < warm:
        return peak * (step + 1) / warm
    t = (step - warm) / max(steps - warm, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def run(spec: str, seed: int, steps: int, args: argparse.Namespace) -> dict:
    torch.set_num_threads(1)
    cfg = parse_method(spec)
    train, val, vocab, corpus = corpus_ids(args.corpus)
    per_rank = args.batch // args.world_size
    if per_rank * args.world_size != args.batch:
        raise SystemExit(f"--batch {args.batch} must be a multiple of --world-size {args.world_size}")
    torch.manual_seed(seed)
    model = GPT(vocab, args.width, args.layers, args.heads, args.context)
    numel = sum(p.numel() for p in model.parameters())
    opt = build(cfg, model, args)
    val_gen = torch.Generator().manual_seed(1234)
    val_batches = [sample(val, 32, args.context, val_gen) for _ in range(args.val_batches)]
    curve, ema, t0 = [], None, time.time()
    dense_kind = cfg["kind"] in ("adamw", "adams")
    for step in range(steps):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        batches = [sample(train, per_rank, args.context, gen) for _ in range(args.world_size)]
        lr = lr_at(step, steps, args.lr)
        if dense_kind:  # the mean of equal micro-batches' losses: one backward suffices
            x, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
            loss = lm_loss(model, x, y)
            loss.backward()
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss = loss.item()
        else:
            grads, loss = rank_gradients(model, lm_loss, batches)
            opt.step(grads, lr=lr)
        if not math.isfinite(loss):
            print(f"{spec} seed {seed}: loss is {loss} at step {step}; stopping", flush=True)
            break
        ema = loss if ema is None else 0.95 * ema + 0.05 * loss
        if (step + 1) % args.eval_every == 0 or step + 1 == steps:
            v = evaluate(model, val_batches)
            curve.append((step + 1, ema, v))
            print(f"{spec} seed {seed} step {step + 1}/{steps}: train {ema:.3f} val {v:.3f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
    result = dict(method=spec, settings=cfg, seed=seed, steps=steps, world_size=args.world_size,
                  batch=args.batch, context=args.context, tokens_per_step=args.batch * args.context,
                  params=numel, lr=args.lr, scape_warmup=int(cfg.get("warmup", args.scape_warmup)),
                  model=dict(width=args.width, layers=args.layers, heads=args.heads),
                  corpus=args.corpus, corpus_info=corpus,
                  curve=curve, final_val=curve[-1][2] if curve else float("nan"),
                  wall_s=time.time() - t0, completed=len(curve) > 0 and curve[-1][0] == steps)
    if dense_kind:
        result.update(bytes_per_step=4 * numel, dense_bytes_per_step=4 * numel)
    else:
        c = opt.counters.as_dict()
        result.update(bytes_per_step=c["bytes_per_step"], dense_bytes_per_step=c["dense_bytes"] / max(c["steps"], 1),
                      mask_bytes_per_step=c["mask_bytes"] / max(c["steps"], 1))
        warm = int(cfg.get("warmup", args.scape_warmup))
        sparse_steps = max(c["steps"] - warm, 1)
        result["sparse_bytes_per_step"] = (c["bytes_sent"] - warm * 4 * numel) / sparse_steps
        if isinstance(opt, SimulatedTopK) and opt.union_fraction:
            result["union_fraction"] = sum(opt.union_fraction) / len(opt.union_fraction)
        if isinstance(opt, SimulatedScape) and not opt.config.dense:
            counts = opt.sync_counts[opt.real].float()
            result["never_synced"] = opt.never_synced()
            result["syncs_per_coordinate_p99"] = counts.quantile(0.99).item() if counts.numel() < 2**24 else None
    return result


# ----- report -------------------------------------------------------------------------------
def load(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("*.json"))]


def report(out: Path, plots: Path | None, plot_methods: list[str] | None = None) -> str:
    runs = [r for r in load(out) if r.get("completed")]
    groups: dict[tuple, dict[str, list[dict]]] = {}
    for r in runs:
        groups.setdefault((r["steps"], r["batch"]), {}).setdefault(r["method"], []).append(r)
    lines = []
    for (steps, batch), methods in sorted(groups.items()):
        ref = {r["seed"]: r["final_val"] for r in methods.get("adams", [])}
        ref_mean = sum(ref.values()) / len(ref) if ref else None
        dense = max(r["dense_bytes_per_step"] for rs in methods.values() for r in rs)
        lines.append(f"\n**{steps} steps, global batch {batch} sequences "
                     f"({batch * methods[next(iter(methods))][0]['context']} tokens/step)**\n")
        lines.append("| method | val loss per seed | mean | vs dense AdamS (same seeds) | bytes vs dense: whole run "
                     "| sparse phase | never synced |")
        lines.append("|---|---|---|---|---|---|---|")
        def gap(m: str) -> float:  # paired with dense AdamS where it ran on the same seeds
            paired = [r["final_val"] / ref[r["seed"]] - 1 for r in methods[m] if r["seed"] in ref]
            return sum(paired) / len(paired) if paired else float("inf")

        order = sorted(methods, key=gap)
        for m in order:
            rs = sorted(methods[m], key=lambda r: r["seed"])
            mean = sum(r["final_val"] for r in rs) / len(rs)
            per_seed = ", ".join(f"{r['final_val']:.3f} (s{r['seed']})" for r in rs)
            paired = [r["final_val"] / ref[r["seed"]] - 1 for r in rs if r["seed"] in ref]
            vs = f"{100 * sum(paired) / len(paired):+.1f}%" if paired else "-"
            frac = sum(r["bytes_per_step"] for r in rs) / len(rs) / dense
            sparse = [r["sparse_bytes_per_step"] for r in rs if "sparse_bytes_per_step" in r]
            sparse = f"{100 * sum(sparse) / len(sparse) / dense:.2f}%" if sparse else "100%"
            never = [r["never_synced"] for r in rs if r.get("never_synced") is not None]
            never = f"{100 * sum(never) / len(never):.0f}%" if never else "-"
            lines.append(f"| `{m}` | {per_seed} | {mean:.3f} | {vs} | {100 * frac:.2f}% | {sparse} | {never} |")
        if plots is not None:
            shown = {m: rs for m, rs in methods.items() if not plot_methods or m in plot_methods}
            title = f"{steps} steps, {batch * rs[0]['context']} tokens/step, W={rs[0]['world_size']}"
            plot(shown, plots / f"convergence_{steps}steps_b{batch}.png", title)
            frontier(shown, ref_mean, plots / f"convergence_bytes_{steps}steps_b{batch}.png", title)
    return "\n".join(lines)


def plot(methods: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.get_cmap("tab20").colors
    for i, (m, rs) in enumerate(sorted(methods.items())):
        steps = [s for s, _, _ in rs[0]["curve"]]
        vals = [sum(r["curve"][i][2] for r in rs) / len(rs) for i in range(min(len(r["curve"]) for r in rs))]
        kind = rs[0]["settings"]["kind"]
        ax.plot(steps[:len(vals)], vals, label=f"{m} ({len(rs)} seeds)", color=colors[2 * i % 20 + i // 10],
                lw=2.2 if kind in ("adams", "adamw") else 1.3, ls="--" if kind == "topk" else "-")
    ax.set_xlabel("step")
    ax.set_ylabel("val loss (mean over seeds)")
    ax.set_title(title)
    ax.set_ylim(top=min(3.5, ax.get_ylim()[1]))
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def frontier(methods: dict[str, list[dict]], ref: float | None, path: Path, title: str) -> None:
    """Final val loss against bytes on the wire (whole run, fraction of dense): quality at equal bytes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for m, rs in methods.items():
        x = 100 * sum(r["bytes_per_step"] / r["dense_bytes_per_step"] for r in rs) / len(rs)
        y = sum(r["final_val"] for r in rs) / len(rs)
        kind = rs[0]["settings"]["kind"]
        ax.scatter(x, y, marker={"scape": "o", "topk": "s"}.get(kind, "*"), s=30)
        ax.annotate(m, (x, y), fontsize=6, xytext=(3, 2), textcoords="offset points")
    if ref is not None:
        ax.axhline(ref, color="gray", lw=0.8, ls="--")
    ax.set_xscale("log")
    ax.set_xlabel("bytes per rank over the run, % of dense DDP (log)")
    ax.set_ylabel("final val loss (mean over seeds)")
    ax.set_title(title + ": quality vs bytes")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--methods", nargs="+", default=["adamw", "adams", "scape90", "scape99", "scape99_momentum",
                                                    "scape99_delay0", "topk99"])
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    p.add_argument("--steps", nargs="+", type=int, default=[200, 800], help="horizons (each its own cosine)")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--corpus", default="shakespeare", choices=CORPORA, help="character-level text to train on")
    p.add_argument("--batch", type=int, default=32, help="global batch in sequences (split over ranks)")
    p.add_argument("--context", type=int, default=64)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--scape-warmup", type=int, default=50, help="dense warm-up steps of SCAPE and top-k")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--val-batches", type=int, default=16, help="validation batches of 32 sequences")
    p.add_argument("--out", type=Path, default=Path("runs/convergence"))
    p.add_argument("--report", action="store_true", help="print the tables from --out and write the plots")
    p.add_argument("--plots", type=Path, default=None, help="with --report: folder for the PNG plots")
    p.add_argument("--plot-methods", nargs="+", default=None, help="with --plots: the methods the curves show")
    args = p.parse_args(argv)
    if args.report:
        print(report(args.out, args.plots, args.plot_methods))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, torch {torch.__version__}")
    for steps in args.steps:
        for seed in args.seeds:
            for spec in args.methods:
                corpus = "" if args.corpus == "shakespeare" else f"__{args.corpus}"
                path = args.out / f"{spec}__s{seed}__n{steps}__b{args.batch}{corpus}.json"
                if path.exists():
                    print(f"skip {path.name} (exists)")
                    continue
                path.write_text(json.dumps(run(spec, seed, steps, args)))


if __name__ == "__main__":
    main()
