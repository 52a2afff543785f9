"""The replica guard: every rank holds the same replicated state, checked while training runs.

SCAPE's correctness rests on one invariant: every rank that shares parameters holds bit-identical
parameters, ``m``, update-rule statistics, windows and scheduled masks, because each rank selects
the next mask and applies the next update from them alone. A nondeterministic kernel, a per-rank
seed or initialization, a rank that loaded another checkpoint or a parameter changed on one rank
would break it silently: every mask after would be wrong, with no error.

:class:`ReplicaGuard` compares a fingerprint of that state across the ranks (the group SCAPE
exchanges over: DDP's, or the replicate dimension of FSDP2) at the first step, every
``ScapeConfig.replica_check_every`` optimizer steps and before every checkpoint is gathered: per
parameter and buffer, the sum of the values' bits as 64-bit integers (a change of one ulp changes
it), all-gathered in one small collective (``8 x buffers x parameters`` bytes a rank). On a
mismatch every rank raises the same error, naming the first buffer and parameter that differ, the
step and the likely causes. A check reads the device once (the verdict); steps between checks do
nothing.

With ``shard_optimizer`` each rank keeps its own rows of ``m``, the statistics and the windows, so
the parameters and the masks are compared.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from scape_core import inflight, native
from scape_core.communicator import Communicator
from scape_core.compat import all_gather_into_tensor
from scape_core.layout import FlatLayout

CAUSES = ("a nondeterministic kernel in what every rank computes alike (the optimizer step, the mask's "
          "selection; the model's own forward and backward may differ: gradients are each rank's own), "
          "different seeds or initialization of the parameters or the optimizer state per rank, a rank that "
          "loaded another checkpoint, or a parameter or optimizer state changed on one rank only")


KERNELS = ("the CPU kernels in use (SCAPE's C kernels, or torch's operators on a rank where no C compiler works: "
           "install one there, or set CC)")


class Replicated(NamedTuple):
    """What every rank of the group must hold alike, as the state hands it to the guard."""

    step: int  # optimizer steps taken
    layout: FlatLayout
    params: dict[str, Tensor]  # each parameter's tensor on this rank (its local shard under FSDP2), by name
    buffers: dict[str, Tensor]  # m, the rule's statistics, the windows ((rows, chunk) each; none when sharded)
    masks: dict[int, Tensor]  # the scheduled masks' columns, by the step that uses them
    scratch: Tensor | None  # a (rows, chunk) fp32 buffer the parameters may pass through (else one is made)


class ReplicaMismatch(RuntimeError):
    """The ranks' replicated state differs (every rank raises it, with the same message)."""


class ReplicaGuard:
    """Compares every rank's fingerprint of the replicated state (see the module docstring).

    Example:
        >>> from scape_core import ScapeState
        >>> state = ScapeState(ddp, sparsity=0.99, replica_check_every=100)
        >>> state.guard.due(100), state.guard.due(150)
        (True, False)
        >>> state.guard.check(state.replicated(), state.comm)   # collective: every rank calls it (end_step does)
    """

    def __init__(self, every: int) -> None:
        self.every = every
        self.loaded = False  # a state was loaded: the next step checks whatever the interval
        self._row_param: Tensor | None = None  # each layout row's parameter (its index among the names)

    def due(self, step: int) -> bool:
        """Whether the check runs after ``step`` optimizer steps: the first, every ``every``, and the first
        after a state was loaded (every rank loads at the same point of the program, so all check then)."""
        return bool(self.every) and (step == 1 or step % self.every == 0 or self.loaded)

    def fingerprints(self, state: Replicated) -> tuple[list[str], Tensor]:
        """``(buffer names, (buffers, parameters) int64)``: per buffer and parameter, the sum of the values'
        bits (the parameters pass through an fp32 buffer, exactly; an fp64 one adds its own bits)."""
        layout = state.layout
        names = list(layout.numel)
        if self._row_param is None:
            self._row_param = torch.tensor([i for i, n in enumerate(names) for _ in range(layout.nrows[n])],
                                           device=layout.device)
        # the step's staging buffer if it has one (its padding stays 0: only parameters' coordinates are written),
        # else a buffer for this check alone: the C loops on the CPU keep none between steps
        staging = state.scratch if state.scratch is not None else layout.zeros()
        local = state.params
        torch._foreach_copy_(layout.views(staging, names), [local[n].detach().reshape(-1) for n in names])
        buffers: dict[str, Tensor] = {"parameters": staging, **state.buffers}
        rows = [b.view(torch.int32).sum(1) for b in buffers.values()]
        for step, cols in sorted(state.masks.items()):
            buffers[f"mask of step {step}"] = cols
            rows.append(cols.sum(1))
        per_row = torch.stack(rows)
        out = torch.zeros(per_row.shape[0], len(names), dtype=torch.long, device=layout.device)
        out.index_add_(1, self._row_param, per_row)
        for i, name in enumerate(names):  # wider than the fp32 staging (fp64): its own bits too
            if local[name].element_size() > 4 and local[name].is_floating_point():
                out[0, i] += local[name].detach().reshape(-1).view(torch.int64).sum()
        return list(buffers), out

    def check(self, state: Replicated, comm: Communicator) -> None:
        """Compare the ranks' fingerprints of ``state`` (collective over ``comm``'s group; reads the device
        once) and raise :class:`ReplicaMismatch` on every rank if any rank's differs from rank 0's. Nothing
        with ``replica_check_every=0`` or at world size 1."""
        self.loaded = False
        if not self.every or comm.world_size == 1:
            return
        what, mine = self.fingerprints(state)
        # the last row: the step count (ranks that loaded other checkpoints) and, above bit 48, whether this rank
        # runs the C kernels, which round the update's root as the hardware does (torch: its own way per CPU)
        what.append("the optimizer step count")
        uses_c = state.layout.device.type == "cpu" and native.available()
        mine = torch.cat([mine, torch.full_like(mine[:1], state.step + (int(uses_c) << 48))])
        every = mine.new_empty(comm.world_size * mine.numel())
        inflight.collective(all_gather_into_tensor, every, mine.view(-1), group=comm.process_group)
        every = every.view(comm.world_size, *mine.shape).cpu()
        differ = (every != every[0]).any(0)  # (buffers, parameters)
        if not bool(differ.any()):
            return
        ranks = [r for r in range(comm.world_size) if bool((every[r] != every[0]).any())]
        if bool(((every[:, -1, 0] >> 48) != (every[0, -1, 0] >> 48)).any()):  # named first: all differs from then
            subject = KERNELS
        else:
            buffer, param = (int(i) for i in differ.nonzero()[0])
            subject = f"{what[buffer]} of parameter {list(state.layout.numel)[param]!r}"
        raise ReplicaMismatch(
            f"SCAPE: the ranks' replicated state differs after optimizer step {state.step}: {subject} (rank(s) "
            f"{ranks} differ from rank 0; {int(differ.sum())} buffer-parameter pairs in all). Every rank must "
            f"compute the same parameters, m, statistics and masks, or each selects and applies a different "
            f"update. Likely causes: {CAUSES}.")
