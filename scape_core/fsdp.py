"""SCAPE across the replicate dimension of FSDP2 ("custom HSDP"): shard inside a node, sparse across nodes.

FSDP2 (``torch.distributed.fsdp.fully_shard``) on a 1-D mesh over a node's ranks (the *shard
group*) reduce-scatters each parameter group's gradients and hands the result, one flat tensor
(each parameter's dim-0 shard, padded, concatenated), to ``FSDPModule.set_all_reduce_hook``:
the exchange across the replicate dimension is then the hook's, in place. Every replica of a
shard holds the same shard, the same ``m`` and the same windows, so SCAPE runs on the *replicate
group* exactly as on DDP's ranks, one shard at a time:

- the residual is this replica's unsent share of its shard's reduce-scattered gradient;
- the mask is selected from replicated values by every replica itself (no mask bytes);
- each parameter group's compact buffer of ``grad + residual`` on the mask crosses the replicate
  group (one all-reduce, or an encoded wire's two stages, :mod:`scape_core.wire`);
- :class:`ScapeFSDPAdamS` applies the masked update rule to the local shards of the DTensor
  parameters, bit-identical on every replica. Optimizer state is sharded inside the node by
  construction (it covers the local shards only).

Dense steps (warm-up, ``sparsity=0``) are HSDP: sum over the replicate group, divided by its
size (gloo's ``AVG`` is not used). A non-finite gradient anywhere skips the step everywhere: it
travels as NaN across the replicate group, and one 1-byte-per-rank flag crosses the shard group
(intra-node) at the optimizer step, so every shard skips together.

Example::

    mesh = init_device_mesh("cuda", (nodes, gpus_per_node), mesh_dim_names=("replicate", "shard"))
    model, opt = scape_fsdp(model, mesh, sparsity=0.99, lr=3e-4, shard_modules=model.layers)
"""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from scape_core import exchange, inflight
from scape_core.buckets import BucketPlan, StepRecord
from scape_core.config import ScapeConfig
from scape_core.masks import Mask
from scape_core.model import parameter_names
from scape_core.optimizer import ScapeAdamS
from scape_core.state import ScapeStateBase


def _fsdp2() -> tuple[type, Callable[..., Any], type]:
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor
    return FSDPModule, fully_shard, DTensor


@dataclass
class ParamGroup:
    """One FSDP2 parameter group (one ``fully_shard`` call) as SCAPE sees it.

    ``names`` are its trainable parameters in FSDP's order; they take rows ``[start, stop)`` of
    the layout. ``split`` cuts the hook's flat tensor into each parameter's coordinates and its
    dim-0 padding, alternately (``offsets``: where each parameter starts); ``numel`` is that
    tensor's size.
    """

    index: int
    module_fqn: str
    module: nn.Module  # the FSDPModule whose hook this group is
    names: tuple[str, ...]
    params: list[Tensor]  # the DTensor parameters
    split: list[int]
    numel: int
    start: int = 0  # set once the layout exists
    stop: int = 0
    offsets: list[int] = field(default_factory=list)

    def region(self, state: "ScapeFSDPState", output: Tensor) -> BucketPlan:
        """The group's reduce-scatter ``output`` as a region of SCAPE's exchange: resolved once, then
        pointed at each step's output (FSDP2 allocates it anew; its parameters and offsets never change)."""
        grads = [x.view_as(p._local_tensor) for x, p in zip(output.split(self.split)[::2], self.params)]
        key = (self.index, 0)
        plan = state.buckets.plans.get(key)
        if plan is None:
            return state.buckets.region(key, list(self.names), grads, self.offsets)
        state.buckets.repoint(plan, grads)
        return plan


def check_fsdp_config(config: ScapeConfig) -> None:
    """Refuse what FSDP2 cannot take (the adapters call it at construction, before anything launches).

    Example:
        >>> check_fsdp_config(ScapeConfig(shard_optimizer=True))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: shard_optimizer=True is not supported with FSDP2: its optimizer state is the local shards ...
    """
    if config.shard_optimizer:
        raise ValueError("shard_optimizer=True is not supported with FSDP2: its optimizer state is the local shards "
                         "already (sharded inside the node)")


ONE_REPLICA = ("SCAPE: the replicate group has one rank (a (1, N) mesh): there is nothing to exchange across "
               "replicas, so stats() reports 0 bytes and compression 1.0, but sparse steps still update only each "
               "step's mask, which is not AdamS. With one replica use FSDP2 and scape_core.AdamS (or sparsity=0)")
SYNCED_TWICE = ("the FSDP all-reduce hook ran twice for {name!r}'s group without ScapeFSDPAdamS.step() in between: "
                "every sync flushes residuals that only the SCAPE optimizer applies (accumulate under "
                "model.set_requires_gradient_sync(False))")


class ScapeFSDPState(ScapeStateBase):
    """SCAPE's state for an FSDP2 model sharded on a 1-D mesh, over a replicate group.

    Registers one all-reduce hook per FSDP2 parameter group; pair it with :class:`ScapeFSDPAdamS`
    (or build both with :func:`scape_fsdp`). Tuning is :class:`~scape_core.ScapeState`'s
    (:class:`ScapeConfig`, ``kernels="compiled"`` included); ``shard_optimizer`` is refused (FSDP
    shards the state already). Everything but the FSDP2-specific parts (its parameter groups,
    the skip flag across the shard group, the DCP form of the state) is the DDP path's: the
    exchange (:mod:`scape_core.exchange`), the step's record, the masked step and the stats.

    Args:
        model: the model after ``fully_shard(..., mesh=<1-D shard mesh>)`` on it (and its blocks).
        replicate_group: the ranks holding the same shards (one per node).
        sparsity: shorthand for ``ScapeConfig.sparsity``.
        config: a full :class:`ScapeConfig`; other keyword arguments override its fields.
        max_steps: the run's optimizer steps, if known (the start-of-run line warns when they end
            before the target density; see :meth:`~scape_core.ScapeState.announce`).

    Example:
        >>> for block in model.layers: fully_shard(block, mesh=mesh["shard"])   # doctest: +SKIP
        >>> fully_shard(model, mesh=mesh["shard"])                               # doctest: +SKIP
        >>> state = ScapeFSDPState(model, mesh.get_group("replicate"), sparsity=0.99)  # doctest: +SKIP
        >>> opt = ScapeFSDPAdamS(model.parameters(), state, lr=3e-4)             # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, replicate_group: dist.ProcessGroup, sparsity: float | None = None, *,
                 config: ScapeConfig | None = None, max_steps: int | None = None, **fields: Any) -> None:
        self._configure(sparsity, config, fields, max_steps)
        check_fsdp_config(self.config)
        if not isinstance(replicate_group, dist.ProcessGroup):
            raise TypeError(f"replicate_group must be a ProcessGroup (e.g. mesh.get_group('replicate')), got "
                            f"{type(replicate_group).__name__}")
        self.groups, self.shard_group = _param_groups(model)
        params: dict[str, Tensor] = {n: p for g in self.groups for n, p in zip(g.names, g.params)}
        # the native wire's dtype is each group's reduce dtype (StepRecord.dtype)
        self._build(params, {n: p._local_tensor for n, p in params.items()}, torch.float32, replicate_group)
        self._check_replicas()
        for g in self.groups:
            first, last = self.layout.first_row, g.names[-1]
            g.start, g.stop = first[g.names[0]], first[last] + self.layout.nrows[last]
            g.offsets = [sum(g.split[:2 * i]) for i in range(len(g.names))]
        for g in self.groups:
            g.module.set_all_reduce_hook(partial(self.reduce, g))  # type: ignore[attr-defined]
        if self.comm.world_size == 1 and dist.get_rank() == 0:
            warnings.warn(ONE_REPLICA, stacklevel=2)

    def new_record(self) -> StepRecord:
        return StepRecord(self.buckets, already=SYNCED_TWICE)

    # ----- setup checks -----------------------------------------------------------------
    def _check_replicas(self) -> None:
        """Every member of the replicate group must hold the same shards (same layout): one all-gather."""
        mine = torch.tensor([self.layout.rows, sum(self.layout.numel.values()),
                             dist.get_rank(self.shard_group) if self.shard_group is not None else 0],
                            device=self.layout.device)  # where the backend (NCCL) wants it
        every = [torch.zeros_like(mine) for _ in range(self.comm.world_size)]
        inflight.collective(dist.all_gather, every, mine, group=self.comm.process_group)
        if any(not torch.equal(e, mine) for e in every):
            raise ValueError("replicate_group's ranks hold different shards (rows, coordinates, shard rank per "
                             f"rank: {[e.tolist() for e in every]}): pass the group of the ranks with the same "
                             "shard rank, e.g. mesh.get_group('replicate') of a (replicate, shard) mesh")

    # ----- the hook -----------------------------------------------------------------------
    @torch.no_grad()
    def reduce(self, g: ParamGroup, output: Tensor) -> None:
        """FSDP2's all-reduce hook of group ``g``: ``output`` (the shard group's mean gradient shard,
        flat) becomes the replicate group's mean (dense) or the mean on the mask, zeros elsewhere
        (sparse: the group's own exchange, :mod:`scape_core.exchange`, waited for here)."""
        if output.numel() != g.numel:
            raise RuntimeError(f"FSDP group {g.module_fqn or 'root'!r} reduced {output.numel()} values, SCAPE expected "
                               f"{g.numel}: some of its trainable parameters {list(g.names)} got no gradient this "
                               "step. Freeze unused parameters (requires_grad=False) before fully_shard")
        region = g.region(self, output)
        self.record.sync(region.names)
        dense_bytes = output.numel() * output.element_size()
        mask = self.current_mask()
        if mask is None:  # HSDP: sum over the replicas, divided by their number
            self.record.count(output.numel(), dense_bytes, dense_bytes)
            inflight.collective(dist.all_reduce, output, group=self.comm.process_group)
            exchange.finish_dense(self.record, output.div_(self.comm.world_size))
            return
        if not self.sparse_started:
            self.start_sparse()
        self.record.count(0, 0, dense_bytes)
        spans = self.layout.mask_shape(mask.density).rows_spans(g.start, g.stop)
        part = StepRecord(self.buckets, dtype=output.dtype)
        part.open(mask, self.layout, base=spans, narrow=self.exchanger.path.narrow, rows=(g.start, g.stop))
        part.add_region(region, output)  # the group: the exchange's one region
        exchange.run(self.exchanger, part)
        self.record.absorb(part, spans, mask.flat(self.layout))

    # ----- the optimizer step -------------------------------------------------------------
    def unsynchronized(self, missing: list[str]) -> str:
        return (f"gradients of {missing[:3]} were not synchronized by SCAPE's FSDP hook: run the backward through "
                "the fully_shard model (and ScapeFSDPAdamS.step() once per backward)")

    def agree(self, skip: Tensor) -> Tensor:
        """One 1-byte flag across the shard group (intra-node): every shard of the replica skips together."""
        bad = skip.to(torch.uint8).view(1)
        if self.shard_group is not None and dist.get_world_size(self.shard_group) > 1:
            inflight.collective(dist.all_reduce, bad, op=dist.ReduceOp.MAX, group=self.shard_group)
        return bad[0] > 0

    # ----- checkpoints --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's SCAPE state (its shard, its replica's residual): step, masks, residual, windows,
        counters. Tensors stay on the device; :func:`save_fsdp_checkpoint` writes it with DCP."""
        self.selector.finish_pending()
        masks = {str(t): m.cols for t, m in self.masks.items()}
        meta = dict(step=self.step, config=self.config.to_dict(), rows=self.layout.rows, mesh=self.mesh(),
                    densities={str(t): m.density for t, m in self.masks.items()}, sparse_started=self._sparse,
                    counters=dict(self.comm.counters), residual=self.buffers.residual is not None,
                    windows=self.buffers.windows is not None)
        out: dict[str, Any] = dict(meta=json.dumps(meta), masks=masks, skipped=self.skipped)  # text: not flattened
        if self.buffers.residual is not None:
            out["residual"] = self.buffers.residual
        if self.buffers.windows is not None:
            out["windows"] = self.buffers.windows
        return out

    def mesh(self) -> list[int]:
        """``[replicas, this replica's rank, shards, this shard's rank]``: where this rank's state belongs."""
        shards = dist.get_world_size(self.shard_group) if self.shard_group is not None else 1
        shard = dist.get_rank(self.shard_group) if self.shard_group is not None else 0
        return [self.comm.world_size, self.comm.rank, shards, shard]

    def check_mesh(self, meta: dict[str, Any]) -> None:
        """Refuse a state saved at another mesh (every rank decides alike, before anything loads)."""
        saved = meta.get("mesh")
        here = (self.comm.world_size, self.mesh()[2])
        if saved is not None and (saved[0], saved[2]) != here:
            raise ValueError(f"this FSDP2 checkpoint was saved on a ({saved[0]}, {saved[2]}) (replicate, shard) mesh, "
                             f"this run has {here}: SCAPE's residuals and masks belong to their shard and replica, so "
                             "resume at the saved mesh")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the same rank's, at the same mesh)."""
        meta = json.loads(state["meta"])
        self.check_mesh(meta)
        if meta["rows"] != self.layout.rows:
            raise ValueError(f"SCAPE state of {meta['rows']} rows, this shard has {self.layout.rows}: resume at the "
                             "same mesh and model")
        self.config.check_resume(meta["config"], meta["step"], [int(t) for t in meta["densities"]])
        self.restore(masks={int(t): Mask(meta["densities"][t], cols.to(self.layout.device))
                            for t, cols in state["masks"].items()},
                     step=meta["step"], sparse_started=meta["sparse_started"], counters=meta["counters"],
                     skipped=int(state["skipped"]), residual=state["residual"] if meta["residual"] else None,
                     windows=state["windows"] if meta["windows"] else None)


class ScapeFSDPAdamS(ScapeAdamS):
    r"""AdamS on the local shards of FSDP2's DTensor parameters, with SCAPE's masked update.

    :class:`~scape_core.ScapeAdamS` itself on each parameter's local shard: dense steps are
    :class:`AdamS`, sparse steps the rule of ``state.config.update`` on the mask (the window sum
    :math:`s_j` the hook left in the gradient), decoupled weight decay on every coordinate, eager
    or compiled (``kernels``). Every input is replicated across the replicate group, so each
    replica's shard stays bit-identical. ``m`` and the rule's statistics are flat buffers over
    the local shards (``optimizer.state[p]`` holds views shaped as the local shard); ``betas`` and
    ``eps`` must be the same in every parameter group.

    Example:
        >>> opt = ScapeFSDPAdamS(model.parameters(), state, lr=3e-4, weight_decay=0.1)  # doctest: +SKIP
    """

    _every_gradient = True  # each group's exchange covers all of its parameters

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], state: ScapeFSDPState,
                 lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, foreach: bool | None = None) -> None:
        super().__init__(params, state, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach)

    @staticmethod
    def _check_state(state: Any) -> None:
        if not isinstance(state, ScapeFSDPState):
            raise TypeError(f"state must be a ScapeFSDPState, got {type(state).__name__}")

    @staticmethod
    def _local(p: Tensor) -> Tensor:
        return p._local_tensor  # type: ignore[attr-defined]

    @staticmethod
    def _grad(p: Tensor) -> Tensor:
        return p.grad._local_tensor  # type: ignore[union-attr]

    def _unknown(self, p: Tensor) -> str:
        return (f"a parameter of shape {tuple(p.shape)} is not in an FSDP2 group of this ScapeFSDPState (added "
                "after fully_shard, or not part of the model?)")


def fsdp_rank_state(optimizer: ScapeFSDPAdamS, check: bool = True) -> dict[str, Any]:
    """This rank's optimizer and SCAPE state as DCP saves it beside the model: ``{"rank<r>": {...}}``.

    Each rank's entry has its own key (its shards differ; DCP would keep one copy of a plain tensor
    saved under one key by every rank). For frameworks that write the checkpoint themselves
    (Lightning's ``optimizer_state``); :func:`load_fsdp_checkpoint` reads it back. Collective when
    ``check`` (a save): the replicas' state is compared first (:mod:`scape_core.replicas`).

    Example:
        >>> dcp.save({"model": model.state_dict(), **fsdp_rank_state(opt)}, checkpoint_id=path)  # doctest: +SKIP
    """
    if check:  # DCP saves on every rank: the replicas agree before anything is written
        optimizer.scape.check_replicas()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    opt = dict(momentum=optimizer.momentum_buffer, steps=optimizer.steps, **optimizer.statistics,
               groups=json.dumps(groups))  # text: DCP would flatten a dict into one entry per value
    return {f"rank{dist.get_rank()}": dict(optimizer=opt, scape=optimizer.scape.state_dict())}


def save_fsdp_checkpoint(checkpoint_id: str, model: nn.Module, optimizer: ScapeFSDPAdamS) -> None:
    """Save model, optimizer and SCAPE state with ``torch.distributed.checkpoint`` (collective).

    Parameters are saved as DTensors; ``m``, the rule's statistics, the residual, the windows, the
    masks and the step are each rank's own entry (:func:`fsdp_rank_state`), so
    :func:`load_fsdp_checkpoint` at the same mesh resumes bit-for-bit.

    Example:
        >>> save_fsdp_checkpoint("ckpt/step_1000", model, opt)   # doctest: +SKIP
        >>> load_fsdp_checkpoint("ckpt/step_1000", model, opt)   # doctest: +SKIP
    """
    import torch.distributed.checkpoint as dcp
    dcp.save({"model": model.state_dict(), **fsdp_rank_state(optimizer)}, checkpoint_id=checkpoint_id)


def load_fsdp_checkpoint(checkpoint_id: Any, model: nn.Module, optimizer: ScapeFSDPAdamS | None, *,
                         model_key: str = "model", optimizer_key: str | None = None) -> None:
    """Load :func:`save_fsdp_checkpoint`'s checkpoint into ``model`` and ``optimizer`` (collective; same mesh).

    ``model_key`` and ``optimizer_key`` say where the model's state dict and the ranks' entries of
    :func:`fsdp_rank_state` sit (Lightning writes them under ``"state_dict"`` and ``"optimizer_0"``);
    ``optimizer=None`` loads the model only.

    Example:
        >>> load_fsdp_checkpoint("ckpt/step_1000", model, opt)   # doctest: +SKIP
    """
    import torch.distributed.checkpoint as dcp
    if isinstance(checkpoint_id, (str, os.PathLike)) and os.path.isfile(checkpoint_id):
        raise ValueError(f"{str(checkpoint_id)!r} is a file, not an FSDP2 checkpoint folder (DCP): a save_checkpoint "
                         "file of the DDP path loads with scape_core.load_checkpoint(path, state, ...)")
    entries: dict[str, Any] = {model_key: model.state_dict()}
    _check_same_model(checkpoint_id, model_key, entries[model_key])  # before anything loads, alike on every rank
    if optimizer is not None:
        key = f"rank{dist.get_rank()}"
        nest = (lambda entry: {optimizer_key: entry}) if optimizer_key else (lambda entry: entry)  # noqa: E731
        unnest = (lambda tree: tree[optimizer_key]) if optimizer_key else (lambda tree: tree)  # noqa: E731
        head: dict[str, Any] = nest({key: {"scape": {"meta": ""}}})
        dcp.load(head, checkpoint_id=checkpoint_id)  # first the shapes: which masks, which buffers
        text = unnest(head)[key]["scape"]["meta"]
        meta = json.loads(text)
        state, layout = optimizer.scape, optimizer.scape.layout
        state.check_mesh(meta)  # before the model or anything else is loaded
        scape: dict[str, Any] = dict(meta=text, skipped=torch.zeros_like(state.skipped),
                                     masks={t: torch.zeros(layout.rows, layout.mask_shape(d).k, dtype=torch.int16)
                                            for t, d in meta["densities"].items()})
        for name in ("residual", "windows"):
            if meta[name]:
                scape[name] = layout.zeros()
        mine = fsdp_rank_state(optimizer, check=False)  # the structure to load into
        mine[key]["scape"] = scape
        entries.update(nest(mine))
    dcp.load(entries, checkpoint_id=checkpoint_id)  # the optimizer's buffers in place
    model.load_state_dict(entries[model_key])
    if optimizer is not None:
        for group, saved in zip(optimizer.param_groups, json.loads(mine[key]["optimizer"]["groups"])):
            group.update(saved, betas=tuple(saved["betas"]))
        state.load_state_dict(scape)


def _check_same_model(checkpoint_id: Any, model_key: str, state_dict: dict[str, Any]) -> None:
    """Refuse a DCP folder saved for another model (its metadata's parameter names differ), as the DDP path does."""
    if not isinstance(checkpoint_id, (str, os.PathLike)) or not os.path.isdir(checkpoint_id):
        return  # a storage reader of the user's own: DCP's load reports what is missing
    import torch.distributed.checkpoint as dcp
    prefix = f"{model_key}."
    saved = {k[len(prefix):] for k in dcp.FileSystemReader(checkpoint_id).read_metadata().state_dict_metadata
             if k.startswith(prefix)}
    diff = sorted(saved ^ set(state_dict))
    if diff:
        raise ValueError(f"FSDP2 checkpoint {str(checkpoint_id)!r} was saved for another model: parameters differ "
                         f"at {diff[:5]}")


def scape_fsdp(model: nn.Module, mesh: Any, sparsity: float | None = None, *, lr: float = 1e-3,
               betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
               shard_modules: Iterable[nn.Module] = (), config: ScapeConfig | None = None,
               max_steps: int | None = None, **fields: Any) -> tuple[nn.Module, ScapeFSDPAdamS]:
    """Shard ``model`` with FSDP2 inside each replica and run SCAPE across replicas, in one call.

    ``mesh`` is a 2-D ``DeviceMesh`` in (replicate, shard) order, named (e.g. one row per node):
    each of ``shard_modules`` (e.g. the transformer blocks), then ``model``, is ``fully_shard``-ed
    on the inner (shard) dimension, and SCAPE exchanges the sparse gradients over the outer one.
    ``sparsity``, ``config`` and ``fields`` configure SCAPE (:class:`ScapeConfig`), the rest the
    optimizer; ``max_steps`` (the run's optimizer steps, if known) lets the start-of-run line, logged
    on rank 0 at the first step, warn when the run ends before the target density. Returns the
    sharded model (the same object, now an ``FSDPModule``) and its :class:`ScapeFSDPAdamS`
    (``optimizer.scape`` is the :class:`ScapeFSDPState`).

    Example (one process here; on 2 nodes of 8 GPUs: ``init_device_mesh("cuda", (2, 8), ...)``,
    and ``shard_modules=model.layers`` for a transformer):
        >>> from torch.distributed.device_mesh import init_device_mesh
        >>> mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard"))
        >>> model, opt = scape_fsdp(nn.Linear(4, 2), mesh, sparsity=0.99, lr=1e-3, warmup_steps=1)
        >>> for step in range(3):
        ...     model(torch.randn(3, 4)).sum().backward(); opt.step(); opt.zero_grad()
        >>> opt.scape.stats()["steps"], type(model.weight).__name__
        (3, 'DTensor')
    """
    fsdp_module, fully_shard, dtensor = _fsdp2()
    from torch.distributed.device_mesh import DeviceMesh
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh must be a torch DeviceMesh (init_device_mesh), got {type(mesh).__name__}")
    if mesh.ndim != 2:
        what = ("has no replicate dimension: SCAPE communicates across replicas; use a (replicate, shard) mesh, "
                "e.g. init_device_mesh(device, (nodes, ranks_per_node), mesh_dim_names=('replicate', 'shard'))"
                if mesh.ndim == 1 else "has more than 2 dimensions: tensor / pipeline parallelism with SCAPE is "
                "not supported; pass the 2-D (replicate, shard) data-parallel mesh")
        raise ValueError(f"mesh is {mesh.ndim}-D and {what}")
    if mesh.mesh_dim_names is None:
        raise ValueError("mesh needs dimension names, e.g. mesh_dim_names=('replicate', 'shard')")
    replicate, shard = mesh.mesh_dim_names
    if replicate == "shard" or shard == "replicate":  # read by position: names saying the opposite mislead
        raise ValueError(f"mesh dimensions are named {mesh.mesh_dim_names}, but scape_fsdp reads them in (replicate, "
                         "shard) order (FSDP2 shards over the second, SCAPE exchanges over the first): build the "
                         "mesh as init_device_mesh(device, (replicas, ranks_per_replica), mesh_dim_names=('replicate', "
                         "'shard'))")
    _refuse_wrapped(model, fsdp_module, dtensor)
    for module in shard_modules:
        fully_shard(module, mesh=mesh[shard])
    fully_shard(model, mesh=mesh[shard])
    state = ScapeFSDPState(model, mesh.get_group(replicate), sparsity, config=config, max_steps=max_steps, **fields)
    return model, ScapeFSDPAdamS(model.parameters(), state, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)


def _refuse_wrapped(model: nn.Module, fsdp_module: type, dtensor: type) -> None:
    """``model`` must be a plain module: not FSDP1, not already FSDP2, no DTensor (tensor-parallel) parameters."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise TypeError("model contains FSDP1 (FullyShardedDataParallel) modules: SCAPE's FSDP path needs FSDP2; "
                        "pass the unwrapped model to scape_fsdp, which applies fully_shard itself")
    if any(isinstance(m, fsdp_module) for m in model.modules()):
        raise ValueError("model is already sharded with fully_shard: pass the unsharded model to scape_fsdp, or "
                         "build ScapeFSDPState(model, replicate_group) for a model sharded on a 1-D mesh")
    bad = [n for n, p in model.named_parameters() if isinstance(p, dtensor)]
    if bad:
        raise ValueError(f"model has DTensor parameters ({bad[0]!r}, ...): tensor parallelism is not supported "
                         "with SCAPE's FSDP path")


def _param_groups(model: nn.Module) -> tuple[list[ParamGroup], dist.ProcessGroup | None]:
    """Every FSDP2 parameter group of ``model`` with trainable parameters, and their shard group."""
    fsdp_module = _fsdp2()[0]
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.tensor import Shard
    if any(isinstance(m, FullyShardedDataParallel) for m in model.modules()):
        raise TypeError("model contains FSDP1 (FullyShardedDataParallel) modules: SCAPE's FSDP path needs FSDP2 "
                        "(torch.distributed.fsdp.fully_shard)")
    names = {id(p): n for n, p in parameter_names(model).items()}
    groups: list[ParamGroup] = []
    shard_groups = set()
    for fqn, module in model.named_modules():
        if not isinstance(module, fsdp_module):
            continue
        # FSDP2 names no public way to its parameter groups (their padding, placements and shard group):
        # private, pinned by tests/test_private_names.py
        found = module._get_fsdp_state()._fsdp_param_groups  # type: ignore[attr-defined]
        if len(found) > 1:
            raise ValueError(f"module {fqn or 'root'!r} has {len(found)} FSDP parameter groups (shard_placement_fn "
                             "with per-parameter meshes): SCAPE needs one group per fully_shard call")
        for pg in found:
            info = pg.mesh_info
            if getattr(info, "replicate_mesh_dim", None) is not None or info.mesh.ndim != 1:
                raise ValueError(f"module {fqn or 'root'!r} is sharded on a {info.mesh.ndim}-D mesh (HSDP): SCAPE does "
                                 "the replicate dimension itself; fully_shard on the 1-D shard mesh (mesh['shard']) "
                                 "or use scape_fsdp(model, mesh)")
            trainable = [fp for fp in pg.fsdp_params if fp.sharded_param.requires_grad]
            if not trainable:
                continue
            for fp in trainable:
                if fp.fsdp_placement != Shard(0):
                    raise ValueError(f"parameter {names.get(id(fp.sharded_param))!r} is sharded as "
                                     f"{fp.fsdp_placement}: SCAPE supports dim-0 sharding only (no shard_placement_fn)")
            shard_groups.add(info.shard_process_group)
            params = [fp.sharded_param for fp in trainable]
            split: list[int] = []
            for fp in trainable:
                numel, padded = fp.sharded_param._local_tensor.numel(), math.prod(fp.padded_sharded_param_size)
                split += [numel, padded - numel]
            groups.append(ParamGroup(len(groups), fqn, module, tuple(names[id(p)] for p in params), params,
                                     split, sum(split)))
    if not groups:
        raise TypeError(f"model ({type(model).__name__}) has no FSDP2 parameter group with trainable parameters: "
                        "shard it with torch.distributed.fsdp.fully_shard on the 1-D shard mesh first "
                        "(or use scape_fsdp(model, mesh))")
    if len(shard_groups) > 1:
        raise ValueError("the model's fully_shard calls use different meshes: SCAPE needs one shard mesh")
    return groups, shard_groups.pop()

