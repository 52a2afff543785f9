"""ScapeAdamS: AdamS that applies the masked update on sparse steps and schedules the next masks."""

from __future__ import annotations

import warnings
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor

from scape_core import checkpoint, fused
from scape_core.adams import MOMENTUM, AdamS, check_grad
from scape_core.checkpoint import every_rank_arrives
from scape_core.kernels import Kernels
from scape_core.layout import FlatLayout, row_of
from scape_core.masks import Mask
from scape_core.state import ScapeState, ScapeStateBase
from scape_core.update_rules import UPDATE_RULES, masked_update, masked_update_pass

Piece = tuple[int, int, int]  # a parameter's entries (ParamPiece: param, lo, hi)


class ScapeAdamS(AdamS):
    r"""The optimizer half of SCAPE; pair it with :func:`scape_hook` on the same :class:`ScapeState`.

    Dense steps (warm-up, ``sparsity=0``) are plain :class:`AdamS`. On a sparse step the hook
    has left, on the step's mask ``M``, the window sum :math:`s_j` (the mean over ranks of
    ``grad + residual``) in the gradient; with the default rule (``linear``, see
    :mod:`scape_core.update_rules`), per coordinate :math:`j`:

    .. math::
        j \in M:&\quad \theta_j \leftarrow (1-\eta\lambda)\,\theta_j - \eta\, s_j / d_j,
                 \quad m_j, sq_j \text{ updated from } s_j / n_j \text{ and } s_j^2 / n_j \\
        j \notin M:&\quad \theta_j \leftarrow (1-\eta\lambda)\,\theta_j \quad (m_j, sq_j \text{ unchanged})

    where :math:`n_j` is the number of steps since :math:`j` was last exchanged and
    :math:`d_j = \max(\sqrt{m_j^2 + c\,\mathrm{noise}_j}, |s_j / n_j|) + \epsilon`. Everything it
    reads is replicated, so parameters and ``m`` stay bit-identical on every rank. After the
    update it selects the masks of the next steps (``state.end_step``).

    ``m`` and the rule's statistics live in flat buffers (:mod:`scape_core.layout`);
    ``optimizer.state[p]`` holds each parameter's views of them (``"exp_avg"``, ``"sq"``), so
    ``state_dict()`` is keyed as torch's optimizers are. A sparse step costs a fixed number of
    operators whatever the parameters and DDP's buckets (one multi-tensor copy of ``p.grad`` into
    the state's staging buffer, gathers and scatters at the mask's entries on flat buffers, one
    multi-tensor decay and update per parameter group), and never reads the device from the host.
    Parameter groups may differ in ``lr`` and ``weight_decay``; ``betas`` and ``eps`` must be the
    same in every group (the masked update is one kernel over all of them). It must own every
    parameter its state synchronizes.

    With ``ScapeState(..., shard_optimizer=True)`` the buffers hold only the state's shard (this
    rank's block of rows) and ``optimizer.state[p]`` this rank's part of each parameter, flat
    (possibly empty). A sparse step runs the rule on the entries this rank owns and all-gathers
    every owner's ``u``; a dense step updates the shard and all-gathers the parameters.
    :meth:`state_dict` gathers every shard (collective), so what it returns, and what
    :meth:`load_state_dict` takes, is the same whole state in both modes.

    Example:
        >>> from scape_core import scape_hook
        >>> state = ScapeState(ddp, sparsity=0.99)
        >>> ddp.register_comm_hook(state, scape_hook)
        >>> opt = ScapeAdamS(ddp.parameters(), state, lr=3e-4, weight_decay=0.1)
        >>> sorted(opt.state[next(ddp.parameters())])
        ['exp_avg', 'sq', 'step']
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        state: ScapeState,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        *,
        foreach: bool | None = None,
    ) -> None:
        self._check_state(state)
        self.scape: ScapeStateBase = state
        self.rule = UPDATE_RULES[state.config.update]
        self._names: dict[Tensor, str] = {}  # filled by add_param_group
        self.momentum_buffer = state.shard.zeros()  # m of the state's shard (every row unless sharded), fp32
        self.steps = torch.zeros(())  # optimizer steps taken, skipped ones included (on the CPU, as torch's Adam)
        self.statistics = {key: state.shard.zeros() for key in self.rule.statistics}
        self._consolidated: dict[str, Any] | None = None  # the whole state, gathered by consolidate_state_dict
        self._views: dict[tuple[str, ...], list[Tensor]] = {}  # staging views per set of parameters
        self._tables: dict[tuple[str, ...], tuple[fused.RowTable, Tensor]] = {}  # C loops' tables, their groups
        self._resumed = False  # a state dict was loaded since the last step
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=foreach,
                         kernels=state.config.kernels)
        left_out = [n for n in state.params if n not in set(self._names.values())]
        if left_out:  # the hook flushes their residuals into gradients only this optimizer applies
            raise ValueError(f"{type(self).__name__} must own every parameter its state synchronizes; "
                             f"{len(left_out)} are left out ({left_out[:5]}{', ...' if len(left_out) > 5 else ''}): "
                             "SCAPE's hook exchanges them, and their unsent gradients live in its residual, which "
                             "only this optimizer applies. Build it from ddp.parameters() (parameter groups may "
                             "differ in lr and weight_decay), or freeze those parameters before wrapping in DDP")
        self.kernels = state.kernels  # one set of compiled passes per state
        state.optimizer = self
        state.buffers.m, state.buffers.statistics = self.momentum_buffer, self.statistics  # the same tensors

    _every_gradient = False  # whether a sparse step needs every parameter's gradient

    @staticmethod
    def _check_state(state: Any) -> None:
        if not isinstance(state, ScapeState):
            raise TypeError(f"state must be the ScapeState registered with scape_hook, got {type(state).__name__}")

    # what the step reads and writes of a parameter on this rank: the tensor itself (DDP: replicated)
    @staticmethod
    def _local(p: Tensor) -> Tensor:
        return p

    @staticmethod
    def _grad(p: Tensor) -> Tensor:
        return p.grad

    def _unknown(self, p: Tensor) -> str:
        """What to say of a trainable parameter the state does not synchronize."""
        return (f"a parameter of shape {tuple(p.shape)} is not synchronized by the model of this ScapeState "
                "(added after DDP was built, or not part of the DDP model?)")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """As torch's, but every trainable parameter must be one the state's model synchronizes; a
        refused group leaves the optimizer as it was."""
        params = param_group["params"]
        if not isinstance(params, set):  # torch refuses a set (no order)
            param_group["params"] = params = [params] if isinstance(params, Tensor) else list(params)  # an iterator
        for p in params:
            if id(p) not in self.scape.names and p.requires_grad:
                raise ValueError(self._unknown(p))
        super().add_param_group(param_group)
        for p in self.param_groups[-1]["params"]:
            if id(p) in self.scape.names:
                self._names[p] = self.scape.names[id(p)]
                self._install_views(p)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch's. After a synchronized backward whose ``step()`` was not called, it also skips that
        step, as it would in plain DDP (call it on every rank, e.g. on a gradient-norm spike: a norm of the
        synchronized gradients is the same on every rank): the schedule does not advance, and a sparse
        step's synchronized values go back into each rank's residual (``ScapeState.drop_step``).

        Example:
            >>> loss.backward()                                                         # doctest: +SKIP
            >>> if torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0) > 100:       # doctest: +SKIP
            ...     opt.zero_grad()                                    # every rank: the step is skipped
        """
        if self.scape.record.synced:
            self.scape.drop_step()
        super().zero_grad(set_to_none)

    def _install_views(self, p: Tensor) -> None:
        shard, name = self.scape.shard, self._names[p]
        self.state[p]["step"] = self.steps  # one counter shared by every parameter
        for key, buffer in {MOMENTUM: self.momentum_buffer, **self.statistics}.items():
            view = shard.view(buffer, name)
            self.state[p][key] = view.view_as(self._local(p)) if shard.whole else view  # sharded: this rank's part

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """As torch's, with ``m`` and the rule's statistics copied into the flat fp32 buffers.

        Takes the whole state (what :meth:`state_dict` returns, sharded or not, at any world
        size); a sharded optimizer keeps its shard of it.
        """
        self._consolidated = None
        self._resumed = True  # the first step compares its step count with the SCAPE state's
        super().load_state_dict(state_dict)  # AdamS keeps the saved fp32 values
        for p, name in self._names.items():
            saved = dict(self.state[p])
            self._install_views(p)
            for key, view in self.state[p].items():
                if key not in saved or saved[key] is view:
                    continue
                if key == "step":  # the step counter is shared: every parameter saved the same
                    view.copy_(saved[key])
                elif saved[key].numel() != self._local(p).numel():
                    raise ValueError(f"optimizer state {key!r} of {name!r} has {saved[key].numel()} values for a "
                                     f"parameter of {self._local(p).numel()}: save with state_dict() (it gathers "
                                     "every shard)")
                else:
                    view.view(-1).copy_(self.scape.shard.part(saved[key], name))

    def state_dict(self) -> dict[str, Any]:
        """As torch's: every parameter's whole ``m`` and statistics, keyed by index.

        Sharded: a collective that gathers every rank's shard (call it on every rank; a rank
        that waits alone for 30 s raises), or, on the rank a :meth:`consolidate_state_dict` just
        gathered onto, what it gathered (once). The result loads into a sharded or replicated
        ``ScapeAdamS`` at any world size.
        """
        if self._consolidated is not None:  # once: a later call gathers again, on every rank
            full, self._consolidated = self._consolidated, None
            return full
        if not self.scape.sharded:
            return super().state_dict()
        return self._gathered_state_dict()

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the whole state for :meth:`state_dict` on rank ``to`` (collective), as
        ``ZeroRedundancyOptimizer``'s; Lightning and Fabric call it before saving. Nothing to do
        when not sharded. The next :meth:`state_dict` on rank ``to`` returns it (once); the next
        :meth:`step` drops it.

        Example:
            >>> opt.consolidate_state_dict()                                      # doctest: +SKIP
            >>> if dist.get_rank() == 0: torch.save(opt.state_dict(), "opt.pt")  # doctest: +SKIP
        """
        if not self.scape.sharded:
            return
        self._consolidated = None
        full = self._gathered_state_dict()
        self._consolidated = full if self.scape.comm.rank == to else None

    def _gathered_state_dict(self) -> dict[str, Any]:
        scape = self.scape
        every_rank_arrives("ScapeAdamS.state_dict", scape.comm.process_group, checkpoint.ARRIVAL_TIMEOUT,  # read now
                           hint="a sharded optimizer gathers its state from every rank: call state_dict() on every "
                                "rank, or consolidate_state_dict(to=0) on every rank and then state_dict() on rank 0")
        whole = {key: scape.shards.unshard(buffer) for key, buffer in {MOMENTUM: self.momentum_buffer,
                                                                 **self.statistics}.items()}
        packed = super().state_dict()  # this rank's views, keyed by index: replaced by whole tensors
        params = [p for group in self.param_groups for p in group["params"]]
        for index, entries in packed["state"].items():
            p = params[index]
            if p in self._names:
                packed["state"][index] = {**entries, **{key: scape.layout.view(buffer, self._names[p]).view_as(p)
                                                        for key, buffer in whole.items() if key in entries}}
        return packed

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Apply the synchronized gradients (dense or masked), then schedule the next masks."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        groups, names = [], []
        for group in self.param_groups:
            params = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p not in self._names:  # frozen at construction, trainable now: DDP never syncs it
                    raise RuntimeError(f"a parameter of shape {tuple(p.shape)} has a gradient but is not "
                                       "synchronized by the DDP model; unfreeze before wrapping in DDP")
                check_grad(p)
                params.append(p)
                names.append(self._names[p])
            groups.append((group, params))
        if not names and not self.scape.record.synced:  # no backward since the last step: as torch's, nothing
            return loss  # to update, and the schedule does not advance (a SCAPE step is one synchronized backward)
        if self._resumed:
            self._resumed = False
            self._check_resumed_together()
        mask, skip = self.scape.begin_step(names)
        self._consolidated = None
        if mask is not None and self._every_gradient and len(names) != len(self._names):
            raise RuntimeError("a sparse SCAPE step needs a gradient for every trainable parameter")
        self.steps += 1
        beta1, beta2, eps = self._shared_hyperparameters(groups)
        if mask is None:
            self._dense(groups, skip)
        else:
            self._sparse(groups, mask, skip, len(names) == len(self._names), beta1=beta1, beta2=beta2, eps=eps)
        self.scape.end_step(self.momentum_buffer, beta1, skip)
        return loss

    def _check_resumed_together(self) -> None:
        """Warn (rank 0) when the optimizer's state and SCAPE's were restored at different steps, e.g. a plain
        ``torch.save`` of the model and ``opt.state_dict()`` loaded without SCAPE's state."""
        ours, theirs = int(self.steps), self.scape.step
        if ours == theirs or self.scape.comm.rank != 0:
            return
        if ours > theirs:
            what = (f"ScapeAdamS was resumed at optimizer step {ours}, but SCAPE's state is at step {theirs}: its "
                    "schedule restarts there (the dense warm-up runs again) and the saved run's residuals (each "
                    "rank's gradient not sent yet) are not restored")
        else:
            what = (f"SCAPE's state was resumed at step {theirs}, but ScapeAdamS's state is at optimizer step "
                    f"{ours}: its momentum and statistics are not those of the saved run")
        warnings.warn(f"SCAPE: {what}. Save and load both with scape_core.save_checkpoint / load_checkpoint "
                      "(every rank calls them), or save gather_state_dict(state) beside opt.state_dict() and load "
                      "it with state.load_state_dict(...) on every rank", stacklevel=3)

    def _shared_hyperparameters(self, groups: list[tuple[dict[str, Any], list[Tensor]]]) -> tuple[float, float, float]:
        found = {(*g["betas"], g["eps"]) for g, params in groups if params} or {(*self.defaults["betas"],
                                                                                 self.defaults["eps"])}
        if len(found) > 1 and not self.scape.schedule.dense:
            raise ValueError(f"{type(self).__name__} needs the same betas and eps in every parameter group (got "
                             f"(beta1, beta2, eps) = {sorted(found)}); lr and weight_decay may differ per group")
        return next(iter(found))

    def _dense(self, groups: list[tuple[dict[str, Any], list[Tensor]]], skip: Tensor) -> None:
        """AdamS on the shard's coordinates (every one unless sharded); sharded, then the parameters
        are all-gathered (ZeRO-1's dense step, after DDP's all-reduce)."""
        if bool(skip):  # a warm-up step may read the device: the sparse steps never do
            return
        shard = self.scape.shard
        for group, params in groups:
            beta1, beta2 = group["betas"]
            run = self.step_function(group)
            if not shard.whole:
                params = [p for p in params if self.state[p][MOMENTUM].numel()]  # with coordinates here
            names = [self._names[p] for p in params]
            values = [self._local(p) for p in params] if shard.whole else [shard.part(p.detach(), n)
                                                                           for p, n in zip(params, names)]
            grads = [self._grad(p) for p in params] if shard.whole else [shard.part(p.grad, n)
                                                                         for p, n in zip(params, names)]
            run(values, grads, [self.state[p][MOMENTUM] for p in params], lr=group["lr"],
                beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"])
        if self.scape.sharded:
            self.scape.shards.gather_parameters(self.scape.params)

    def _sparse(self, groups: list[tuple[dict[str, Any], list[Tensor]]], mask: Mask, skip: Tensor,
                all_have_grad: bool, **hp: float) -> None:
        """The masked update, decided on the device: :meth:`_sparse_compiled` (the compiled passes, at the
        entries only) where the kernels are compiled, the state replicated and every parameter one dense
        block with a gradient, else :meth:`_sparse_flat` (same arguments, same results to fp32 rounding)."""
        with_grad = [p for _, params in groups for p in params]
        values, grads = [self._local(p) for p in with_grad], [self._grad(p) for p in with_grad]
        compiled = (self.kernels.compiled and not self.scape.sharded and all_have_grad
                    and self._contiguous(values, grads))
        (self._sparse_compiled if compiled else self._sparse_flat)(groups, with_grad, values, grads, mask, skip,
                                                                  all_have_grad, **hp)
        record = self.scape.record
        if not record.returns_skipped:  # exchanged region by region: what a skipped step sent goes back now
            record.return_unapplied(self.scape.buffers.residual, mask.flat(self.scape.layout), ~skip)

    def _sparse_flat(self, groups: list[tuple[dict[str, Any], list[Tensor]]], with_grad: list[Tensor],
                     values: list[Tensor], grads: list[Tensor], mask: Mask, skip: Tensor, all_have_grad: bool,
                     **hp: float) -> None:
        """The sparse step in a fixed number of operators, whatever the parameters: the synchronized
        gradients copied from ``p.grad`` into the state's staging buffer (one multi-tensor copy, so
        clipping or scaling between backward and step applies) and read at the mask's entries, the rule
        there, ``u`` written into the zeroed staging buffer, then per parameter group every coordinate
        decayed and moved by ``-lr u`` (two multi-tensor operators). Sharded, the owners' rule and the
        all-gather of ``u`` (:meth:`_masked_update`)."""
        scape = self.scape
        entries, keep = mask.flat(scape.layout), ~skip
        if all_have_grad and entries.dtype == torch.int64 and fused.runs_here(values + grads, entries):
            # on the CPU: read p.grad and write the parameters where they are (sharded too: the same bits)
            self._sparse_fused(groups, with_grad, values, grads, mask, entries, keep, hp)
            return
        staging = scape.buffers.staging()
        torch._foreach_copy_(self._staging_views(with_grad), grads)
        s = scape.buffers.flat(staging).index_select(0, entries)
        applied = keep if all_have_grad else self._entries_with_grad(with_grad, entries, keep)
        u = self._masked_update(mask, s, applied, hp)
        staging.zero_()
        scape.buffers.flat(staging).index_copy_(0, entries, u)
        keep, one = keep.float(), self.kernels.constant(1.0, keep.device)
        for group, params in groups:
            if not params:
                continue
            local = [self._local(p) for p in params]
            if group["weight_decay"]:  # every coordinate, every applied step (1 on a skipped one)
                torch._foreach_mul_(local, torch.add(one, keep, alpha=-group["lr"] * group["weight_decay"]))
            torch._foreach_add_(local, self._staging_views(params), alpha=-group["lr"])
        if not all_have_grad:  # the means of parameters without a gradient go back (a skipped step has none)
            scape.record.return_unapplied(scape.buffers.residual, entries, applied | skip)

    def _sparse_fused(self, groups: list[tuple[dict[str, Any], list[Tensor]]], with_grad: list[Tensor],
                      values: list[Tensor], grads: list[Tensor], mask: Mask, entries: Tensor, keep: Tensor,
                      hp: dict[str, float]) -> None:
        """:meth:`_sparse_flat` in C loops over ``p.grad`` and the parameters themselves (:mod:`scape_core.fused`):
        the window sums read at the entries, the rule, then every parameter decayed and moved at its entries
        in one pass."""
        key = tuple(self._names[p] for p in with_grad)
        found = self._tables.get(key)
        if found is None:
            group_of = [i for i, (_, params) in enumerate(groups) for _ in params]
            found = self._tables[key] = (fused.RowTable.of(self.scape.layout, key),
                                         torch.tensor(group_of, dtype=torch.int32))
        table, group_of = found
        shape = self.scape.layout.mask_shape(mask.density)
        s = fused.gather(grads, table, shape, entries)
        u = self._masked_update(mask, s, keep, hp)
        lr = [g["lr"] for g, _ in groups]
        alpha = torch.tensor([-r * g["weight_decay"] for r, (g, _) in zip(lr, groups)], dtype=torch.float32)
        decays = torch.tensor([bool(g["weight_decay"]) for g, _ in groups])
        fused.update(values, table, shape, group_of, alpha, decays, torch.tensor([-r for r in lr], dtype=torch.float32),
                     keep, entries, u)

    def _staging_views(self, params: list[Tensor]) -> list[Tensor]:
        """The views of the state's staging buffer shaped like each of ``params``' local tensor (made once
        per set of parameters: a view made each step is an operator each)."""
        key = tuple(self._names[p] for p in params)
        found = self._views.get(key)
        if found is None:
            staging, layout = self.scape.buffers.staging(), self.scape.layout
            found = self._views[key] = [layout.view(staging, self._names[p]).view_as(self._local(p)) for p in params]
        return found

    def _sparse_compiled(self, groups: list[tuple[dict[str, Any], list[Tensor]]], with_grad: list[Tensor],
                         values: list[Tensor], grads: list[Tensor], mask: Mask, skip: Tensor, all_have_grad: bool,
                         **hp: float) -> None:
        """The sparse step at the entries, compiled: the window sums read from ``p.grad`` there, the rule,
        every coordinate decayed and ``-lr u`` added at the entries of each parameter, in two passes
        (:func:`sparse_step_pass`, :func:`update_pass`)."""
        scape = self.scape
        entries = mask.flat(scape.layout, narrow=True)  # int32 where it fits
        pieces = scape.layout.mask_shape(mask.density).pieces([self._names[p] for p in with_grad])
        decay, scale = self._decay_and_scale(groups, skip, entries.device)
        sparse_step_compiled(scape.kernels, self.rule, values, grads, self.momentum_buffer, self.statistics,
                             scape.buffers.windows, entries, ~skip, scape.step, decay, scale, scape.layout, pieces,
                             **hp)

    def _decay_and_scale(self, groups: list[tuple[dict[str, Any], list[Tensor]]], skip: Tensor,
                         device: torch.device) -> tuple[list[Tensor | None], list[Tensor]]:
        """Per parameter with a gradient: its decay factor (1 on a skipped step; None without decay)
        and ``-lr``, as tensors a compiled pass reads."""
        keep = (~skip).float()
        decay: list[Tensor | None] = []
        scale: list[Tensor] = []
        for index, (group, params) in enumerate(groups):
            factor = keep.mul(-group["lr"] * group["weight_decay"]).add_(1.0) if group["weight_decay"] else None
            lr = self.kernels.scalar(f"lr{index}", -group["lr"], device, torch.float32)
            decay += [factor] * len(params)
            scale += [lr] * len(params)
        return decay, scale

    @staticmethod
    def _contiguous(values: list[Tensor], grads: list[Tensor]) -> bool:
        """Whether every parameter and gradient is one dense block (the direct passes index them flat)."""
        return all(p.is_contiguous() and g.is_contiguous() for p, g in zip(values, grads))

    def _masked_update(self, mask: Mask, s: Tensor, applied: Tensor, hp: dict[str, float]) -> Tensor:
        """The rule on the entries whose state this rank keeps; returns ``u`` for every entry (0 where
        not applied). Sharded: each owner updates its entries and the owners' ``u`` are all-gathered."""
        positions, local = self.scape.shards.own_entries(mask)
        if positions is not None:
            s = s.index_select(0, positions)
            applied = applied.index_select(0, positions) if applied.dim() else applied
        scape, windows = self.scape, self.scape.buffers.windows  # the window lengths n, if kept; marked exchanged now
        flat = scape.buffers.flat  # the buffers' 1-D views, made once
        u = masked_update(self.kernels, self.rule, flat(self.momentum_buffer),
                          {k: flat(b) for k, b in self.statistics.items()},
                          None if windows is None else flat(windows), local, s, applied, scape.step, **hp)
        return u if positions is None else self.scape.shards.gather_updates(u, mask.density)

    def _entries_with_grad(self, params: list[Tensor], entries: Tensor, keep: Tensor) -> Tensor:
        """Per mask entry: applied this step (``keep``, and its parameter has a gradient)."""
        layout, with_grad = self.scape.layout, {self._names[p] for p in params}
        rows = torch.ones(layout.rows, dtype=torch.bool, device=layout.device)
        for name in self.scape.params:
            if name not in with_grad:  # rare (unused parameters): one fill each
                rows[layout.first_row[name]:layout.first_row[name] + layout.nrows[name]] = False
        return rows.index_select(0, row_of(entries, layout.chunk)) & keep


def within_parameters(entries: Tensor, row_start: Tensor, chunk: int) -> Tensor:
    """Each flat entry's index in its own parameter (``row_start``: :attr:`~scape_core.layout.FlatLayout.row_start`)."""
    return entries - row_start.index_select(0, row_of(entries, chunk))


def gather_pass(grads: list[Tensor], entries: Tensor, row_start: Tensor, chunk: int,
                pieces: Sequence[Piece]) -> Tensor:
    """The gradient at every mask entry (fp32), read from each tensor where its entries fall
    (``pieces``: :class:`~scape_core.layout.ParamPiece`): one index per parameter's piece."""
    at = within_parameters(entries, row_start, chunk)
    return torch.cat([grads[i].reshape(-1).index_select(0, at[lo:hi]).float() for i, lo, hi in pieces])


def decay_pass(params: list[Tensor], decay: list[Tensor | None]) -> None:
    """``theta *= decay`` per tensor (``None``: no decay), in place: one multi-tensor multiply per factor
    (a parameter group's)."""
    by_factor: list[tuple[Tensor, list[Tensor]]] = []
    for p, d in zip(params, decay):
        if d is None:
            continue
        same = next((members for factor, members in by_factor if factor is d), None)
        if same is None:
            by_factor.append((d, [p]))
        else:
            same.append(p)
    for d, members in by_factor:
        torch._foreach_mul_(members, d)


def update_pass(params: list[Tensor], entries: Tensor, u: Tensor, scale: list[Tensor], row_start: Tensor,
                chunk: int, pieces: Sequence[Piece]) -> None:
    """``theta[j] += scale * u[j]`` at the entries, in place (``scale * u`` once per parameter group's
    scale, then one indexed add per parameter's piece).

    A pass of its own, not the decay's: in one graph, an in-place multiply and then an indexed add
    into the same tensor is compiled into a copy of the whole tensor written back at the end
    (seen in inductor's generated code: 8 B/param more), each alone is in place.
    """
    at = within_parameters(entries, row_start, chunk)
    scaled: list[tuple[Tensor, Tensor]] = []  # (a group's scale, u times it)
    for i, lo, hi in pieces:
        step = next((v for s, v in scaled if s is scale[i]), None)
        if step is None:
            step = u * scale[i]
            scaled.append((scale[i], step))
        p = params[i].view(-1)
        p.index_add_(0, at[lo:hi], step[lo:hi].to(p.dtype))


def sparse_step_pass(rule: Any, params: list[Tensor], grads: list[Tensor], momentum: Tensor,
                     statistics: dict[str, Tensor], windows: Tensor | None, entries: Tensor, applied: Tensor,
                     step: Tensor, decay: list[Tensor | None], row_start: Tensor, chunk: int,
                     pieces: Sequence[Piece], beta1: float, beta2: float, eps: float) -> Tensor:
    """A replicated sparse step's optimizer half but the update: the window sums read from ``p.grad``
    (:func:`gather_pass`), the rule (:func:`masked_update_pass`) and the decay (:func:`decay_pass`);
    returns ``u`` for :func:`update_pass`. (A skipped step's exchanged values went back into the
    residual in :func:`finish_pass`.)"""
    s = gather_pass(grads, entries, row_start, chunk, pieces)
    u = masked_update_pass(rule, momentum, statistics, windows, entries, s, applied, step, beta1, beta2, eps)
    decay_pass(params, decay)
    return u


def sparse_step_compiled(kernels: Kernels, rule: Any, params: list[Tensor], grads: list[Tensor], momentum: Tensor,
                         statistics: dict[str, Tensor], windows: Tensor | None, entries: Tensor, applied: Tensor,
                         step: int, decay: list[Tensor | None], scale: list[Tensor], layout: FlatLayout,
                         pieces: Sequence[Piece], **hp: float) -> None:
    """A replicated sparse step's optimizer half compiled (every parameter with a gradient):
    :func:`sparse_step_pass`, then :func:`update_pass`, each one compiled copy per set of pieces."""
    at = kernels.scalar("step", step, entries.device, torch.float32)  # windows are fp32
    u = kernels.get("sparse_step", sparse_step_pass, hash(pieces))(
        rule, params, grads, momentum, statistics, windows, entries, applied, at, decay, layout.row_start,
        layout.chunk, pieces, hp["beta1"], hp["beta2"], hp["eps"])
    kernels.get("update", update_pass, hash(pieces))(params, entries, u, scale, layout.row_start, layout.chunk, pieces)
