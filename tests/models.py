"""The small model, batches and loss the core's multi-process tests train (one definition for all)."""

from __future__ import annotations

import torch
from torch import nn


def make_model(seed: int = 0, dtype: torch.dtype = torch.float32) -> nn.Module:
    """A 5-layer MLP (16 -> 4) with a LayerNorm: several parameter shapes, rows that end short."""
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.LayerNorm(64), nn.Linear(64, 4))
    return net.to(dtype)


def batch(step: int, rank: int, n: int = 8, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of step ``step`` (inputs, targets): the same on every run."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(n, 16, generator=g).to(dtype), torch.randn(n, 4, generator=g).to(dtype)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean squared error."""
    return (model(x) - y).pow(2).mean()
