"""Who a SCAPE state talks to and what it has sent: the process group, this rank, the counters."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

COUNTERS = ("steps", "hook_calls", "values_sent", "bytes_sent", "mask_bytes", "dense_bytes", "shard_bytes")


@dataclass
class Communicator:
    """The group a state's collectives run over (``None``: the default group), this rank in it, the group's
    size and the counters of what was sent (``shard_bytes``: the sharded mode's all-gathers, also in
    ``bytes_sent``). The exchange, the selector's and the shards' all-gathers and the checkpoint's
    collectives read it; the counters grow as each step completes. (The wire is the regions'
    :class:`~scape_core.buckets.Buckets`', which make its plans.)

    Example:
        >>> comm = Communicator(None, rank=0, world_size=2)
        >>> comm.counters["bytes_sent"], comm.group_kwargs()["world_size"]
        (0, 2)
    """

    process_group: dist.ProcessGroup | None
    rank: int
    world_size: int
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))

    def group_kwargs(self) -> dict:
        """``rank``, ``world_size``, ``process_group`` and ``counters``: what the selector and the shards take."""
        return dict(rank=self.rank, world_size=self.world_size, process_group=self.process_group,
                    counters=self.counters)
