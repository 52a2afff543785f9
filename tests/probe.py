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
  inside each group independently;
- ``wire_segments``: on an encoded wire, each bucket's compact buffer cut into owners' segments
  and scale blocks (structure again: the tests check what each block may carry).

With ``shard_optimizer=True`` each rank keeps m, sq and the windows of its block of rows only:
``snapshot`` gathers every rank's (a collective: call it on every rank), so the tests compare
the same whole state in both modes.
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
    """Everything a SCAPE step reads and writes on this rank, by parameter name (collective when sharded)."""
    out: dict = {"step": state.step, "param": {}, "m": {}, "sq": {}, "last_sync": {}, "residual": {}}
    layout = state.layout
    unshard = state.shards.unshard
    m = unshard(opt.momentum_buffer)
    sq = unshard(opt.statistics["sq"]) if "sq" in opt.statistics else None
    windows = None if state.buffers.windows is None else unshard(state.buffers.windows)
    for name, p in state.params.items():
        out["param"][name] = _flat(p)
        out["m"][name] = _flat(layout.view(m, name))
        if sq is not None:
            out["sq"][name] = _flat(layout.view(sq, name))
        if windows is not None:
            out["last_sync"][name] = layout.view(windows, name).to(torch.int64).cpu().clone()
        out["residual"][name] = _flat(state.residual(name))
    return out


def mask(state: ScapeState, step: int) -> dict[str, Tensor] | None:
    """The mask exchanged at ``step`` (sorted flat indices per name); ``None`` on a dense step."""
    if state.is_dense(step):
        return None
    entries = state.masks[step].flat(state.layout).cpu()
    out = {}
    for name in state.params:
        start = state.layout.first_row[name] * state.layout.chunk
        inside = entries[(entries >= start) & (entries < start + state.layout.numel[name])]
        out[name] = (inside - start).sort().values
    return out


def selection_groups(state: ScapeState, step: int) -> list[Group]:
    """The top-k groups of the mask used at ``step``: each row of ``chunk`` coordinates of a parameter."""
    layout, chunk = state.layout, state.layout.chunk
    groups = []
    for name in state.params:
        for i in range(layout.nrows[name]):
            row = layout.first_row[name] + i
            owner = None if state.config.replicated_score and not state.sharded else _owner(state, row)
            groups.append(Group(name, i * chunk, min(chunk, layout.numel[name] - i * chunk), owner))
    return groups


@dataclass(frozen=True)
class Compact:
    """One bucket's compact buffer on an encoded wire: position ``i`` holds coordinate ``index[i]`` of
    parameter ``names[i]``; ``owner[i]`` reduces it and ``block[i]`` (unique in the bucket) is its scale block."""

    names: list[str]
    index: Tensor
    owner: Tensor
    block: Tensor


def wire_segments(state: ScapeState) -> list[Compact]:
    """The compact buffer of the sparse step in progress (call between backward and ``opt.step()``):
    one per step, the mask's entries in order, whatever DDP's buckets."""
    layout, out = state.layout, []
    for entries in [state.masks[state.step].flat(layout).cpu()]:
        plan = state.buckets.wire_plan(entries.numel())
        rows = torch.div(entries, layout.chunk, rounding_mode="floor")
        names, index = [], []
        for e, row in zip(entries.tolist(), rows.tolist()):
            name = next(n for n in state.params if layout.first_row[n] <= row < layout.first_row[n] + layout.nrows[n])
            names.append(name)
            index.append(e - layout.first_row[name] * layout.chunk)
        pos = torch.arange(entries.numel())
        out.append(Compact(names, torch.tensor(index), pos // plan.segment, pos // plan.block_len))
    return out


def shard_plans(state: ScapeState) -> list[float]:
    """The densities whose shard plans the sharded mode holds now (none when replicated)."""
    return sorted(state.shards._plans)


def _owner(state: ScapeState, row: int) -> int:
    """The rank whose block of rows holds ``row`` (it scores it from its residual, or its shard of m)."""
    return row // state.layout.block(state.comm.world_size)
