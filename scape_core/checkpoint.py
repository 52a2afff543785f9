"""SCAPE state in checkpoints: keyed by parameter name, validated before anything changes, resharded.

- :func:`state_dict` / :func:`load_state_dict`: one rank's state (what ``ScapeState.state_dict``
  returns), or every rank's in one object (:func:`gather_state_dict`).
- :func:`check_loadable`: a saved state against this run (model, sparsity, layout, world size).
- :func:`save_checkpoint` / :func:`load_checkpoint`: one atomic file for plain DDP scripts.

At the same world size every rank gets its own residual back; at another, every rank starts
from the old ranks' mean residual (the global unsent gradient is kept), with a warning.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from scape_core.masks import Mask

if TYPE_CHECKING:
    from scape_core.state import ScapeState

STATE_FORMAT = 2


def state_dict(state: "ScapeState") -> dict[str, Any]:
    """This rank's state: step, scheduled masks, residual and windows by name, counters (CPU tensors)."""
    state._finish_pending()
    named = lambda buffer: {n: state.layout.view(buffer, n).detach().cpu().clone() for n in state.params}  # noqa: E731
    counters = dict(state.counters, skipped_steps=int(state._skipped))
    return {
        "format": STATE_FORMAT,
        "step": state.step,
        "world_size": state.world_size,
        "rank": state.rank,
        "config": state.config.to_dict(),
        "shapes": {n: tuple(p.shape) for n, p in state.params.items()},
        "masks": {s: {"density": m.density, "cols": m.cols.cpu()} for s, m in state.masks.items()},
        "residual": named(state.residual_buffer) if state.residual_buffer is not None else {},
        "windows": named(state.window_buffer) if state.window_buffer is not None else {},
        "sparse_started": state.sparse_started,
        "counters": counters,
    }


def gather_state_dict(state: "ScapeState") -> dict[str, Any]:
    """Every rank's SCAPE state in one object (collective: call on all ranks).

    Rank 0 can write it to a single checkpoint file; :meth:`ScapeState.load_state_dict` on each
    rank takes its own residual back (or the mean, at another world size).

    Example:
        >>> from scape_core import ScapeState
        >>> state = ScapeState(ddp, sparsity=0.9)
        >>> full = gather_state_dict(state)       # collective: every rank calls it
        >>> len(full["residuals"]) == dist.get_world_size()     # rank 0 then saves it
        True
    """
    own = state_dict(state)
    if state.residual_buffer is not None:
        out = [torch.empty_like(state.residual_buffer) for _ in range(state.world_size)]
        dist.all_gather(out, state.residual_buffer.contiguous(), group=state.process_group)
        residuals = [{n: state.layout.view(r, n).cpu().clone() for n in state.params} for r in out]
    else:
        residuals = [{} for _ in range(state.world_size)]
    full = {k: v for k, v in own.items() if k not in ("residual", "rank")}
    full["residuals"] = residuals
    return full


def check_loadable(state: "ScapeState", saved: Any) -> dict[str, Tensor]:
    """Validate ``saved`` against this run (raises ``ValueError`` naming the difference); returns
    this rank's residual by name (its own, or the mean of every saved rank at another world size)."""
    if not isinstance(saved, dict) or saved.get("format") != STATE_FORMAT:
        found = saved.get("format") if isinstance(saved, dict) else None
        hint = " (saved by scape-train 0.1, before the flat layout: it cannot be resumed)" if found == 1 else ""
        raise ValueError("not a SCAPE state (expected the dict from ScapeState.state_dict or gather_state_dict, "
                         f"format {STATE_FORMAT}){hint}")
    shapes = {n: tuple(s) for n, s in saved["shapes"].items()}
    ours = {n: tuple(p.shape) for n, p in state.params.items()}
    if shapes != ours:
        diff = sorted(set(shapes) ^ set(ours)) or [n for n in ours if shapes[n] != ours[n]]
        raise ValueError(f"SCAPE state was saved for another model: parameters differ at {diff[:5]}")
    for key in ("sparsity", "chunk_size"):
        if saved["config"].get(key) != getattr(state.config, key):
            raise ValueError(f"SCAPE state was saved with {key}={saved['config'].get(key)}, this run uses "
                             f"{key}={getattr(state.config, key)}")
    if "residuals" in saved:  # gathered: one residual dict per saved rank
        per_rank = saved["residuals"]
        if len(per_rank) == state.world_size:
            return per_rank[state.rank]
        warnings.warn(f"resuming SCAPE state saved at world size {len(per_rank)} on world size "
                      f"{state.world_size}: every rank starts from the mean residual", stacklevel=4)
        names = set().union(*per_rank) if per_rank else set()
        return {n: torch.stack([r[n] for r in per_rank]).float().mean(0) for n in names}
    if saved["world_size"] != state.world_size or saved["rank"] != state.rank:
        raise ValueError(
            f"this SCAPE state is rank {saved['rank']} of world size {saved['world_size']}; "
            f"to resume on rank {state.rank} of {state.world_size}, save with gather_state_dict()")
    return saved["residual"]


def load_state_dict(state: "ScapeState", saved: dict[str, Any]) -> None:
    """Restore a :func:`state_dict` or :func:`gather_state_dict` into ``state`` (validated first)."""
    _restore(state, saved, check_loadable(state, saved))


def _restore(state: "ScapeState", saved: dict[str, Any], residual: dict[str, Tensor]) -> None:
    state._finish_pending()
    layout, device = state.layout, state.layout.device
    state.step = int(saved["step"])
    state.masks = {int(s): Mask(float(m["density"]), m["cols"].to(device=device, dtype=torch.int16))
                   for s, m in saved["masks"].items()}
    state.residual_buffer = state.window_buffer = None
    state._sparse = False
    if saved.get("sparse_started"):
        state.start_sparse()
    for buffer, values in ((state.residual_buffer, residual), (state.window_buffer, saved.get("windows", {}))):
        if buffer is not None:
            buffer.zero_()
            for name, v in values.items():
                layout.view(buffer, name).copy_(v.reshape(-1))
    for plan in state.buckets.values():  # residual views point at the old buffer
        plan.residuals = []
    counters = dict(saved["counters"])
    state._skipped.fill_(int(counters.pop("skipped_steps", 0)))
    state.counters.update(counters)


def save_checkpoint(path: str | os.PathLike, state: "ScapeState", **objects: Any) -> None:
    """Write one checkpoint from rank 0 (collective: call on every rank).

    ``objects`` are anything with ``state_dict()`` (model, optimizer, scheduler) or plain
    values. The file is written to a temporary name and renamed, so a crash mid-write never
    leaves a truncated checkpoint under ``path``.

    Example:
        >>> import tempfile
        >>> from scape_core import ScapeState
        >>> state = ScapeState(ddp, sparsity=0.9)
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
        >>> save_checkpoint(path, state, model=ddp.module, step=0)     # every rank calls it
        >>> sorted(load_checkpoint(path, state, model=ddp.module))
        ['model', 'scape', 'step']
    """
    full = gather_state_dict(state)
    if dist.get_rank(state.process_group) == 0:
        payload = {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in objects.items()}
        payload["scape"] = full
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(payload, tmp)
        os.replace(tmp, path)
    dist.barrier(group=state.process_group)


def load_checkpoint(path: str | os.PathLike, state: "ScapeState", **objects: Any) -> dict[str, Any]:
    """Restore a :func:`save_checkpoint` file on this rank; returns the whole payload.

    The file and its SCAPE part are validated before anything is changed, so a truncated file,
    a checkpoint of another model or of another sparsity raises ``ValueError`` and leaves the
    run's own state as it was. At another world size every rank gets the mean residual.
    """
    try:
        payload = torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise
    except Exception as e:  # torch raises several types for a damaged zip / pickle
        raise ValueError(f"cannot read checkpoint {str(path)!r} (truncated or not a torch file): {e}") from e
    if not isinstance(payload, dict) or "scape" not in payload:
        raise ValueError(f"{str(path)!r} is not a SCAPE checkpoint (no 'scape' entry)")
    missing = [k for k in objects if k not in payload]
    if missing:
        raise ValueError(f"checkpoint {str(path)!r} has no entry for {missing}")
    residual = check_loadable(state, payload["scape"])
    for key, obj in objects.items():
        obj.load_state_dict(payload[key])
    _restore(state, payload["scape"], residual)
    return payload
