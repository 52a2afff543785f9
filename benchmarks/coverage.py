"""Every coordinate trains: which coordinates a SCAPE run moves, against the ones that get a gradient.

Two gloo ranks train a small untied language model (embedding, MLP, head) with the real
``scape_hook`` and ``ScapeAdamS`` (the library's defaults unless named), ``weight_decay=0``, so a
coordinate moves only when SCAPE applies its gradient. Two cases, each the failure a coordinate
scored by ``|m| (n - 1)`` alone meets (its ``m`` is 0 until it is exchanged, so it never is):

- ``late-tokens``: the first ``--shift`` steps see tokens 0-63 only, the rest 0-127 (tokens first
  seen after the warm-up: a real vocabulary's tail, tokens added for a fine-tune). It reports how
  many embedding rows of the early and of the late tokens moved between the shift and the end.
- ``no-warmup``: ``warmup_steps=0``; the share of the coordinates with a gradient that moved in the
  first ``--sparse-steps`` sparse steps.

Both report the most steps any coordinate waited between two exchanges.

    python benchmarks/coverage.py                        # both cases, the defaults (about 1 minute)
    python benchmarks/coverage.py --max-window 16777216  # the bound off (the score alone)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

VOCAB, EARLY, WIDTH = 128, 64, 32


class TinyLM(nn.Module):
    """Embedding, one hidden layer, an untied head: each token's embedding row gets a gradient only
    on steps whose batch holds that token."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 64), nn.ReLU())
        self.head = nn.Linear(64, VOCAB)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.mlp(self.embed(x)))


def batch(step: int, rank: int, tokens: int, size: int = 64) -> tuple[Tensor, Tensor]:
    """This rank's batch: tokens drawn from ``[0, tokens)``, each followed by a fixed successor."""
    g = torch.Generator().manual_seed(step * 16 + rank)
    x = torch.randint(0, tokens, (size,), generator=g)
    return x, (x * 37 + 11) % VOCAB


def run_rank(rank: int, world: int, port: int, case: str, steps: int, shift: int, fields: dict, out: str) -> None:
    """One rank of a case; rank 0 writes its counts to ``out``."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from scape_core import ScapeAdamS, ScapeState, scape_hook

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = TinyLM()
    ddp = DDP(model)
    state = ScapeState(ddp, **fields)
    ddp.register_comm_hook(state, scape_hook)
    opt = ScapeAdamS(ddp.parameters(), state, lr=1e-2, weight_decay=0.0)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    seen = {n: torch.zeros_like(p, dtype=torch.bool) for n, p in model.named_parameters()}  # had a gradient
    def record(name: str) -> Callable[[Tensor], None]:
        def hook(grad: Tensor) -> None:  # this rank's own gradient, before DDP synchronizes it
            seen[name].logical_or_(grad != 0)
        return hook

    for n, p in model.named_parameters():
        p.register_hook(record(n))
    longest = 0  # the longest any coordinate waited between two exchanges
    for step in range(steps):
        if step == shift:
            start = {n: p.detach().clone() for n, p in model.named_parameters()}
            for flags in seen.values():
                flags.zero_()
        x, y = batch(step, rank, EARLY if step < shift else VOCAB)
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if state.buffers.windows is not None:  # steps since each coordinate was last exchanged
            last = torch.cat([state.layout.view(state.buffers.windows, n) for n in state.params])
            longest = max(longest, int(state.step - 1 - last.min().item()))
    seen = {n: _any_rank(f) for n, f in seen.items()}  # a gradient on any rank
    moved = {n: p.detach() != start[n] for n, p in model.named_parameters()}
    if rank == 0:
        rows = moved["embed.weight"].any(1)
        result = dict(case=case, steps=steps, shift=shift, config=state.config.to_dict(),
                      early_rows_moved=int(rows[:EARLY].sum()), late_rows_moved=int(rows[EARLY:].sum()),
                      rows_each=EARLY, longest_wait=longest,
                      with_gradient=sum(int(f.sum()) for f in seen.values()),
                      moved_with_gradient=sum(int((moved[n] & f).sum()) for n, f in seen.items()))
        Path(out).write_text(json.dumps(result))
    state.wait()
    dist.barrier()
    os._exit(0)  # as the other benchmarks: stock DDP's teardown on gloo can hang at exit (docs/reliability.md)


def _any_rank(flags: Tensor) -> Tensor:
    """Whether any rank's flag is set (an all-reduce of the flags as integers)."""
    import torch.distributed as dist

    counts = flags.to(torch.int32)
    dist.all_reduce(counts)
    return counts > 0


def measure(case: str, fields: dict | None = None, steps: int | None = None, shift: int = 250,
            sparse_steps: int = 200) -> dict:
    """Run ``case`` on 2 gloo ranks and return rank 0's counts."""
    import torch.multiprocessing as mp

    from benchmarks.bench_common import free_port

    fields = dict(fields or {})
    if case == "late-tokens":
        steps = steps or 600
    elif case == "no-warmup":
        fields.setdefault("warmup_steps", 0)
        steps, shift = steps or sparse_steps, 0  # every step sparse; counted from the first
    else:
        raise ValueError(f"case must be 'late-tokens' or 'no-warmup', got {case!r}")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        mp.spawn(run_rank, args=(2, free_port(), case, steps, shift, fields, out), nprocs=2)
        return json.loads(Path(out).read_text())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", nargs="+", default=["late-tokens", "no-warmup"], choices=["late-tokens", "no-warmup"])
    p.add_argument("--max-window", type=int, default=None, help="ScapeConfig.max_window (default: the library's)")
    p.add_argument("--selection", default=None, choices=["topk", "groups"])
    p.add_argument("--shift", type=int, default=250, help="late-tokens: the step tokens 64-127 appear")
    p.add_argument("--steps", type=int, default=None, help="late-tokens: 600; no-warmup: --sparse-steps")
    p.add_argument("--sparse-steps", type=int, default=200)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    fields = {k: v for k, v in dict(max_window=args.max_window, selection=args.selection).items() if v is not None}
    results = []
    for case in args.cases:
        r = measure(case, fields, args.steps, args.shift, args.sparse_steps)
        results.append(r)
        if case == "late-tokens":
            print(f"late-tokens ({fields or 'defaults'}): embedding rows moved from step {r['shift']} to "
                  f"{r['steps']}: tokens seen from the start {r['early_rows_moved']} of {r['rows_each']}, "
                  f"tokens first seen at step {r['shift']} {r['late_rows_moved']} of {r['rows_each']}; "
                  f"longest wait {r['longest_wait']} steps")
        else:
            share = r["moved_with_gradient"] / max(r["with_gradient"], 1)
            print(f"no-warmup ({fields or 'defaults'}): {r['moved_with_gradient']:,} of {r['with_gradient']:,} "
                  f"coordinates with a gradient moved in {r['steps']} sparse steps ({share:.1%}); "
                  f"longest wait {r['longest_wait']} steps")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
