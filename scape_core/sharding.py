"""The sharded mode's collectives (ZeRO-1, ``shard_optimizer=True``): what the owners of rows exchange.

Each rank keeps ``m``, the rule's statistics and the windows for its block of rows
(:meth:`~scape_core.layout.FlatLayout.shard`). A sparse step runs the rule on the mask entries
a rank owns and all-gathers every owner's update (:meth:`ShardExchange.gather_updates`); a
dense step updates the block and all-gathers the parameters (:meth:`ShardExchange.gather_parameters`).
Replicated (not sharded), every rank owns every row and nothing here communicates.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from scape_core import inflight
from scape_core.compat import all_gather_into_tensor
from scape_core.layout import FlatLayout, Shard
from scape_core.masks import Mask


class ShardPlan:
    """Where the entries of a mask of one density sit when each rank owns a block of rows: this
    rank's among the mask's entries, and every rank's in an all-gather of the owners' values
    (each owner's full-row entries, then its shorter rows', padded to the largest owner's count)."""

    def __init__(self, layout: FlatLayout, density: float, rank: int, world: int) -> None:
        shape = layout.mask_shape(density)
        spans = [shape.rows_spans(s.start, s.stop) for s in (layout.shard(r, world) for r in range(world))]
        self.most = max(sum(hi - lo for lo, hi in own) for own in spans)
        index = torch.int32 if world * self.most < 2 ** 31 else torch.long  # half the memory where it fits
        order = torch.empty(shape.entries, dtype=index)
        for r, own in enumerate(spans):
            at = r * self.most
            for lo, hi in own:
                order[lo:hi] = torch.arange(at, at + hi - lo)
                at += hi - lo
        self.order = order.to(layout.device)  # gathered position of each of the mask's entries
        self.positions = torch.cat([torch.arange(lo, hi, dtype=index) for lo, hi in spans[rank]]).to(layout.device)


class ShardExchange:
    """The owners' side of a step: which mask entries this rank updates, and the all-gathers after.

    Example:
        >>> layout = FlatLayout({"w": torch.zeros(4, 8)}, chunk=8)
        >>> shards = ShardExchange(layout, sharded=False, rank=0, world_size=1, counters={})
        >>> shards.shard.rows, shards.unshard(layout.zeros()).shape
        (4, torch.Size([4, 8]))
    """

    def __init__(self, layout: FlatLayout, *, sharded: bool, rank: int, world_size: int,
                 counters: dict[str, int], process_group: dist.ProcessGroup | None = None,
                 densities: tuple[float, ...] = ()) -> None:
        self.layout, self.sharded = layout, sharded
        self.rank, self.world_size, self.process_group = rank, world_size, process_group
        self.counters = counters  # values_sent, bytes_sent and shard_bytes grow with each all-gather
        # rows whose m, rule statistics and windows this rank keeps: its block, or every row
        self.shard = layout.shard(rank, world_size) if sharded else Shard(layout, 0, layout.rows)
        self._plans: dict[float, ShardPlan] = {}
        for density in densities if sharded else ():  # built now: their first use reads the device once
            self.plan(density)

    def plan(self, density: float) -> ShardPlan:
        """The plan of masks of ``density`` (built once; building reads the device)."""
        if density not in self._plans:
            self._plans[density] = ShardPlan(self.layout, density, self.rank, self.world_size)
        return self._plans[density]

    def keep_plans(self, densities: tuple[float, ...]) -> None:
        """Drop the plans of other densities (the ramp's past stages: at 25% density a plan is 1.5 B/param at W = 2)."""
        self._plans = {d: plan for d, plan in self._plans.items() if d in densities}

    def own_entries(self, mask: Mask) -> tuple[Tensor | None, Tensor]:
        """The mask's entries whose optimizer state this rank keeps: ``(their positions among the
        mask's entries, or None for all of them; their flat indices into the shard's buffers)``."""
        entries = mask.flat(self.layout)
        if not self.sharded:
            return None, entries
        positions = self.plan(mask.density).positions
        return positions, entries.index_select(0, positions).sub_(self.shard.start * self.layout.chunk)

    def gather_updates(self, own: Tensor, density: float) -> Tensor:
        """Every owner's values for its entries of a mask of ``density``, all-gathered (collective),
        in the mask's entry order: what each rank needs to apply the update everywhere."""
        plan = self.plan(density)
        send = torch.nn.functional.pad(own, (0, plan.most - own.numel()))
        out = send.new_empty(self.world_size * plan.most)
        inflight.collective(all_gather_into_tensor, out, send, group=self.process_group)
        self._count(send)
        return out.index_select(0, plan.order)

    def gather_parameters(self, params: dict[str, Tensor]) -> None:
        """After a dense step updated this rank's shard of every parameter, give every rank all the
        new values: one all-gather of the shards in fp32 (collective; exact for bf16 parameters)."""
        send = self.shard.zeros()
        own = self.shard.names
        torch._foreach_copy_([self.shard.view(send, n) for n in own],
                             [self.shard.part(params[n].detach(), n) for n in own])
        full = self.unshard(send)
        self._count(send)
        torch._foreach_copy_([p.detach().view(-1) for p in params.values()], self.layout.views(full, list(params)))

    def unshard(self, buffer: Tensor) -> Tensor:
        """The whole ``(rows, chunk)`` buffer from every rank's shard of it (collective when sharded;
        ``buffer`` itself when not). For checkpoints and tests, not for the training step."""
        if not self.sharded:
            return buffer
        block, chunk = self.layout.block(self.world_size), self.layout.chunk
        if buffer.shape[0] != block:
            buffer = torch.cat([buffer, buffer.new_zeros(block - buffer.shape[0], chunk)])
        out = buffer.new_empty(self.world_size * block, chunk)
        inflight.collective(all_gather_into_tensor, out, buffer.contiguous(), group=self.process_group)
        return out[:self.layout.rows]

    def _count(self, sent: Tensor) -> None:
        nbytes = sent.numel() * sent.element_size()
        self.counters["values_sent"] += sent.numel()
        self.counters["bytes_sent"] += nbytes
        self.counters["shard_bytes"] += nbytes
