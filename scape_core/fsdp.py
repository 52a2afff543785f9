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
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from scape_core import wire
from scape_core.adams import MOMENTUM, AdamS, check_grad
from scape_core.compat import all_gather_into_tensor
from scape_core.config import ScapeConfig
from scape_core.kernels import masked_update_pass
from scape_core.layout import FlatLayout, Shard, gather_spans, scatter_spans
from scape_core.masks import Mask
from scape_core.model import parameter_names
from scape_core.selection import MaskSelector
from scape_core.state import SparseBuffers
from scape_core.streak import STREAK_CHECK_EVERY, SkipStreak
from scape_core.update_rules import UPDATE_RULES


def _fsdp2() -> tuple[type, Callable[..., Any], type]:
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.tensor import DTensor
    return FSDPModule, fully_shard, DTensor


@dataclass
class ParamGroup:
    """One FSDP2 parameter group (one ``fully_shard`` call) as SCAPE sees it.

    ``names`` are its trainable parameters in FSDP's order; they take rows ``[start, stop)`` of
    the layout. ``split`` cuts the hook's flat tensor into each parameter's coordinates and its
    dim-0 padding, alternately; ``numel`` is that tensor's size.
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
    residual_views: list[Tensor] | None = field(default=None, repr=False)


@dataclass
class FSDPStepRecord:
    """What the hooks did during the current backward, for the optimizer step."""

    outputs: dict[int, Tensor] = field(default_factory=dict)  # group index -> its reduce-scatter output
    plans: dict[int, tuple[Tensor, Tensor, list[tuple[int, int]]]] = field(default_factory=dict)  # sparse:
    # group index -> its mask entries, their positions in the output, their spans (ScapeFSDPState.entries)
    finite: list[Tensor] = field(default_factory=list)  # one 0-dim bool per group: its exchange was finite
    values: Tensor | None = None  # sparse: the exchanged mean at each mask entry (0 where not finite)


class ScapeFSDPState(SparseBuffers):
    """SCAPE's state for an FSDP2 model sharded on a 1-D mesh, over a replicate group.

    Registers one all-reduce hook per FSDP2 parameter group; pair it with :class:`ScapeFSDPAdamS`
    (or build both with :func:`scape_fsdp`). Tuning is :class:`~scape_core.ScapeState`'s
    (:class:`ScapeConfig`); ``shard_optimizer`` is refused (FSDP shards the state already).

    Args:
        model: the model after ``fully_shard(..., mesh=<1-D shard mesh>)`` on it (and its blocks).
        replicate_group: the ranks holding the same shards (one per node).
        sparsity: shorthand for ``ScapeConfig.sparsity``.
        config: a full :class:`ScapeConfig`; other keyword arguments override its fields.

    Example:
        >>> for block in model.layers: fully_shard(block, mesh=mesh["shard"])   # doctest: +SKIP
        >>> fully_shard(model, mesh=mesh["shard"])                               # doctest: +SKIP
        >>> state = ScapeFSDPState(model, mesh.get_group("replicate"), sparsity=0.99)  # doctest: +SKIP
        >>> opt = ScapeFSDPAdamS(model.parameters(), state, lr=3e-4)             # doctest: +SKIP
    """

    def __init__(self, model: nn.Module, replicate_group: dist.ProcessGroup, sparsity: float | None = None, *,
                 config: ScapeConfig | None = None, **fields: Any) -> None:
        if config is not None and not isinstance(config, ScapeConfig):
            raise TypeError(f"config must be a ScapeConfig, got {type(config).__name__}")
        if sparsity is not None:
            fields["sparsity"] = sparsity
        self.config = (config or ScapeConfig()).replace(**fields)
        if self.config.shard_optimizer:
            raise ValueError("shard_optimizer=True is not supported with FSDP2: its optimizer state is the local "
                             "shards already (sharded inside the node)")
        self.schedule = self.config.schedule
        if not isinstance(replicate_group, dist.ProcessGroup):
            raise TypeError(f"replicate_group must be a ProcessGroup (e.g. mesh.get_group('replicate')), got "
                            f"{type(replicate_group).__name__}")
        self.process_group = replicate_group
        self.world_size = dist.get_world_size(replicate_group)
        self.rank = dist.get_rank(replicate_group)
        self.groups, self.shard_group = _param_groups(model)
        self.params: dict[str, Tensor] = {n: p for g in self.groups for n, p in zip(g.names, g.params)}
        self.names = {id(p): n for n, p in self.params.items()}
        self.layout = FlatLayout({n: p._local_tensor for n, p in self.params.items()}, self.config.chunk_size)
        self._check_replicas()
        # flat index of a coordinate + its row's shift = its position in its group's reduce-scatter output
        self.row_shift = torch.zeros(self.layout.rows, dtype=torch.long, device=self.layout.device)
        for g in self.groups:
            first, last = self.layout.first_row, g.names[-1]
            g.start, g.stop = first[g.names[0]], first[last] + self.layout.nrows[last]
            offset = 0
            for i, name in enumerate(g.names):
                rows = self.layout.nrows[name]
                self.row_shift[first[name]:first[name] + rows] = offset - first[name] * self.layout.chunk
                offset += g.split[2 * i] + g.split[2 * i + 1]
        self.counters = dict(steps=0, hook_calls=0, values_sent=0, bytes_sent=0, mask_bytes=0, dense_bytes=0)
        self.selector = MaskSelector(self.layout, self.config, rank=self.rank, world_size=self.world_size,
                                     process_group=replicate_group, counters=self.counters)
        self.step = 0
        self._sparse = False
        self.shard = Shard(self.layout, 0, self.layout.rows)  # the rows whose state this rank keeps: all of its layout
        self.residual_buffer: Tensor | None = None  # (rows, chunk) fp32: this replica's unsent gradient
        self.window_buffer: Tensor | None = None  # (rows, chunk) fp32: the step each coordinate was last exchanged
        self.skipped = torch.zeros((), dtype=torch.long, device=self.layout.device)
        self.streak = SkipStreak(self.config.skip_streak_warning, self.rank, self.layout.device)
        self.record = FSDPStepRecord()
        self._wire_plans: dict[int, wire.WirePlan] = {}
        self.optimizer: Any = None
        for g in self.groups:
            g.module.set_all_reduce_hook(partial(self.reduce, g))  # type: ignore[attr-defined]

    # ----- setup checks -----------------------------------------------------------------
    def _check_replicas(self) -> None:
        """Every member of the replicate group must hold the same shards (same layout): one all-gather."""
        mine = torch.tensor([self.layout.rows, sum(self.layout.numel.values()),
                             dist.get_rank(self.shard_group) if self.shard_group is not None else 0],
                            device=self.layout.device)  # where the backend (NCCL) wants it
        every = [torch.zeros_like(mine) for _ in range(self.world_size)]
        dist.all_gather(every, mine, group=self.process_group)
        if any(not torch.equal(e, mine) for e in every):
            raise ValueError("replicate_group's ranks hold different shards (rows, coordinates, shard rank per "
                             f"rank: {[e.tolist() for e in every]}): pass the group of the ranks with the same "
                             "shard rank, e.g. mesh.get_group('replicate') of a (replicate, shard) mesh")

    def residuals(self, g: ParamGroup) -> list[Tensor]:
        """The group's parameters' views of the residual (resolved once per residual buffer)."""
        if g.residual_views is None:
            g.residual_views = self.layout.views(self.residual_buffer, list(g.names))
        return g.residual_views

    def entries(self, g: ParamGroup, mask: Mask) -> tuple[Tensor, Tensor, list[tuple[int, int]]]:
        """The group's mask entries: flat indices, positions in its reduce-scatter output, and their
        spans among the mask's entries."""
        spans = self.layout.mask_shape(mask.density).rows_spans(g.start, g.stop)
        entries = gather_spans(mask.flat(self.layout), spans)
        rows = torch.div(entries, self.layout.chunk, rounding_mode="floor")
        return entries, entries + self.row_shift.index_select(0, rows), spans

    # ----- the hook -----------------------------------------------------------------------
    @torch.no_grad()
    def reduce(self, g: ParamGroup, output: Tensor) -> None:
        """FSDP2's all-reduce hook of group ``g``: ``output`` (the shard group's mean gradient shard,
        flat) becomes the replicate group's mean (dense) or the mean on the mask, zeros elsewhere (sparse)."""
        if output.numel() != g.numel:
            raise RuntimeError(f"FSDP group {g.module_fqn or 'root'!r} reduced {output.numel()} values, SCAPE expected "
                               f"{g.numel}: some of its trainable parameters {list(g.names)} got no gradient this "
                               "step. Freeze unused parameters (requires_grad=False) before fully_shard")
        if g.index in self.record.outputs:
            raise RuntimeError("the FSDP all-reduce hook ran twice for one group without ScapeFSDPAdamS.step() in "
                               "between: every sync flushes residuals that only the SCAPE optimizer applies "
                               "(accumulate under model.set_requires_gradient_sync(False))")
        self.record.outputs[g.index] = output
        self.counters["hook_calls"] += 1
        dense_bytes = output.numel() * output.element_size()
        self.counters["dense_bytes"] += dense_bytes
        mask = self.current_mask()
        if mask is None:  # HSDP: sum over the replicas, divided by their number
            self._count(output.numel(), dense_bytes)
            dist.all_reduce(output, group=self.process_group)
            output.div_(self.world_size)
            self.record.finite.append(torch.isfinite(output).all())
            return
        if not self.sparse_started:
            self.start_sparse()
        entries, positions, spans = self.record.plans[g.index] = self.entries(g, mask)
        finite = torch.isfinite(output).all()
        picked = output.index_select(0, positions).float()  # a_r = g_r + e_r on the mask
        if self.residual_buffer is not None:
            picked += self.residual_buffer.view(-1).index_select(0, entries)
        mean, kept = self.exchange(picked.masked_fill_(~finite, float("nan")), output.dtype)
        ok = torch.isfinite(mean).all()
        if self.residual_buffer is not None:  # the residual keeps the rest (nothing of a dropped step)
            output.masked_fill_(~ok, 0.0)
            grads = output.split(g.split)[::2]  # each parameter's coordinates, without FSDP's padding
            if output.dtype != torch.float32:
                grads = [x.float() for x in grads]
            torch._foreach_add_(self.residuals(g), grads)
            flat = self.residual_buffer.view(-1)
            flat.index_copy_(0, entries, torch.where(ok, 0.0 if kept is None else kept, flat.index_select(0, entries)))
        mean = torch.where(ok, mean, 0.0)
        output.zero_()
        output.index_copy_(0, positions, mean.to(output.dtype))
        if self.record.values is None:
            self.record.values = torch.zeros(self.layout.mask_shape(mask.density).entries, device=output.device)
        scatter_spans(self.record.values, spans, mean)
        self.record.finite.append(ok)

    def exchange(self, send: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
        """The replicate group's mean of ``send`` (fp32, one group's compact buffer) and this replica's
        rounding of what it sent (``None`` when exact). Native: one all-reduce in the gradients' dtype."""
        name = self.config.resolved_wire
        if name == "native":
            sent = send.to(dtype, copy=True)
            kept = send.sub(sent.float()) if dtype != torch.float32 else None
            sent.div_(self.world_size)
            self._count(sent.numel(), sent.numel() * sent.element_size())
            dist.all_reduce(sent, group=self.process_group)
            return sent.float(), kept
        return self._exchange_encoded(send)

    def _exchange_encoded(self, send: Tensor) -> tuple[Tensor, Tensor]:
        """An encoded wire's two stages (as ``scape_core.hook.exchange_encoded``): all-to-all the
        segments, each owner sums its segment in fp32 and encodes the mean, all-gather the means."""
        entries = send.numel()
        if entries not in self._wire_plans:
            self._wire_plans[entries] = wire.WirePlan(self.config.resolved_wire, entries, self.world_size,
                                                      self.config.wire_block)
        plan = self._wire_plans[entries]
        segments = wire.pad(plan, send)
        encoded = wire.encode(plan, segments)
        kept = segments.sub_(wire.decode(plan, encoded)).view(-1)[:entries]  # this replica's rounding
        self._count(entries, plan.nbytes)
        received = torch.empty_like(encoded)
        dist.all_to_all_single(received, encoded, group=self.process_group)
        mean = wire.owner_mean(plan, received)
        own = wire.encode(plan, mean)
        lo = self.rank * plan.segment  # the owner keeps W times its rounding: the mean residual holds it
        hi = min(lo + plan.segment, entries)
        if hi > lo:
            kept[lo:hi] += mean.sub_(wire.decode(plan, own))[:hi - lo].mul_(plan.world)
        gathered = encoded.new_empty(encoded.numel())
        all_gather_into_tensor(gathered, own, group=self.process_group)
        return wire.decode(plan, gathered.view(encoded.shape)).view(-1)[:entries], kept

    def _count(self, values: int, nbytes: int) -> None:
        self.counters["values_sent"] += values
        self.counters["bytes_sent"] += nbytes

    # ----- the optimizer step -------------------------------------------------------------
    def begin_step(self, names_with_grad: list[str]) -> tuple[Mask | None, Tensor]:
        """Check every gradient was synchronized; returns ``(mask or None, skip)``, ``skip`` a 0-dim
        bool on the device, the same on every rank (a flag summed over the shard group)."""
        synced = {n for g in self.groups if g.index in self.record.outputs for n in g.names}
        missing = [n for n in names_with_grad if n not in synced]
        if missing:
            raise RuntimeError(f"gradients of {missing[:3]} were not synchronized by SCAPE's FSDP hook: run the "
                               "backward through the fully_shard model (and ScapeFSDPAdamS.step() once per backward)")
        device = self.layout.device
        bad = (~torch.stack(self.record.finite).all() if self.record.finite
               else torch.zeros((), dtype=torch.bool, device=device)).to(torch.uint8).view(1)
        if self.shard_group is not None and dist.get_world_size(self.shard_group) > 1:
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.shard_group)  # every shard of the replica learns it
        return (None if self.is_dense(self.step) else self.masks[self.step]), bad[0] > 0

    def end_step(self, momentum: Tensor, beta1: float, skip: Tensor) -> None:
        """Close the step, then select the masks of upcoming steps from ``momentum``."""
        self.skipped += skip
        self.streak.count(skip, torch.zeros_like(skip), self.step)  # whose gradient it was: not known here
        self.record = FSDPStepRecord()
        done, self.step = self.step, self.step + 1
        self.counters["steps"] += 1
        self.selector.after_step(done, momentum, self.residual_buffer, self.window_buffer, beta1)
        if self.step % STREAK_CHECK_EVERY == 0:
            self.streak.poll()

    def state_dict(self) -> dict[str, Any]:
        """This rank's SCAPE state (its shard, its replica's residual): step, masks, residual, windows,
        counters. Tensors stay on the device; :func:`save_fsdp_checkpoint` writes it with DCP."""
        self.selector.finish_pending()
        masks = {str(t): m.cols for t, m in self.masks.items()}
        meta = dict(step=self.step, config=self.config.to_dict(), rows=self.layout.rows,
                    densities={str(t): m.density for t, m in self.masks.items()}, sparse_started=self._sparse,
                    counters=dict(self.counters), residual=self.residual_buffer is not None,
                    windows=self.window_buffer is not None)
        out: dict[str, Any] = dict(meta=json.dumps(meta), masks=masks, skipped=self.skipped)  # text: not flattened
        if self.residual_buffer is not None:
            out["residual"] = self.residual_buffer
        if self.window_buffer is not None:
            out["windows"] = self.window_buffer
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (the same rank's, at the same mesh)."""
        meta = json.loads(state["meta"])
        if meta["rows"] != self.layout.rows:
            raise ValueError(f"SCAPE state of {meta['rows']} rows, this shard has {self.layout.rows}: resume at the "
                             "same mesh and model")
        self.config.check_resume(meta["config"], meta["step"], [int(t) for t in meta["densities"]])
        self.selector.load({int(t): Mask(meta["densities"][t], cols.to(self.layout.device))
                            for t, cols in state["masks"].items()})
        self.step, self._sparse = meta["step"], meta["sparse_started"]
        self.counters.update(meta["counters"])
        self.skipped.copy_(state["skipped"])
        self.residual_buffer = state["residual"].to(self.layout.device).clone() if meta["residual"] else None
        self.window_buffer = state["windows"].to(self.layout.device).clone() if meta["windows"] else None
        for g in self.groups:
            g.residual_views = None

    def wait(self) -> None:
        """Finish a mask all-gather in flight (per-rank scores); call before the process group goes."""
        self.selector.finish_pending()

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for non-finite gradients so far (reads the device)."""
        return int(self.skipped)

    def stats(self) -> dict[str, float]:
        """Communication across the replicate group so far on this rank (as ``ScapeState.stats``)."""
        c: dict[str, float] = dict(self.counters)
        c["skipped_steps"] = self.skipped_steps
        c["skipped_streak"] = self.streak.current()
        self.streak.check()
        c["compression"] = c["dense_bytes"] / c["bytes_sent"] if c["bytes_sent"] else 1.0
        return c


class ScapeFSDPAdamS(AdamS):
    r"""AdamS on the local shards of FSDP2's DTensor parameters, with SCAPE's masked update.

    Dense steps are :class:`AdamS` on each local shard. On a sparse step the hook has left the
    window sum :math:`s_j` on the mask in the gradient; the rule of ``state.config.update``
    moves :math:`\theta_j` and ``m`` there exactly as :class:`~scape_core.ScapeAdamS` does, and
    decoupled weight decay touches every coordinate. Every input is replicated across the
    replicate group, so each replica's shard stays bit-identical. ``m`` and the rule's statistics
    are flat buffers over the local shards (``optimizer.state[p]`` holds views shaped as the local
    shard); ``betas`` and ``eps`` must be the same in every parameter group.

    Example:
        >>> opt = ScapeFSDPAdamS(model.parameters(), state, lr=3e-4, weight_decay=0.1)  # doctest: +SKIP
    """

    def __init__(self, params: Iterable[Tensor] | Iterable[dict[str, Any]], state: ScapeFSDPState,
                 lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                 weight_decay: float = 0.0, *, foreach: bool | None = None) -> None:
        if not isinstance(state, ScapeFSDPState):
            raise TypeError(f"state must be a ScapeFSDPState, got {type(state).__name__}")
        self.scape = state
        self.rule = UPDATE_RULES[state.config.update]
        self._names: dict[Tensor, str] = {}
        self.momentum_buffer = state.layout.zeros()
        self.statistics = {key: state.layout.zeros() for key in self.rule.statistics}
        self.steps = torch.zeros(())
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach)
        state.optimizer = self

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, but every trainable parameter must be one of the state's FSDP2 groups."""
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            if id(p) in self.scape.names:
                name = self._names[p] = self.scape.names[id(p)]
                self.state[p]["step"] = self.steps
                for key, buffer in {MOMENTUM: self.momentum_buffer, **self.statistics}.items():
                    self.state[p][key] = self.scape.layout.view(buffer, name).view_as(p._local_tensor)
            elif p.requires_grad:
                raise ValueError(f"a parameter of shape {tuple(p.shape)} is not in an FSDP2 group of this "
                                 "ScapeFSDPState (added after fully_shard, or not part of the model?)")

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Apply the synchronized gradients (dense or masked), then schedule the next masks."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups, names = [], []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None and p in self._names]
            for p in params:
                check_grad(p)
            names += [self._names[p] for p in params]
            groups.append((group, params))
        mask, skip = self.scape.begin_step(names)
        if mask is not None and len(names) != len(self._names):
            raise RuntimeError("a sparse SCAPE step needs a gradient for every trainable parameter")
        self.steps += 1
        found = {(*g["betas"], g["eps"]) for g, params in groups if params} or {(*self.defaults["betas"],
                                                                                 self.defaults["eps"])}
        if len(found) > 1 and not self.scape.schedule.dense:
            raise ValueError(f"ScapeFSDPAdamS needs the same betas and eps in every parameter group, got "
                             f"{sorted(found)}")
        beta1, beta2, eps = next(iter(found))
        if mask is None:
            self._dense(groups, skip)
        else:
            self._sparse(groups, mask, skip, beta1=beta1, beta2=beta2, eps=eps)
        self.scape.end_step(self.momentum_buffer, beta1, skip)
        return loss

    def _dense(self, groups: list[tuple[dict[str, Any], list[Tensor]]], skip: Tensor) -> None:
        if bool(skip):  # a warm-up step may read the device: the sparse steps never do
            return
        for group, params in groups:
            beta1, beta2 = group["betas"]
            run = self.step_function(group)
            run([p._local_tensor for p in params], [p.grad._local_tensor for p in params],
                [self.state[p][MOMENTUM] for p in params], lr=group["lr"], beta1=beta1, beta2=beta2,
                eps=group["eps"], weight_decay=group["weight_decay"])

    def _sparse(self, groups: list[tuple[dict[str, Any], list[Tensor]]], mask: Mask, skip: Tensor,
                **hp: float) -> None:
        """The masked update: a fixed number of kernels per FSDP group, decided on the device."""
        scape = self.scape
        record = scape.record
        views: dict[str, Tensor] = {}  # each parameter's coordinates in its group's reduce-scatter output
        for g in scape.groups:
            pieces = record.outputs[g.index].split(g.split)[::2]
            moved = [(o, p.grad._local_tensor) for p, o in zip(g.params, pieces)
                     if p.grad._local_tensor.data_ptr() != o.data_ptr()]
            if moved:  # p.grad is not the hook's output (accumulated into, or replaced): copied there
                torch._foreach_copy_([o for o, _ in moved], [x.reshape(-1) for _, x in moved])
            views.update(zip(g.names, pieces))
        entries = mask.flat(scape.layout)
        s = torch.empty(entries.numel(), device=entries.device)
        for g in scape.groups:
            _, positions, spans = record.plans[g.index]
            scatter_spans(s, spans, record.outputs[g.index].index_select(0, positions).float())
        applied = ~skip
        u = self._masked_update(entries, s, applied, hp)
        for g in scape.groups:  # each group's output now holds its dense update
            out, (_, positions, spans) = record.outputs[g.index], record.plans[g.index]
            out.zero_()
            out.index_copy_(0, positions, gather_spans(u, spans).to(out.dtype))
        keep = applied.float()
        for group, params in groups:
            if not params:
                continue
            local = [p._local_tensor for p in params]
            if group["weight_decay"]:
                torch._foreach_mul_(local, keep.mul(-group["lr"] * group["weight_decay"]).add_(1.0))
            deltas = [views[self._names[p]].view_as(x) for p, x in zip(params, local)]
            torch._foreach_add_(local, deltas, alpha=-group["lr"])
        for g in scape.groups:  # the synchronized gradients back in p.grad
            out, (_, positions, spans) = record.outputs[g.index], record.plans[g.index]
            out.index_copy_(0, positions, gather_spans(s, spans).to(out.dtype))
        if record.values is not None and scape.residual_buffer is not None:  # what a skipped step sent goes back
            scape.residual_buffer.view(-1).index_add_(0, entries, record.values.masked_fill(applied, 0.0))

    def _masked_update(self, entries: Tensor, s: Tensor, applied: Tensor, hp: dict[str, float]) -> Tensor:
        """The rule on every entry (``ScapeAdamS``'s pass, :func:`scape_core.kernels.masked_update_pass`);
        returns ``u`` (0 where not applied)."""
        step = torch.tensor(float(self.scape.step), device=entries.device)  # windows are fp32
        return masked_update_pass(self.rule, self.momentum_buffer, self.statistics, self.scape.window_buffer,
                                  entries, s, applied, step, hp["beta1"], hp["beta2"], hp["eps"])


def fsdp_rank_state(optimizer: ScapeFSDPAdamS) -> dict[str, Any]:
    """This rank's optimizer and SCAPE state as DCP saves it beside the model: ``{"rank<r>": {...}}``.

    Each rank's entry has its own key (its shards differ; DCP would keep one copy of a plain tensor
    saved under one key by every rank). For frameworks that write the checkpoint themselves
    (Lightning's ``optimizer_state``); :func:`load_fsdp_checkpoint` reads it back.

    Example:
        >>> dcp.save({"model": model.state_dict(), **fsdp_rank_state(opt)}, checkpoint_id=path)  # doctest: +SKIP
    """
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
    entries: dict[str, Any] = {model_key: model.state_dict()}
    if optimizer is not None:
        key = f"rank{dist.get_rank()}"
        nest = (lambda entry: {optimizer_key: entry}) if optimizer_key else (lambda entry: entry)  # noqa: E731
        unnest = (lambda tree: tree[optimizer_key]) if optimizer_key else (lambda tree: tree)  # noqa: E731
        head: dict[str, Any] = nest({key: {"scape": {"meta": ""}}})
        dcp.load(head, checkpoint_id=checkpoint_id)  # first the shapes: which masks, which buffers
        text = unnest(head)[key]["scape"]["meta"]
        meta = json.loads(text)
        state, layout = optimizer.scape, optimizer.scape.layout
        scape: dict[str, Any] = dict(meta=text, skipped=torch.zeros_like(state.skipped),
                                     masks={t: torch.zeros(layout.rows, layout.mask_shape(d).k, dtype=torch.int16)
                                            for t, d in meta["densities"].items()})
        for name in ("residual", "windows"):
            if meta[name]:
                scape[name] = layout.zeros()
        mine = fsdp_rank_state(optimizer)
        mine[key]["scape"] = scape
        entries.update(nest(mine))
    dcp.load(entries, checkpoint_id=checkpoint_id)  # the optimizer's buffers in place
    model.load_state_dict(entries[model_key])
    if optimizer is not None:
        for group, saved in zip(optimizer.param_groups, json.loads(mine[key]["optimizer"]["groups"])):
            group.update(saved, betas=tuple(saved["betas"]))
        state.load_state_dict(scape)


def scape_fsdp(model: nn.Module, mesh: Any, sparsity: float | None = None, *, lr: float = 1e-3,
               betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8, weight_decay: float = 0.0,
               shard_modules: Iterable[nn.Module] = (), config: ScapeConfig | None = None,
               **fields: Any) -> tuple[nn.Module, ScapeFSDPAdamS]:
    """Shard ``model`` with FSDP2 inside each replica and run SCAPE across replicas, in one call.

    ``mesh`` is a 2-D ``DeviceMesh`` in (replicate, shard) order, named (e.g. one row per node):
    each of ``shard_modules`` (e.g. the transformer blocks), then ``model``, is ``fully_shard``-ed
    on the inner (shard) dimension, and SCAPE exchanges the sparse gradients over the outer one.
    ``sparsity``, ``config`` and ``fields`` configure SCAPE (:class:`ScapeConfig`), the rest the
    optimizer. Returns the sharded model (the same object, now an ``FSDPModule``) and its
    :class:`ScapeFSDPAdamS` (``optimizer.scape`` is the :class:`ScapeFSDPState`).

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
    _refuse_wrapped(model, fsdp_module, dtensor)
    replicate, shard = mesh.mesh_dim_names
    for module in shard_modules:
        fully_shard(module, mesh=mesh[shard])
    fully_shard(model, mesh=mesh[shard])
    state = ScapeFSDPState(model, mesh.get_group(replicate), sparsity, config=config, **fields)
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

