"""Every Python block README.md marks as runnable runs as written, on 2 gloo processes.

README marks a block by the line ``<!-- runnable -->`` right before its ```` ```python ```` fence,
or says why not with ``<!-- not runnable: <reason> -->``; every Python block carries one of the
two. A runnable block runs as a script under ``torchrun --standalone --nproc_per_node 2`` (CPU,
gloo, one thread per process, ``ACCELERATE_USE_CPU=1``) in an empty folder. What a block imports
from ``my_project`` (its comment says "yours") is the user's own model and data: here the tiny
ones in ``MY_PROJECT`` below.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUNNABLE, NOT_RUNNABLE = "<!-- runnable -->", "<!-- not runnable:"

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
RUNS = [(heading, code) for heading, marker, code in BLOCKS if marker == RUNNABLE]


def test_every_python_block_is_marked():
    unmarked = [heading for heading, marker, _ in BLOCKS if marker != RUNNABLE and not marker.startswith(NOT_RUNNABLE)]
    assert not unmarked, f"README: mark these Python blocks {RUNNABLE} or {NOT_RUNNABLE} why -->: {unmarked}"
    assert len(RUNS) >= 4  # Trainer, Fabric, Accelerate, plain DDP


@pytest.mark.parametrize("code", [code for _, code in RUNS],
                         ids=[re.sub(r"\W+", "-", heading).strip("-").lower() for heading, _ in RUNS])
def test_readme_block_runs_as_written(code, tmp_path):
    (tmp_path / "my_project.py").write_text(MY_PROJECT)
    (tmp_path / "snippet.py").write_text(code)
    env = dict(os.environ, OMP_NUM_THREADS="1", ACCELERATE_USE_CPU="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "snippet.py"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, \
        f"README block failed ({proc.returncode}):\n{code}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
