"""README.md as a new user meets it: every Python block runs as written, every file it names exists.

README marks a block by the line ``<!-- runnable -->`` (or ``<!-- runnable nproc=4 -->``) right
before its ```` ```python ```` fence, or says why not with ``<!-- not runnable: <reason> -->``;
every Python block carries one of them. A runnable block runs as a script under ``torchrun
--standalone --nproc_per_node 2`` (or the block's count; CPU, gloo, one thread per process,
``ACCELERATE_USE_CPU=1``) in an empty folder. What a block imports from ``my_project`` (its
comment says "yours") is the user's own model and data: here the tiny ones in ``MY_PROJECT``.
The files README and the pages under ``docs/`` name (links, and paths in code spans and shell
blocks) must exist.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUNNABLE, NOT_RUNNABLE = re.compile(r"<!-- runnable(?: nproc=(\d))? -->"), "<!-- not runnable:"

MY_PROJECT = '''
"""The user's project, as README's snippets import it: a tiny model and data (tests/test_readme.py)."""
import os

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def _data(samples: int = 240) -> TensorDataset:
    g = torch.Generator().manual_seed(int(os.environ.get("RANK", 0)))  # each rank its own data
    x = torch.randn(samples, 8, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True).sin())


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 1))


model = _net()
loader = DataLoader(_data(), batch_size=4)
batches = list(loader)  # 60 steps of 4 samples
loss_fn = nn.functional.mse_loss


class Blocks(nn.Module):
    """A model of blocks for FSDP2 (each block sharded on its own)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(8, 64), nn.Linear(64, 64), nn.Linear(64, 1)])

    def forward(self, x):
        for block in self.blocks[:-1]:
            x = torch.tanh(block(x))
        return self.blocks[-1](x)


blocks_model = Blocks()


def _hf():
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 64, (160, 16), generator=g)
    return transformers.GPT2LMHeadModel(config), [{"input_ids": x, "labels": x} for x in ids]


def __getattr__(name):  # the transformers model and data, built only for the block that imports them
    if name in ("hf_model", "hf_dataset"):
        return _hf()[name == "hf_dataset"]
    raise AttributeError(name)


class MyLightningModule(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = _net()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return loss_fn(self.net(x), y)

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 10)}

    def train_dataloader(self):
        return DataLoader(_data(), batch_size=4)
'''


def python_blocks(text: str) -> list[tuple[str, str, str]]:
    """``(section heading, marker line, code)`` of every ```` ```python ```` block in ``text``."""
    blocks, heading, lines = [], "", text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("#"):
            heading = line.lstrip("# ").strip()
        if line.strip() == "```python":
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
            marker = lines[i - 1].strip() if i else ""
            blocks.append((heading, marker, "\n".join(lines[i + 1:end]) + "\n"))
    return blocks


BLOCKS = python_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
RUNS = [(heading, int(m.group(1) or 2), code) for heading, marker, code in BLOCKS if (m := RUNNABLE.fullmatch(marker))]


def test_every_python_block_is_marked():
    unmarked = [heading for heading, marker, _ in BLOCKS
                if not RUNNABLE.fullmatch(marker) and not marker.startswith(NOT_RUNNABLE)]
    assert not unmarked, f"README: mark these Python blocks <!-- runnable --> or {NOT_RUNNABLE} why -->: {unmarked}"
    assert len(RUNS) >= 4  # Trainer, Fabric, Accelerate, plain DDP


@pytest.mark.parametrize("nproc,code", [(n, code) for _, n, code in RUNS],
                         ids=[re.sub(r"\W+", "-", heading).strip("-").lower() for heading, _, _ in RUNS])
def test_readme_block_runs_as_written(nproc, code, tmp_path):
    (tmp_path / "my_project.py").write_text(MY_PROJECT)
    (tmp_path / "snippet.py").write_text(code)
    env = dict(os.environ, OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), "snippet.py"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, \
        f"README block failed ({proc.returncode}):\n{code}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"


PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# a repository path: a known top-level folder, then a file with an extension (links, code spans, shell lines)
FOLDERS = "scape_core|lightning_scape|accelerate_scape|examples|benchmarks|tests|docs"
PATH = re.compile(rf"(?<![\w/.-])((?:\.\./)?(?:{FOLDERS})/[\w./-]*\.\w+)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def named_files(page: Path) -> set[str]:
    """The repository files ``page`` names: its relative links and the paths in its text."""
    text = page.read_text(encoding="utf-8")
    links = {target for target in LINK.findall(text) if "://" not in target}
    return links | set(PATH.findall(text))


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_pages_name_no_missing_file(page):
    missing = sorted(name for name in named_files(page)
                     if not (page.parent / name).exists() and not (ROOT / name.removeprefix("../")).exists())
    assert not missing, f"{page.relative_to(ROOT)} names files that do not exist: {missing}"


README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_readme_says_the_step_the_defaults_reach_the_target_density():
    from scape_core import ScapeConfig

    claim = re.search(r"density: step (\d+) with the defaults \((\d+) with `wire=\"native\"`\)", README)
    assert claim, "README's options section no longer says when the target density is reached"
    assert int(claim.group(1)) == ScapeConfig().target_step
    assert int(claim.group(2)) == ScapeConfig(wire="native").target_step


def test_readme_quotes_the_examples_start_of_run_line_as_the_core_writes_it():
    from scape_core import ScapeConfig

    quoted = next(line for line in README.splitlines() if line.startswith("SCAPE: warmup_steps=30, ramp_steps=90"))
    assert quoted == ScapeConfig(warmup_steps=30, ramp_steps=90).describe_run(300)


def test_readme_launcher_exports_and_prints_only_what_was_set(tmp_path):
    """README: ``accelerate-scape config --sparsity 0.99 --warmup_steps 100``, then ``accelerate-scape
    launch ... train.py  # exports (and prints) only what you set``. Here one process, and a script that
    writes the ``SCAPE_*`` variables it got."""
    assert "accelerate-scape launch --multi_gpu --num_processes 8 train.py # exports (and prints) only what you set" \
        in README
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SCAPE_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf"), PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cli = [sys.executable, "-m", "accelerate_scape.cli"]
    subprocess.run([*cli, "config", "--sparsity", "0.99", "--warmup_steps", "100"], env=env, check=True,
                   capture_output=True, timeout=120)
    script = tmp_path / "train.py"
    script.write_text("import json, os, sys\n"
                      "json.dump({k: v for k, v in os.environ.items() if k.startswith('SCAPE_')}, "
                      "open(sys.argv[1], 'w'))\n")
    got = tmp_path / "env.json"
    proc = subprocess.run([*cli, "launch", "--num_processes", "1", "--ramp_steps", "30", str(script), str(got)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(got.read_text()) == {"SCAPE_SPARSITY": "0.99", "SCAPE_WARMUP_STEPS": "100",
                                           "SCAPE_RAMP_STEPS": "30"}
    printed = {line.split("=")[0].strip(): line.strip() for line in proc.stderr.splitlines() if line.startswith("  ")}
    assert sorted(printed) == ["ramp_steps", "sparsity", "warmup_steps"], proc.stderr
    assert printed["ramp_steps"].endswith("(flag)") and "scape_config.yaml" in printed["sparsity"]
    assert "The others are not exported" in proc.stderr
