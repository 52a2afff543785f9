"""SCAPE state in checkpoints: keyed by parameter name, validated before anything changes, resharded.

- :func:`state_dict` / :func:`load_state_dict`: one rank's state (what ``ScapeState.state_dict``
  returns), or every rank's in one object (:func:`gather_state_dict`).
- :func:`check_loadable`: a saved state against this run (model, sparsity, layout, world size).
- :func:`save_checkpoint` / :func:`load_checkpoint`: one atomic file for plain DDP scripts.
- :func:`verify_file`: a torch file's zip records against their CRC-32s, before anything loads
  (``torch.load`` does not check them); every SCAPE load path and adapter calls it.

At the same world size every rank gets its own residual back; at another, every rank starts
from the old ranks' mean residual (the global unsent gradient is kept), with a warning.

It reads a state through the pieces :class:`Checkpointable` names (which ``ScapeState`` and
``ScapeFSDPState`` have), restores it through their ``restore``, and imports no module that imports it.
"""

from __future__ import annotations

import os
import warnings
import zipfile
from datetime import timedelta
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import distributed_c10d

from scape_core import inflight
from scape_core.buffers import Buffers
from scape_core.communicator import Communicator
from scape_core.config import ScapeConfig
from scape_core.guard import refuse_adam_with_scape_state
from scape_core.layout import FlatLayout, Shard
from scape_core.masks import Mask
from scape_core.selection import MaskSelector
from scape_core.sharding import ShardExchange

STATE_FORMAT = 2
ARRIVAL_TIMEOUT = 30.0  # seconds every rank has to reach save_checkpoint after the first one did
_calls: dict[tuple[str, str], int] = {}  # (what, process group) -> collective calls started on this rank


class Checkpointable(Protocol):
    """What a checkpoint reads of a SCAPE state and how it restores one (``ScapeState`` is one)."""

    config: ScapeConfig
    params: dict[str, Tensor]  # the parameters by name
    buffers: Buffers  # the residual and the windows
    comm: Communicator  # the group, this rank, the counters
    selector: MaskSelector  # the scheduled masks
    shards: ShardExchange  # the rows of the windows this rank keeps
    sharded: bool
    step: int

    @property
    def layout(self) -> FlatLayout: ...

    @property
    def shard(self) -> Shard: ...

    @property
    def masks(self) -> dict[int, Mask]: ...

    @property
    def sparse_started(self) -> bool: ...

    @property
    def skipped_steps(self) -> int: ...

    def check_replicas(self) -> None: ...

    def restore(self, *, masks: dict[int, Mask], step: int, sparse_started: bool, counters: dict[str, int],
                skipped: int, residual: dict[str, Tensor] | Tensor | None,
                windows: dict[str, Tensor] | Tensor | None) -> None: ...


def state_dict(state: Checkpointable) -> dict[str, Any]:
    """This rank's state: step, scheduled masks, residual and windows by name, counters (CPU tensors).

    Sharded, the windows are this rank's part of each parameter's (``"windows_rows"`` says
    which rows); :func:`gather_state_dict` holds every parameter's whole windows.
    """
    state.selector.finish_pending()
    named = lambda buffer: {n: state.layout.view(buffer, n).detach().cpu().clone() for n in state.params}  # noqa: E731
    counters = dict(state.comm.counters, skipped_steps=state.skipped_steps)
    windows = state.buffers.windows
    out = {
        "format": STATE_FORMAT,
        "step": state.step,
        "world_size": state.comm.world_size,
        "rank": state.comm.rank,
        "config": state.config.to_dict(),
        "shapes": {n: tuple(p.shape) for n, p in state.params.items()},
        "masks": {s: {"density": m.density, "cols": m.cols.cpu()} for s, m in state.masks.items()},
        "residual": named(state.buffers.residual) if state.buffers.residual is not None else {},
        "windows": {} if windows is None else {n: state.shard.view(windows, n).cpu().clone() for n in state.params},
        "sparse_started": state.sparse_started,
        "counters": counters,
    }
    if state.sharded:
        out["windows_rows"] = [state.shard.start, state.shard.stop]
    return out


def gather_state_dict(state: Checkpointable) -> dict[str, Any]:
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
    state.check_replicas()  # a checkpoint of ranks that drifted apart would resume the drift
    own = state_dict(state)
    if own.pop("windows_rows", None) is not None and state.buffers.windows is not None:  # every rank's part
        whole = state.shards.unshard(state.buffers.windows)
        own["windows"] = {n: state.layout.view(whole, n).cpu().clone() for n in state.params}
    if state.buffers.residual is not None:
        out = [torch.empty_like(state.buffers.residual) for _ in range(state.comm.world_size)]
        inflight.collective(dist.all_gather, out, state.buffers.residual.contiguous(), group=state.comm.process_group)
        residuals = [{n: state.layout.view(r, n).cpu().clone() for n in state.params} for r in out]
        for r in out:  # the held work keeps these tensors a while longer (inflight): their memory goes now
            r.untyped_storage().resize_(0)
    else:
        residuals = [{} for _ in range(state.comm.world_size)]
    full = {k: v for k, v in own.items() if k not in ("residual", "rank")}
    full["residuals"] = residuals
    return full


def check_loadable(state: Checkpointable, saved: Any) -> dict[str, Tensor]:
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
    if saved["config"].get("chunk_size") != state.config.chunk_size:  # the masks' shape depends on it
        raise ValueError(f"SCAPE state was saved with chunk_size={saved['config'].get('chunk_size')}, this run uses "
                         f"chunk_size={state.config.chunk_size}")
    state.config.check_resume(saved["config"], int(saved["step"]), saved["masks"])
    if "residuals" in saved:  # gathered: one residual dict per saved rank
        per_rank = saved["residuals"]
        if len(per_rank) == state.comm.world_size:
            return per_rank[state.comm.rank]
        names = set().union(*per_rank) if per_rank else set()
        return {n: torch.stack([r[n] for r in per_rank]).float().mean(0) for n in names}
    if saved["world_size"] != state.comm.world_size or saved["rank"] != state.comm.rank:
        raise ValueError(
            f"this SCAPE state is rank {saved['rank']} of world size {saved['world_size']}; "
            f"to resume on rank {state.comm.rank} of {state.comm.world_size}, save with gather_state_dict()")
    rows = saved.get("windows_rows")
    if rows is not None and list(rows) != [state.shard.start, state.shard.stop]:
        raise ValueError(f"this SCAPE state holds the windows of rows {list(rows)} (saved with "
                         f"shard_optimizer=True); this run keeps rows [{state.shard.start}, {state.shard.stop}): "
                         "save with gather_state_dict()")
    return saved["residual"]


def load_state_dict(state: Checkpointable, saved: dict[str, Any]) -> None:
    """Restore a :func:`state_dict` or :func:`gather_state_dict` into ``state`` (validated first)."""
    _restore(state, saved, check_loadable(state, saved))


def _restore(state: Checkpointable, saved: dict[str, Any], residual: dict[str, Tensor]) -> None:
    saved_world = len(saved["residuals"]) if "residuals" in saved else state.comm.world_size
    if saved_world != state.comm.world_size and state.comm.rank == 0:  # once per load, on one rank
        warnings.warn(f"resuming SCAPE state saved at world size {saved_world} on world size {state.comm.world_size}: "
                      "every rank starts from the mean residual", stacklevel=3)
    device = state.layout.device
    windows = saved.get("windows", {})
    if "windows_rows" not in saved:  # whole windows: this rank takes its part of each
        windows = {name: state.shard.part(v, name) for name, v in windows.items()}
    counters = dict(saved["counters"])
    skipped = int(counters.pop("skipped_steps", 0))
    state.restore(masks={int(s): Mask(float(m["density"]), m["cols"].to(device=device, dtype=torch.int16))
                         for s, m in saved["masks"].items()},
                  step=int(saved["step"]), sparse_started=bool(saved.get("sparse_started")), counters=counters,
                  skipped=skipped, residual=residual, windows=windows)


def save_checkpoint(path: str | os.PathLike, state: Checkpointable, *, arrival_timeout: float | None = None,
                    **objects: Any) -> None:
    """Write one checkpoint from rank 0 (collective: call on every rank).

    ``objects`` are anything with ``state_dict()`` (model, optimizer, scheduler) or plain
    values; a sharded optimizer (``shard_optimizer=True``) is consolidated on rank 0 first, so
    the file holds every parameter's whole state and loads at any world size, sharded or not.
    The file is written to a temporary name and renamed, so a crash mid-write never leaves a
    truncated checkpoint under ``path``. Every rank's residual goes into the file, so
    every rank must call it: a rank that does not see all the others arrive within
    ``arrival_timeout`` seconds (default: ``scape_core.checkpoint.ARRIVAL_TIMEOUT``, 30) raises
    ``RuntimeError`` (the usual cause: saving under ``if rank == 0:``) instead of waiting for the
    process-group timeout.

    Example:
        >>> import tempfile
        >>> from scape_core import ScapeState
        >>> state = ScapeState(ddp, sparsity=0.9)
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
        >>> save_checkpoint(path, state, model=ddp.module, step=0)     # every rank calls it
        >>> sorted(load_checkpoint(path, state, model=ddp.module))
        ['model', 'scape', 'step']
    """
    rank0 = dist.get_rank(state.comm.process_group) == 0
    every_rank_arrives("save_checkpoint", state.comm.process_group, ARRIVAL_TIMEOUT if arrival_timeout is None
                       else arrival_timeout, verdict=unwritable(path) if rank0 else None)
    full = gather_state_dict(state)
    for obj in objects.values():  # a sharded optimizer (ScapeAdamS, torch's ZeroRedundancyOptimizer) gathers first
        if hasattr(obj, "consolidate_state_dict"):
            obj.consolidate_state_dict(to=0)
    if dist.get_rank(state.comm.process_group) == 0:
        payload = {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in objects.items()}
        payload["scape"] = full
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        torch.save(payload, tmp)
        os.replace(tmp, path)
    inflight.collective(dist.barrier, group=state.comm.process_group)


def unwritable(path: str | os.PathLike) -> str | None:
    """Why a checkpoint file cannot be written at ``path`` here (``None``: it can), checked before
    anything is gathered, so that every rank raises the same error instead of waiting for rank 0.

    Example:
        >>> unwritable("/no/such/folder/ckpt.pt")
        'save_checkpoint: the folder /no/such/folder does not exist (create it first, on the machine of rank 0)'
    """
    target = Path(path)
    folder = target.parent
    if target.is_dir():
        return f"save_checkpoint: {target} is a folder; pass a file name (e.g. {target / 'ckpt.pt'})"
    if not folder.is_dir():
        return f"save_checkpoint: the folder {folder} does not exist (create it first, on the machine of rank 0)"
    if not os.access(folder, os.W_OK):
        return f"save_checkpoint: the folder {folder} is not writable"
    return None


def verify_file(path: str | os.PathLike) -> None:
    """Raise ``ValueError`` naming ``path`` and its damaged entry unless every record of the torch
    file at ``path`` matches the CRC-32 written with it.

    ``torch.save`` writes a zip archive whose records each carry a CRC-32 of their bytes, but
    ``torch.load`` never checks them: flipped bytes inside a tensor load silently as other numbers.
    This reads the whole file once (about as long as loading it). A file that is not a zip archive
    (truncated, or saved with ``_use_new_zipfile_serialization=False``) is refused too.

    Example:
        >>> import tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), "ckpt.pt")
        >>> torch.save({"w": torch.ones(3)}, path)
        >>> verify_file(path)              # intact: returns None
    """
    where = str(path)
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()
    except FileNotFoundError:
        raise
    except (zipfile.BadZipFile, OSError, EOFError) as e:  # no intact central directory
        raise ValueError(f"cannot read checkpoint {where!r} (truncated or not a torch zip file): {e}") from e
    except Exception as e:  # zipfile raises zlib / struct errors for a damaged header
        raise ValueError(f"checkpoint {where!r} is damaged: {e}; nothing was loaded") from e
    if damaged is not None:
        raise ValueError(f"checkpoint {where!r} is damaged: its entry {damaged!r} does not match the CRC-32 written "
                         "with it (the bytes on disk changed after saving); nothing was loaded. Resume from an "
                         "intact copy or an earlier checkpoint")


TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".pkl", ".ckpt")  # what torch.save writes in the frameworks' folders


def verify_folder(folder: str | os.PathLike) -> None:
    """:func:`verify_file` on every torch file directly in ``folder`` (its name ends in one of
    :data:`TORCH_SUFFIXES`, or it is a zip archive): an Accelerate ``save_state`` folder, a Trainer
    ``checkpoint-<step>`` folder. Other files (``model.safetensors``, JSON) carry no checksum.

    Example:
        >>> verify_folder(tempfile.mkdtemp())   # doctest: +SKIP
    """
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.is_file() and (entry.name.endswith(TORCH_SUFFIXES) or zipfile.is_zipfile(entry.path)):
            verify_file(entry.path)


def load_checkpoint(path: str | os.PathLike, state: Checkpointable, **objects: Any) -> dict[str, Any]:
    """Restore a :func:`save_checkpoint` file on this rank; returns the whole payload.

    The file and its SCAPE part are validated before anything is changed, so a truncated file,
    a damaged one (:func:`verify_file`), a checkpoint of another model or of another sparsity
    raises ``ValueError`` and leaves the run's own state as it was. At another world size every
    rank gets the mean residual.
    """
    if Path(path).is_dir():
        raise ValueError(f"{str(path)!r} is a folder, not a save_checkpoint file: an FSDP2 checkpoint (DCP) loads with "
                         "scape_core.load_fsdp_checkpoint(path, model, optimizer)")
    verify_file(path)
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
        if isinstance(obj, torch.optim.Optimizer):
            refuse_adam_with_scape_state(obj, payload[key].get("state", {}) if isinstance(payload[key], dict) else {})
    for key, obj in objects.items():
        obj.load_state_dict(payload[key])
    _restore(state, payload["scape"], residual)
    return payload


def every_rank_arrives(what: str, group: dist.ProcessGroup | None, timeout: float, hint: str | None = None,
                       verdict: str | None = None) -> None:
    """Raise ``RuntimeError`` unless every rank of ``group`` also calls ``what`` within ``timeout`` seconds.

    Each call is matched by its number on this rank (the n-th ``what`` of every rank) through the
    process group's key-value store, not through a collective: a rank that never comes leaves no
    half-matched collective behind. This rank raises; the others fail at their next collective
    once it exits. A rank that arrives after another gave up raises too. Each rank keeps one key
    in the store (its latest call's), so frequent checkpoints do not fill it. ``hint``: what the
    error tells the user to do instead (default: call it on every rank). ``verdict``: rank 0's
    reason to stop (e.g. its checkpoint folder does not exist), posted before it arrives: every
    rank then raises the same ``ValueError``, before any collective.

    Example:
        >>> every_rank_arrives("save_checkpoint", None, timeout=30.0)  # doctest: +SKIP
    """
    world = dist.get_world_size(group)
    if world == 1:
        if verdict:
            raise ValueError(verdict)
        return
    pg = group if group is not None else dist.group.WORLD
    rank = dist.get_rank(group)
    number = _calls[what, pg.group_name] = _calls.get((what, pg.group_name), -1) + 1
    store = distributed_c10d._get_process_group_store(pg)  # the group's own store (no public accessor)
    prefix = f"scape/{what}/{number}"
    if number:  # every rank passed the previous call (its collective followed): its key is spent
        store.delete_key(f"scape/{what}/{number - 1}/{rank}")
        if rank == 0:
            store.delete_key(f"scape/{what}/{number - 1}/verdict")
    if rank == 0:
        store.set(f"{prefix}/verdict", verdict or "")  # before arriving: every rank finds it once all arrived
    store.set(f"{prefix}/{rank}", "1")
    try:
        store.wait([f"{prefix}/{r}" for r in range(world)], timedelta(seconds=timeout))
    except dist.DistStoreError:
        missing = [r for r in range(world) if not store.check([f"{prefix}/{r}"])]
        store.set(f"{prefix}/abandoned", str(rank))
        hint = hint or (f"call {what} on every rank (not under `if rank == 0:`; rank 0 alone writes the file). "
                        "If a rank is legitimately that late, pass arrival_timeout=<seconds>")
        raise RuntimeError(f"{what} is collective: every rank must call it. Rank(s) {missing} of {world} did not call "
                           f"it within {timeout:g} s of rank {rank}: {hint}.") from None
    if store.check([f"{prefix}/abandoned"]):
        raise RuntimeError(f"{what} is collective: rank {store.get(f'{prefix}/abandoned').decode()} stopped waiting "
                           f"for this rank after {timeout:g} s; call {what} on every rank at the same point")
    found = store.get(f"{prefix}/verdict").decode()
    if found:
        raise ValueError(found)
