"""Single-file checkpoints for plain DDP: every rank's SCAPE state plus model and optimizer.

Importing this module (``import scape_core`` does) also registers a step pre-hook common to all
optimizers: an ``Adam`` / ``AdamW`` holding state saved by SCAPE's AdamS (a SCAPE checkpoint
resumed without SCAPE) fails at its first step with a message that says so, where torch would
raise ``KeyError: 'exp_avg_sq'``. It raises nowhere torch would not.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d
from torch.optim.optimizer import register_optimizer_step_pre_hook

from scape_core.adams import MOMENTUM
from scape_core.state import ScapeState, gather_state_dict

ARRIVAL_TIMEOUT = 30.0  # seconds every rank has to reach save_checkpoint after the first one did
_calls: dict[tuple[str, str], int] = {}  # (what, process group) -> collective calls started on this rank


def save_checkpoint(path: str | os.PathLike, state: ScapeState, *, arrival_timeout: float = ARRIVAL_TIMEOUT,
                    **objects: Any) -> None:
    """Write one checkpoint from rank 0 (collective: call on every rank).

    ``objects`` are anything with ``state_dict()`` (model, optimizer, scheduler) or plain
    values. The file is written to a temporary name and renamed, so a crash mid-write never
    leaves a truncated checkpoint under ``path``. Every rank's residual goes into the file, so
    every rank must call it: a rank that does not see all the others arrive within
    ``arrival_timeout`` seconds raises ``RuntimeError`` (the usual cause: saving under
    ``if rank == 0:``) instead of waiting for the process-group timeout.

    Example:
        >>> save_checkpoint("ckpt.pt", state, model=ddp.module, optimizer=opt, step=step)  # doctest: +SKIP
    """
    every_rank_arrives("save_checkpoint", state.process_group, arrival_timeout)
    full = gather_state_dict(state)
    if dist.get_rank(state.process_group) == 0:
        payload = {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in objects.items()}
        payload["scape"] = full
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(payload, tmp)
        os.replace(tmp, path)
    dist.barrier(group=state.process_group)


def load_checkpoint(path: str | os.PathLike, state: ScapeState, **objects: Any) -> dict[str, Any]:
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
    state.check_loadable(payload["scape"])
    for key, obj in objects.items():
        obj.load_state_dict(payload[key])
    state.load_state_dict(payload["scape"])
    return payload


def every_rank_arrives(what: str, group: dist.ProcessGroup | None, timeout: float) -> None:
    """Raise ``RuntimeError`` unless every rank of ``group`` also calls ``what`` within ``timeout`` seconds.

    Each call is matched by its number on this rank (the n-th ``what`` of every rank) through the
    process group's key-value store, not through a collective: a rank that never comes leaves no
    half-matched collective behind. This rank raises; the others fail at their next collective
    once it exits. A rank that arrives after another gave up raises too. Each rank keeps one key
    in the store (its latest call's), so frequent checkpoints do not fill it.

    Example:
        >>> every_rank_arrives("save_checkpoint", None, timeout=30.0)  # doctest: +SKIP
    """
    world = dist.get_world_size(group)
    if world == 1:
        return
    pg = group if group is not None else dist.group.WORLD
    rank = dist.get_rank(group)
    number = _calls[what, pg.group_name] = _calls.get((what, pg.group_name), -1) + 1
    store = distributed_c10d._get_process_group_store(pg)  # the group's own store (no public accessor)
    prefix = f"scape/{what}/{number}"
    if number:  # every rank passed the previous call (its collective followed): its key is spent
        store.delete_key(f"scape/{what}/{number - 1}/{rank}")
    store.set(f"{prefix}/{rank}", "1")
    try:
        store.wait([f"{prefix}/{r}" for r in range(world)], timedelta(seconds=timeout))
    except dist.DistStoreError:
        missing = [r for r in range(world) if not store.check([f"{prefix}/{r}"])]
        store.set(f"{prefix}/abandoned", str(rank))
        raise RuntimeError(
            f"{what} is collective: every rank must call it. Rank(s) {missing} of {world} did not call it within "
            f"{timeout:g} s of rank {rank}: call {what} on every rank (not under `if rank == 0:`; rank 0 alone "
            f"writes the file). If a rank is legitimately that late, pass arrival_timeout=<seconds>.") from None
    if store.check([f"{prefix}/abandoned"]):
        raise RuntimeError(f"{what} is collective: rank {store.get(f'{prefix}/abandoned').decode()} stopped waiting "
                           f"for this rank after {timeout:g} s; call {what} on every rank at the same point")


def _refuse_scape_state_in_adam(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Step pre-hook of every optimizer: an Adam/AdamW holding AdamS state fails here, saying why."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return None
    for group in optimizer.param_groups:
        for p in group["params"]:
            held = optimizer.state.get(p)
            if not held:
                continue
            if MOMENTUM in held and "exp_avg_sq" not in held:  # torch would raise KeyError: 'exp_avg_sq'
                raise RuntimeError(
                    f"this {type(optimizer).__name__} was loaded with optimizer state saved by SCAPE's AdamS "
                    "('exp_avg' without 'exp_avg_sq'): the checkpoint is a SCAPE checkpoint. Resume it with SCAPE, "
                    "as it was trained: Lightning Trainer(strategy='scape') or Fabric(strategy='scape') after "
                    "`import lightning_scape`, Accelerate ScapePlugin().prepare(...), plain DDP "
                    "scape_core.load_checkpoint. To continue without SCAPE, load only the model weights (Lightning: "
                    "model.load_state_dict(torch.load(path)['state_dict']), no ckpt_path) and start a new optimizer.")
            return None
    return None


_ADAM_GUARD = register_optimizer_step_pre_hook(_refuse_scape_state_in_adam)
