"""Single-file checkpoints for plain DDP: every rank's SCAPE state plus model and optimizer."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from scape_core.state import ScapeState, gather_state_dict


def save_checkpoint(path: str | os.PathLike, state: ScapeState, **objects: Any) -> None:
    """Write one checkpoint from rank 0 (collective: call on every rank).

    ``objects`` are anything with ``state_dict()`` (model, optimizer, scheduler) or plain
    values. The file is written to a temporary name and renamed, so a crash mid-write never
    leaves a truncated checkpoint under ``path``.

    Example:
        >>> import tempfile, os
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
