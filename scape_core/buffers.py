"""The tensors a sparse step reads and writes on this rank, by role, and nothing of the step's logic.

:class:`Buffers` holds the flat layout and the ``(rows, chunk)`` fp32 buffers laid out by it: the
residual (every row: this rank's unsent gradient), ``m`` and the update rule's statistics and the
windows (the rows whose optimizer state this rank keeps; the windows hold the step each coordinate
was last exchanged at) and the eager step's staging scratch. The state makes the residual and the
windows at the first sparse step (``ScapeStateBase.start_sparse``), the optimizer ``m`` and the
statistics when it is built; the exchange (:mod:`scape_core.exchange`) writes the residual, the
optimizer the rest, and the checkpoint (:mod:`scape_core.checkpoint`) saves and restores the
residual and the windows by parameter name (the optimizer's state dict, ``m`` and the statistics).
"""

from __future__ import annotations

from torch import Tensor

from scape_core.layout import FlatLayout


class Buffers:
    """The layout and its buffers (``None`` until made).

    Example:
        >>> import torch
        >>> buffers = Buffers(FlatLayout({"w": torch.zeros(6)}, chunk=4))
        >>> buffers.residual is None, buffers.m is None, tuple(buffers.staging().shape)
        (True, True, (2, 4))
        >>> buffers.flat(buffers.staging()).shape
        torch.Size([8])
    """

    def __init__(self, layout: FlatLayout) -> None:
        self.layout = layout
        self.residual: Tensor | None = None  # (rows, chunk) fp32, this rank's unsent gradient
        self.m: Tensor | None = None  # (shard rows, chunk) fp32: the optimizer's momentum (made by it)
        self.statistics: dict[str, Tensor] = {}  # the update rule's, by name, shaped as m
        # (shard rows, chunk) fp32 (exact to 2^24 steps): the step each coordinate was last exchanged at
        self.windows: Tensor | None = None
        self.staging_buffer: Tensor | None = None  # (rows, chunk) fp32 scratch of the eager step (staging())
        self._flats: dict[int, tuple[Tensor, Tensor]] = {}  # flat(): each buffer's 1-D view, by id

    def staging(self) -> Tensor:
        """The ``(rows, chunk)`` fp32 scratch buffer a sparse step's gradients pass through in the layout's
        order off the CPU's C loops (made at its first use): the hook stages and settles the exchange in it,
        the optimizer reads the synchronized gradients and writes the update there. It holds nothing
        between steps."""
        if self.staging_buffer is None:
            self.staging_buffer = self.layout.zeros()
        return self.staging_buffer

    def flat(self, buffer: Tensor) -> Tensor:
        """The 1-D view of one of the step's persistent buffers (the residual, the staging buffer, the
        optimizer's), made once per buffer: a sparse step writes them at the mask's entries, and a view
        made each step is one more operator each."""
        found = self._flats.get(id(buffer))
        if found is None or found[0] is not buffer:
            found = self._flats[id(buffer)] = (buffer, buffer.view(-1))
        return found[1]

    def drop(self) -> None:
        """Forget the residual and the windows (a state is being loaded: they are made anew)."""
        self.residual = self.windows = None
        self._flats.clear()  # the replaced buffers' views
