"""torch-version differences in one place (the supported range is torch >= 2.1)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor

# torch 2.13 renamed all_gather_into_tensor to all_gather_single (the old name warns); same arguments
ALL_GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"


def all_gather_into_tensor(output: Tensor, input: Tensor, group: dist.ProcessGroup | None = None,
                           async_op: bool = False) -> Any:
    """``dist.all_gather_into_tensor`` under this torch's name for it (looked up at each call, so
    wrappers that count collectives on ``torch.distributed`` see it)."""
    return getattr(dist, ALL_GATHER)(output, input, group=group, async_op=async_op)
