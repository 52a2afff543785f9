"""Read SCAPE's state in the terms of the contract, whatever the core's internal layout.

The arithmetic tests (``tests/test_arithmetic.py``) compare the core against the reference in
``tests/reference.py`` one step at a time. They read the core only through these functions, so
a rewrite of the core's storage (flat buffers, chunked masks) changes this file, not the tests.

Everything is returned per parameter name as flat fp32/int64 CPU tensors:

- ``snapshot``: parameters, momentum ``m``, the ``linear`` rule's ``sq``, each coordinate's
  last synchronized step (``last_sync``: the ``ScapeState.step`` index of the step that last
  exchanged it), this rank's residual, and the step counter;
- ``mask``: the sorted flat indices the step exchanges;
- ``selection_groups``: how the core cuts the coordinates into top-k groups (which rank scores
  each group). This is structure, not arithmetic: the tests check the score and the top-k
  inside each group independently.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from scape_core import ScapeAdamS, ScapeState


@dataclass(frozen=True)
class Group:
    """Coordinates ``[start, start + size)`` of parameter ``name`` form one top-k group scored by ``rank``."""

    name: str
    start: int
    size: int
    rank: int | None  # None: the score is replicated, any rank's state gives it


def _flat(t: Tensor) -> Tensor:
    return t.detach().reshape(-1).to(dtype=torch.float64, device="cpu").clone()


def snapshot(state: ScapeState, opt: ScapeAdamS) -> dict:
    """Everything a SCAPE step reads and writes on this rank, by parameter name."""
    out: dict = {"step": state.step, "param": {}, "m": {}, "sq": {}, "last_sync": {}, "residual": {}}
    for name, p in state.params.items():
        out["param"][name] = _flat(p)
        s = opt.state.get(p, {})
        out["m"][name] = _flat(s["exp_avg"]) if "exp_avg" in s else torch.zeros(p.numel(), dtype=torch.float64)
        if "sq" in s:
            out["sq"][name] = _flat(s["sq"])
        if "synced_at" in s:  # the optimizer step (from 1) of the last sync; no skipped steps in these runs
            out["last_sync"][name] = s["synced_at"].detach().reshape(-1).to(torch.int64).cpu() - 1
        r = state.residuals.get(name)
        out["residual"][name] = _flat(r) if r is not None else torch.zeros(p.numel(), dtype=torch.float64)
    return out


def mask(state: ScapeState, step: int) -> dict[str, Tensor] | None:
    """The mask exchanged at ``step`` (sorted flat indices per name); ``None`` on a dense step."""
    if state.is_dense(step):
        return None
    return {n: i.to(torch.int64).cpu().sort().values for n, i in state.masks[step].items()}


def selection_groups(state: ScapeState, step: int) -> list[Group]:
    """The top-k groups of the mask used at ``step``."""
    replicated = state.config.resolved_score in ("age_momentum", "momentum")
    layout = state.layout_at(step)
    return [Group(slot.name, slot.start, slot.size, None if replicated else rank)
            for rank in range(state.world_size) for slot in layout.partition(rank)]
