"""ScapeState: SCAPE's per-rank state (residuals, mask schedule, counters), keyed by parameter name."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from scape_core import inflight
from scape_core.config import ScapeConfig
from scape_core.diagnose import DDPWatch
from scape_core.masks import MaskLayout, mask_score, scheduled_in, select_topk

STATE_FORMAT = 1
_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_forward_module.")


def parameter_names(model: nn.Module) -> dict[str, Tensor]:
    """Trainable parameters by name, with DDP / torch.compile / Fabric wrapper prefixes removed."""
    named = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        while name.startswith(_WRAPPER_PREFIXES):
            name = name.split(".", 1)[1]
        named[name] = p
    return named


def _check_model(model: nn.Module) -> None:
    """SCAPE replaces DDP's gradient all-reduce: refuse models it cannot serve, at setup."""
    inner = getattr(model, "_orig_mod", model)  # torch.compile wrapper
    if not isinstance(inner, nn.parallel.DistributedDataParallel):
        raise TypeError(
            f"ScapeState needs the DistributedDataParallel-wrapped model, got {type(inner).__name__} "
            "(FSDP and DeepSpeed shard gradients themselves and are not supported)"
        )
    for name, module in inner.module.named_modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
            raise TypeError(f"{name or 'the model'} is an embedding with sparse=True; SCAPE needs dense "
                            "gradients: build it with sparse=False")


@dataclass
class _Step:
    """What the hook recorded during the current step's backward."""

    synced: set[str] = field(default_factory=set)
    sent: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)  # name -> (mask, mean values)
    nonfinite: bool = False


class ScapeState:
    """State of the SCAPE communication hook, shared with its :class:`ScapeAdamS` optimizer.

    Register it with the hook, then build the optimizer from it::

        state = ScapeState(ddp, sparsity=0.99)          # or config=ScapeConfig(...)
        ddp.register_comm_hook(state, scape_hook)
        opt = ScapeAdamS(ddp.parameters(), state, lr=3e-4, weight_decay=0.1)

    Tuning (see ``docs/benchmarks.md`` for the measurements behind the defaults):

    - ``sparsity``: the fraction of coordinates a sparse step does not exchange. Bytes per
      step are about ``(1 - sparsity)`` of dense DDP plus the mask's share (indices or a
      bitmap, whichever is smaller). Quality cost grows with sparsity: measure before 0.99.
    - ``warmup_steps``: dense steps first. They fill the momentum the first mask is scored
      from and outlive DDP's bucket rebuild after iteration 1. Tens to hundreds of steps.
    - ``ramp_steps``: after the warm-up, denser masks for a while (25%, 6.25%, 1.6% density),
      as DGC's sparsity warm-up; the measured largest gain after the update rule.
    - ``update``: the masked update rule; ``"linear"`` (default) applies each coordinate's whole
      synchronized sum, ``"lazy"`` (the contract's first reading) one AdamS step per selection.
    - ``mask_delay``: 1 (default) gives each mask's all-gather a whole step to complete off the
      critical path; 0 waits for it (ablation).
    - ``mask_refresh``: steps between new masks; larger saves the mask bytes and top-k time.

    Everything is keyed by parameter name, never by DDP bucket index, so the bucket rebuild,
    several buckets, ``gradient_as_bucket_view``, ``static_graph`` and ``no_sync`` are safe and
    :meth:`state_dict` resumes bit-for-bit. Memory over AdamS: one fp32 residual per parameter
    plus the masks.

    Non-finite gradients: a rank with a NaN/inf anywhere in a bucket poisons that bucket's
    compact buffer, so every rank sees a non-finite reduction and all skip the optimizer step
    together (counted in ``skipped_steps``). Buckets poisoned that way drop this step's gradient;
    values synchronized in clean buckets go back into the residuals, so nothing sent is lost and
    ``m``, parameters and residuals stay finite.

    Args:
        model: the DistributedDataParallel-wrapped model (optionally under torch.compile).
        sparsity: shorthand for ``ScapeConfig.sparsity``.
        config: a full :class:`ScapeConfig`; other keyword arguments override its fields.
        process_group: the group to communicate over (default: the world).
    """

    def __init__(
        self,
        model: nn.Module,
        sparsity: float | None = None,
        *,
        config: ScapeConfig | None = None,
        process_group: dist.ProcessGroup | None = None,
        **fields: Any,
    ) -> None:
        if config is not None and not isinstance(config, ScapeConfig):
            raise TypeError(f"config must be a ScapeConfig, got {type(config).__name__}")
        if sparsity is not None:
            fields["sparsity"] = sparsity
        self.config = (config or ScapeConfig()).replace(**fields)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ScapeState needs torch.distributed initialized (dist.init_process_group)")
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        _check_model(model)
        self.watch = DDPWatch(model, self)  # says what happened when gradients arrive unsynchronized
        self.params = parameter_names(model)
        if not self.params:
            raise ValueError("the model has no trainable parameters")
        self.names = {id(p): n for n, p in self.params.items()}
        self._layouts: dict[float, MaskLayout] = {}  # one per density the ramp uses, built on first use
        self.step = 0  # optimizer steps taken (skipped ones included)
        self.residuals: dict[str, Tensor] = {}  # allocated at the first sparse step
        self.masks: dict[int, dict[str, Tensor]] = {}  # step -> mask used at that step
        self._pending: tuple[int, Any, list[Tensor]] | None = None  # (step, work, payloads)
        self._current = _Step()
        self.optimizer: Any = None
        self.counters = dict(steps=0, skipped_steps=0, hook_calls=0, values_sent=0, bytes_sent=0,
                             mask_bytes=0, dense_bytes=0)

    # ----- schedule -------------------------------------------------------------------
    def is_dense(self, step: int) -> bool:
        """Whether ``step`` exchanges every coordinate (warm-up or ``sparsity == 0``)."""
        return self.config.dense or step < self.config.warmup_steps

    def layout_at(self, step: int) -> MaskLayout:
        """The mask layout of ``step`` (its density follows the ramp); every rank derives it alone."""
        density = self.config.density_at(step)
        if density not in self._layouts:
            self._layouts[density] = MaskLayout({n: p.numel() for n, p in self.params.items()},
                                                self.world_size, density)
        return self._layouts[density]

    def _is_refresh(self, step: int) -> bool:
        return (step - self.config.warmup_steps) % self.config.mask_refresh == 0

    def current_mask(self) -> dict[str, Tensor] | None:
        """Mask of the step in progress; ``None`` on a dense step."""
        if self.is_dense(self.step):
            return None
        if self.step not in self.masks:
            if self.step - 1 - self.config.mask_delay >= 0:  # a step existed that should have picked it
                raise RuntimeError(f"no SCAPE mask is scheduled for step {self.step}: was "
                                   "ScapeAdamS.step() skipped, or the state reloaded without its masks?")
            # No step before this one could select it (warm-up shorter than the delay):
            # evenly spaced coordinates, identical on every rank without communication.
            self.masks[self.step] = self.layout_at(self.step).strided()
        return self.masks[self.step]

    # ----- hook side ------------------------------------------------------------------
    def residual(self, name: str) -> Tensor:
        """This rank's fp32 residual of ``name`` (zeros until something is left unsent)."""
        if name not in self.residuals:
            p = self.params[name]
            self.residuals[name] = torch.zeros(p.numel(), dtype=torch.float32, device=p.device)
        return self.residuals[name]

    def record_sync(self, names: list[str]) -> None:
        """Called once per bucket per backward; refuses a second sync before the optimizer step."""
        again = self._current.synced.intersection(names)
        if again:
            raise RuntimeError(
                "scape_hook synchronized the same gradients twice without ScapeAdamS.step() in "
                f"between (e.g. {sorted(again)[0]!r}): every sync flushes residuals that only the "
                "SCAPE optimizer applies. Use ScapeAdamS, and accumulate gradients under ddp.no_sync()."
            )
        self._current.synced.update(names)
        self.counters["hook_calls"] += 1

    def record_sent(self, name: str, mask: Tensor, values: Tensor) -> None:
        self._current.sent[name] = (mask, values)

    def record_nonfinite(self) -> None:
        self._current.nonfinite = True

    def count(self, values: int, nbytes: int, dense_bytes: int) -> None:
        self.counters["values_sent"] += values
        self.counters["bytes_sent"] += nbytes
        self.counters["dense_bytes"] += dense_bytes

    # ----- optimizer side -------------------------------------------------------------
    def begin_step(self, names_with_grad: list[str]) -> tuple[dict[str, Tensor] | None, bool]:
        """Check the hook synchronized every gradient; returns ``(mask or None, skip)``."""
        missing = [n for n in names_with_grad if n not in self._current.synced]
        if missing:
            raise RuntimeError(self.watch.explain(missing))
        self.watch.stepped(names_with_grad)
        return (None if self.is_dense(self.step) else self.masks[self.step]), self._current.nonfinite

    def end_step(self, momenta: dict[str, Tensor], beta1: dict[str, float], applied: set[str],
                 synced_at: dict[str, Tensor] | None = None) -> None:
        """Close the step, then schedule upcoming masks.

        Values that were synchronized but not applied (a skipped step, or a parameter with no
        gradient on the optimizer side) go back into the residual: nothing sent is lost.
        """
        for name, (mask, values) in self._current.sent.items():
            if name not in applied:
                self.residual(name).index_add_(0, mask, values.float())
        if self._current.nonfinite:
            self.counters["skipped_steps"] += 1
        self._current = _Step()
        done, self.step = self.step, self.step + 1
        self.counters["steps"] += 1
        if self.config.dense:
            return
        self._finish_pending()
        target = done + 1 + self.config.mask_delay
        if not self.is_dense(target):
            if self._is_refresh(target):
                self._select(target, momenta, beta1, synced_at or {})
            else:
                self.masks[target] = self.masks[target - 1]
        if self.config.mask_delay == 0:
            self._finish_pending()
        self.masks = {s: m for s, m in self.masks.items() if s >= self.step}

    def _select(self, target: int, momenta: dict[str, Tensor], beta1: dict[str, float],
                synced_at: dict[str, Tensor]) -> None:
        """Score and pick this rank's partitions, then start the all-gather of every rank's picks."""
        scheduled = self.masks.get(target - 1) if self.config.mask_delay else None
        layout = self.layout_at(target)
        picks = {}
        for slot in layout.partition(self.rank):
            if not slot.k:
                continue
            p = self.params[slot.name]
            part = slice(slot.start, slot.start + slot.size)
            m = momenta.get(slot.name)
            m = torch.zeros(slot.size, device=p.device) if m is None else m.view(-1)[part].float()
            synced = synced_at.get(slot.name)
            residual = self.residuals.get(slot.name)
            score = mask_score(self.config.resolved_score, m, target=target,
                               synced_at=None if synced is None else synced.view(-1)[part],
                               residual=None if residual is None else residual[part],
                               beta1=beta1.get(slot.name, 0.9))
            # the scheduled mask's residual is about to be flushed: don't pick it twice
            exclude = None if scheduled is None else scheduled_in(scheduled[slot.name], slot.start, slot.size)
            picks[slot.name] = select_topk(score, slot.k, exclude)
        device = next(iter(self.params.values())).device
        payload = layout.encode(self.rank, picks, device=device)
        out = [torch.empty_like(payload) for _ in range(self.world_size)]
        work = inflight.hold(dist.all_gather(out, payload, group=self.process_group, async_op=True))
        self.counters["mask_bytes"] += payload.numel()
        self.counters["bytes_sent"] += payload.numel()
        self._pending = (target, layout, work, out)

    def wait(self) -> None:
        """Finish SCAPE's in-flight collectives; call before ``dist.destroy_process_group()``.

        Each step starts the all-gather of a future mask, and gloo finishes each all-reduce's
        callback on its own thread; tearing the process group down (or exiting) under either
        can abort the process (gloo: "terminate called without an active exception").
        """
        self._finish_pending()
        inflight.finish_all()

    def _finish_pending(self) -> None:
        if self._pending is None:
            return
        target, layout, work, out = self._pending
        work.wait()
        self.masks[target] = {n: m.to(self.params[n].device) for n, m in layout.decode(
            [o.cpu() for o in out]).items()}
        self._pending = None

    # ----- reporting and checkpoints --------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Communication so far on this rank: steps, values/bytes sent, dense bytes, compression."""
        c = dict(self.counters)
        c["compression"] = c["dense_bytes"] / c["bytes_sent"] if c["bytes_sent"] else 1.0
        return c

    def state_dict(self) -> dict[str, Any]:
        """This rank's state: step, scheduled masks, residuals, counters (waits for a pending mask)."""
        self._finish_pending()
        return {
            "format": STATE_FORMAT,
            "step": self.step,
            "world_size": self.world_size,
            "rank": self.rank,
            "config": self.config.to_dict(),
            "shapes": {n: tuple(p.shape) for n, p in self.params.items()},
            "masks": {s: {n: i.to(torch.int32).cpu() for n, i in m.items()} for s, m in self.masks.items()},
            "residual": {n: r.detach().cpu().clone() for n, r in self.residuals.items()},
            "counters": dict(self.counters),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (this rank) or :func:`gather_state_dict` (all ranks).

        A gathered state at the same world size gives each rank its own residual back; at
        another world size every rank gets the old ranks' mean (keeping the global unsent
        gradient) with a warning. Everything is validated before anything is changed.
        """
        residual = self.check_loadable(state)
        saved_world = len(state["residuals"]) if "residuals" in state else self.world_size
        if saved_world != self.world_size and self.rank == 0:  # once per load, not once per rank
            warnings.warn(f"resuming SCAPE state saved at world size {saved_world} on world size "
                          f"{self.world_size}: every rank starts from the mean residual", stacklevel=2)
        self._finish_pending()
        self.step = int(state["step"])
        self.masks = {int(s): {n: i.to(torch.long).to(self.params[n].device) for n, i in m.items()}
                      for s, m in state["masks"].items()}
        self.residuals = {n: r.to(device=self.params[n].device, dtype=torch.float32).clone()
                          for n, r in residual.items()}
        self.counters.update(state["counters"])
        self._current = _Step()

    def check_loadable(self, state: dict[str, Any]) -> dict[str, Tensor]:
        """Validate a saved state against this run (raises ValueError); returns this rank's residual."""
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            raise ValueError("not a SCAPE state (expected the dict from ScapeState.state_dict "
                             f"or gather_state_dict, format {STATE_FORMAT})")
        shapes = {n: tuple(s) for n, s in state["shapes"].items()}
        ours = {n: tuple(p.shape) for n, p in self.params.items()}
        if shapes != ours:
            diff = sorted(set(shapes) ^ set(ours)) or [n for n in ours if shapes[n] != ours[n]]
            raise ValueError(f"SCAPE state was saved for another model: parameters differ at {diff[:5]}")
        self.config.check_resume(state["config"], int(state["step"]), state["masks"])
        if "residuals" in state:  # gathered: one residual dict per saved rank
            per_rank = state["residuals"]
            if len(per_rank) == self.world_size:
                return per_rank[self.rank]
            names = set().union(*per_rank) if per_rank else set()
            return {n: torch.stack([r[n] if n in r else torch.zeros_like(self.residual(n).cpu())
                                    for r in per_rank]).float().mean(0) for n in names}
        if state["world_size"] != self.world_size or state["rank"] != self.rank:
            raise ValueError(
                f"this SCAPE state is rank {state['rank']} of world size {state['world_size']}; "
                f"to resume on rank {self.rank} of {self.world_size}, save with gather_state_dict()")
        return state["residual"]


def gather_state_dict(state: ScapeState) -> dict[str, Any]:
    """Every rank's SCAPE state in one object (collective: call on all ranks).

    Rank 0 can write it to a single checkpoint file; :meth:`ScapeState.load_state_dict` on each
    rank takes its own residual back (or the mean, at another world size).

    Example:
        >>> full = gather_state_dict(state)          # doctest: +SKIP
        >>> if dist.get_rank() == 0: torch.save({"scape": full, ...}, path)
    """
    own = state.state_dict()
    names = sorted(own["residual"])
    numels = [state.params[n].numel() for n in names]
    local = torch.cat([own["residual"][n] for n in names]) if names else torch.zeros(0)
    all_names: list[Any] = [None] * state.world_size
    dist.all_gather_object(all_names, names, group=state.process_group)
    if any(n != names for n in all_names):
        raise RuntimeError("ranks hold residuals for different parameters; cannot gather")
    device = next(iter(state.params.values())).device
    out = [torch.empty_like(local, device=device) for _ in range(state.world_size)]
    dist.all_gather(out, local.to(device), group=state.process_group)
    full = {k: v for k, v in own.items() if k not in ("residual", "rank")}
    full["residuals"] = [dict(zip(names, o.cpu().split(numels))) for o in out]
    return full
