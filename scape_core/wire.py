"""Encoded wires: how a sparse step's compact buffer travels in fewer bits than the gradients have.

On a sparse step every rank sends the same number of values (the mask's entries, ``E``, in the
mask's order, once per step whatever DDP's buckets: so a value's rounding and its owner never
depend on which bucket carried it). On the native wire (``ScapeConfig(wire="native")``, which the
default ``"auto"`` picks below 95% sparsity) they go out in the gradients' dtype, in one all-reduce. An encoded wire
(``"bfloat16"``, ``"int8"``, ``"int4"``) cannot be summed in the collective without losing the
sum (int8 overflows, bf16 rounds at every hop), so it is reduced in two stages, as ZeRO++'s qgZ:

1. Each rank encodes its ``E`` values (padded to ``W`` equal *segments*) and sends segment ``j``
   to rank ``j`` (one all-to-all). It keeps what the encoding rounded away in its residual.
2. Rank ``j`` decodes the ``W`` copies of its segment, sums them in fp32 (ranks in order) and
   divides by ``W``: the mean. It encodes the mean and all-gathers it; every rank decodes the
   same bytes, so every rank applies the same values. The owner keeps ``W`` times what this
   second encoding rounded away in its residual, so the mean residual holds it: conservation
   (applied + mean residual = sum of mean gradients) stays exact up to fp32 rounding.

The two stages move as many bytes as one all-reduce of the encoded buffer (a ring all-reduce is
a reduce-scatter plus an all-gather), so bytes are counted as that buffer's size.

Integer wires scale each *block* of at most ``block`` values (inside a segment) by its largest
magnitude: ``q = round(x / scale)`` with ``scale = max|x| / qmax`` (127 for int8, 7 for int4,
two int4 values per byte), one fp32 scale per block, sent beside the values. A non-finite value
makes its block's scale non-finite, so the whole block decodes as NaN (or an infinity): a rank
with a non-finite gradient poisons the exchange, which every rank then drops whole
(:mod:`scape_core.exchange`). A few operators per stage, whatever the number of values.

Example:
    >>> plan = WirePlan("int8", entries=10, world=2, block=4)
    >>> plan.segment, plan.blocks, plan.row_bytes, plan.nbytes  # 2 segments of 6 values, 2 blocks each
    (6, 2, 14, 28)
    >>> x = torch.tensor([[1.0, -2.0, 0.5, 0.0, 3.0, 0.25]])
    >>> decode(plan, encode(plan, x))  # blocks [1, -2, 0.5] and [0, 3, 0.25]: 127 steps of max/127
    tensor([[ 1.0079, -2.0000,  0.5039,  0.0000,  3.0000,  0.2598]])
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from scape_core.kernels import Kernels

_BITS = {"bfloat16": 16, "int8": 8, "int4": 4}  # the shipped wires; prototypes add theirs (register_integer_wire)
_QMAX = {"int8": 127, "int4": 7}


def register_integer_wire(name: str, bits: int) -> None:
    """Make ``name`` a :class:`WirePlan` wire of ``bits``-bit integers (2 or 4: whole values per byte;
    8 is int8), symmetric around 0 with one fp32 scale per block. For prototypes (``benchmarks/``):
    ``ScapeConfig.wire`` accepts the shipped wires only.

    Example:
        >>> register_integer_wire("int2", 2)
        >>> WirePlan("int2", entries=8, world=1).row_bytes   # 8 values in 2 bytes, one fp32 scale
        6
    """
    if bits not in (2, 4):
        raise ValueError(f"bits must be 2 or 4, got {bits!r}")
    _BITS[name], _QMAX[name] = bits, 2 ** (bits - 1) - 1


@dataclass(frozen=True)
class WirePlan:
    """The fixed shape of one compact buffer of ``entries`` values on ``world`` ranks in ``wire``.

    ``segment`` values per rank (``world * segment >= entries``, the rest zero padding), cut into
    ``blocks`` blocks of ``block_len`` values, one fp32 scale each (integer wires). One rank's
    encoded segment is ``row_bytes`` bytes; the whole buffer ``nbytes = world * row_bytes``.
    """

    wire: str
    entries: int
    world: int
    block: int = 128
    segment: int = field(init=False)
    blocks: int = field(init=False)
    block_len: int = field(init=False)

    def __post_init__(self) -> None:
        if self.wire not in _BITS:
            raise ValueError(f"wire must be one of {tuple(_BITS)}, got {self.wire!r}")
        per_rank = max(1, -(-self.entries // self.world))
        blocks = -(-per_rank // self.block) if self.scaled else 1
        block_len = -(-per_rank // blocks)
        per_byte = max(1, 8 // _BITS[self.wire])
        block_len = -(-block_len // per_byte) * per_byte  # whole bytes
        object.__setattr__(self, "blocks", blocks)
        object.__setattr__(self, "block_len", block_len)
        object.__setattr__(self, "segment", blocks * block_len)

    @property
    def scaled(self) -> bool:
        """Whether values travel as integers with per-block scales."""
        return self.wire in _QMAX

    @property
    def value_bytes(self) -> int:
        """Bytes of one segment's values."""
        return self.segment * _BITS[self.wire] // 8

    @property
    def row_bytes(self) -> int:
        """Bytes of one encoded segment: values, then the scales (fp32)."""
        return self.value_bytes + (4 * self.blocks if self.scaled else 0)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole encoded buffer (what one rank contributes, as to an all-reduce)."""
        return self.world * self.row_bytes


def encode(plan: WirePlan, x: Tensor) -> Tensor:
    """Segments ``x`` (``(..., segment)`` fp32) as bytes ``(..., row_bytes)`` uint8."""
    return encode_decoded(plan, x)[0]


def encode_decoded(plan: WirePlan, x: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`encode`, and what :func:`decode` gives back from those bytes (the same fp32 values),
    computed before packing rather than decoded: what the sender keeps of a value is ``x`` minus it.
    A block holding a non-finite value decodes as non-finite throughout (its scale is).

    Example:
        >>> plan = WirePlan("int4", entries=4, world=1, block=4)
        >>> data, back = encode_decoded(plan, torch.tensor([[1.0, -2.0, 0.3, 0.0]]))
        >>> back, torch.equal(back, decode(plan, data))
        (tensor([[ 0.8571, -2.0000,  0.2857,  0.0000]]), True)
    """
    if plan.wire == "bfloat16":
        data = x.to(torch.bfloat16)
        return data.view(torch.uint8), data.float()
    qmax = _QMAX[plan.wire]
    blocks = x.unflatten(-1, (plan.blocks, plan.block_len))
    # an all-zero block: the smallest normal scale, so that 0 / scale is 0 (a NaN or inf propagates)
    scale = blocks.abs().amax(-1, keepdim=True).div_(qmax).clamp_min_(torch.finfo(torch.float32).tiny)
    q = blocks.div(scale).round_().clamp_(-qmax, qmax)
    decoded = q.mul(scale).flatten(-2)  # decode's q * scale, before packing
    q = q.flatten(-2)
    if plan.wire == "int8":
        values = q.to(torch.int8).view(torch.uint8)
    else:  # several values per byte, offset to 0..2 qmax
        bits, per_byte = _BITS[plan.wire], 8 // _BITS[plan.wire]
        u = q.add_(qmax).to(torch.uint8).unflatten(-1, (-1, per_byte))
        values = u[..., 0]
        for i in range(1, per_byte):
            values = values | (u[..., i] << (bits * i))
    return torch.cat([values, scale.flatten(-2).view(torch.uint8)], dim=-1), decoded


def decode(plan: WirePlan, data: Tensor) -> Tensor:
    """The fp32 values ``(..., segment)`` of encoded segments ``(..., row_bytes)``."""
    if plan.wire == "bfloat16":
        return data.view(torch.bfloat16).float()
    values = data[..., :plan.value_bytes]
    scale = data[..., plan.value_bytes:].clone(memory_format=torch.contiguous_format).view(torch.float32)
    qmax = _QMAX[plan.wire]
    if plan.wire == "int8":
        q = values.view(torch.int8).float()
    else:
        bits, per_byte = _BITS[plan.wire], 8 // _BITS[plan.wire]
        mask = (1 << bits) - 1
        parts = [values & mask] + [(values >> (bits * i)) & mask for i in range(1, per_byte)]
        q = torch.stack(parts, dim=-1).flatten(-2).float().sub_(qmax)
    return q.unflatten(-1, (plan.blocks, plan.block_len)).mul_(scale.unsqueeze(-1)).flatten(-2)


def pad(plan: WirePlan, x: Tensor) -> Tensor:
    """``x`` (``(..., entries)``) zero-padded and cut into segments: ``(..., world, segment)``."""
    out = torch.nn.functional.pad(x, (0, plan.world * plan.segment - plan.entries))
    return out.unflatten(-1, (plan.world, plan.segment))


def owner_mean(plan: WirePlan, received: Tensor) -> Tensor:
    """The owner's mean of its segment from every rank's encoded copy (``(world, row_bytes)``), ranks in order."""
    return decode(plan, received).sum(0).div_(plan.world)


class WireBuffers:
    """An encoded wire's three stages on buffers made once per :class:`WirePlan` (the eager path): :meth:`send`,
    then (once :attr:`received` holds the all-to-all's result) :meth:`own_mean`, then (once :attr:`gathered`
    holds the all-gather's) :meth:`decode_gathered`.

    Every stage writes into these buffers with ``out=`` and in-place operators through views made here, so
    a step makes no tensor and no view: a fixed number of operators whatever the plan, the same bytes as
    :func:`encode`, :func:`decode` and :func:`owner_mean` (the readable reference, which the compiled
    passes run; tests/test_wire.py checks both give the same bits). The buffers of one step are
    overwritten by the next: what a stage returns is read before then (the exchange waits for its
    collectives).

    Example:
        >>> plan = WirePlan("int4", entries=5, world=2, block=4)
        >>> buffers = WireBuffers(plan, rank=0, device=torch.device("cpu"))
        >>> data, kept = buffers.send(torch.tensor([1.0, -2.0, 0.3, 0.0, 0.5]))
        >>> torch.equal(data, encode(plan, pad(plan, torch.tensor([1.0, -2.0, 0.3, 0.0, 0.5]))))
        True
    """

    def __init__(self, plan: WirePlan, rank: int, device: torch.device) -> None:
        self.plan = plan
        w, b, n = plan.world, plan.blocks, plan.block_len
        self.segments = torch.zeros(w * b, n, device=device)  # this rank's values, padded: the padding stays 0
        self.values = self.segments.view(-1)[:plan.entries]
        self.kept = torch.zeros(w * b, n, device=device)  # what the encoding rounded away
        self.kept_values = self.kept.view(-1)[:plan.entries]
        self.sent = _Encoded(plan, w, device)
        self.copies = torch.empty(w * b, n, device=device)  # every rank's copy of this rank's segment, decoded
        self._received = _Encoded(plan, w, device, decoded=self.copies)
        self.received = self._received.data  # the all-to-all's output: every rank's copy of this rank's segment
        self.by_rank = self.copies.view(w, -1)
        self.mean = torch.empty(b, n, device=device)  # the owner's mean of its segment (then its rounding)
        self.mean_flat = self.mean.view(-1)
        self.own = _Encoded(plan, 1, device)
        self.own_bytes = self.own.data.view(-1)
        lo = rank * plan.segment  # the owner's segment among the entries
        hi = max(lo, min(lo + plan.segment, plan.entries))
        self.own_kept = self.kept_values[lo:hi]
        self.own_rounding = self.mean_flat[:hi - lo]
        self.gathered = torch.empty(w * plan.row_bytes, dtype=torch.uint8, device=device)  # the all-gather's output
        self.means = torch.empty(w * b, n, device=device)
        self.every = _Encoded(plan, w, device, data=self.gathered.view(w, plan.row_bytes), decoded=self.means)
        self.means_values = self.means.view(-1)[:plan.entries]

    def send(self, values: Tensor) -> tuple[Tensor, Tensor]:
        """The first stage: ``values`` (``(entries,)`` fp32) encoded in segments; returns the bytes to send
        (``(W, row_bytes)``) and what the encoding rounded away (``(entries,)``)."""
        self.values.copy_(values)
        self.sent.encode(self.segments, self.kept)
        return self.sent.data, self.kept_values

    def own_mean(self) -> Tensor:
        """The owner's stage, from :attr:`received` (every rank's copy of this rank's segment): the mean,
        encoded (returned, ``(row_bytes,)``), and ``W`` times what that encoding rounded away added to this
        rank's kept values of its segment (the owner's residual keeps it)."""
        self._received.decode()
        torch.sum(self.by_rank, 0, out=self.mean_flat)
        self.mean.div_(self.plan.world)
        self.own.encode(self.mean, self.mean)  # the mean's rounding, in place
        self.own_kept.add_(self.own_rounding.mul_(self.plan.world))
        return self.own_bytes

    def decode_gathered(self) -> Tensor:
        """Every owner's encoded mean (:attr:`gathered`) decoded: the step's means, ``(entries,)``."""
        self.every.decode()
        return self.means_values


class _Encoded:
    """``rows`` encoded segments (``(rows, row_bytes)`` uint8, :attr:`data`) and the views the stages read
    and write them through: the values' bytes, the scales' bytes, the codes' fields, and those of
    ``decoded`` (``(rows * blocks, block_len)`` fp32), the buffer :meth:`decode` writes, if any."""

    def __init__(self, plan: WirePlan, rows: int, device: torch.device, data: Tensor | None = None,
                 decoded: Tensor | None = None) -> None:
        self.plan, self.rows, self.decoded = plan, rows, decoded
        self.data = torch.empty(rows, plan.row_bytes, dtype=torch.uint8, device=device) if data is None else data
        self.value_bytes = self.data[:, :plan.value_bytes]
        if plan.wire == "bfloat16":  # one block a segment: (rows, segment) throughout
            self.bf16 = self.value_bytes.view(torch.bfloat16)
            return
        blocks = rows * plan.blocks
        self.q = torch.empty(blocks, plan.block_len, device=device)
        self.work = torch.empty(blocks, plan.block_len, device=device)
        self.scale = torch.empty(blocks, 1, device=device)
        self.scale_bytes = self.scale.view(rows, plan.blocks).view(torch.uint8)
        self.data_scales = self.data[:, plan.value_bytes:]
        bits = _BITS[plan.wire]
        self.per_byte = 8 // bits
        codes = self.q.view(rows, plan.segment)
        out = None if decoded is None else decoded.view(rows, plan.segment)
        if plan.wire == "int8":
            self.int8 = self.value_bytes.view(torch.int8)
            self.fields, self.out_fields = [codes], [out]
        else:  # value i of each byte
            self.fields = [codes[:, i::self.per_byte] for i in range(self.per_byte)]
            self.out_fields = [None if out is None else out[:, i::self.per_byte] for i in range(self.per_byte)]
            self.packed = torch.empty(rows, plan.value_bytes, device=device)
            self.field = torch.empty(rows, plan.value_bytes, dtype=torch.uint8, device=device)

    def encode(self, x: Tensor, rounding: Tensor) -> None:
        """:func:`encode_decoded` of ``x`` (``(rows * blocks, block_len)`` fp32) into :attr:`data`, and ``x``
        minus what decodes from it into ``rounding`` (may be ``x`` itself)."""
        plan = self.plan
        if plan.wire == "bfloat16":
            self.bf16.copy_(x)
            torch.sub(x, self.bf16, out=rounding)
            return
        qmax = _QMAX[plan.wire]
        torch.abs(x, out=self.q)
        torch.amax(self.q, 1, keepdim=True, out=self.scale)
        self.scale.div_(qmax).clamp_min_(torch.finfo(torch.float32).tiny)
        torch.div(x, self.scale, out=self.q).round_().clamp_(-qmax, qmax)
        torch.mul(self.q, self.scale, out=self.work)
        torch.sub(x, self.work, out=rounding)
        if plan.wire == "int8":
            self.int8.copy_(self.fields[0])
        else:  # the byte's values at 2^(bits i), offset to 0..2 qmax each: exact small integers in fp32
            bits = _BITS[plan.wire]
            torch.add(self.fields[0], self.fields[1], alpha=2 ** bits, out=self.packed)
            for i in range(2, self.per_byte):
                self.packed.add_(self.fields[i], alpha=2 ** (bits * i))
            self.packed.add_(qmax * sum(2 ** (bits * i) for i in range(self.per_byte)))
            self.value_bytes.copy_(self.packed)
        self.data_scales.copy_(self.scale_bytes)

    def decode(self) -> None:
        """:func:`decode` of :attr:`data` into :attr:`decoded`."""
        plan, out = self.plan, self.decoded
        if plan.wire == "bfloat16":
            out.copy_(self.bf16)
            return
        qmax = _QMAX[plan.wire]
        self.scale_bytes.copy_(self.data_scales)
        if plan.wire == "int8":
            self.out_fields[0].copy_(self.int8)
            out.mul_(self.scale)
            return
        bits, mask = _BITS[plan.wire], (1 << _BITS[plan.wire]) - 1
        for i, at in enumerate(self.out_fields):
            if i == 0:
                torch.bitwise_and(self.value_bytes, mask, out=self.field)
            elif i == self.per_byte - 1:  # the top field: the shift alone
                torch.bitwise_right_shift(self.value_bytes, bits * i, out=self.field)
            else:
                torch.bitwise_right_shift(self.value_bytes, bits * i, out=self.field).bitwise_and_(mask)
            at.copy_(self.field)
        out.sub_(qmax).mul_(self.scale)


def wire_send_pass(plan: WirePlan, values: Tensor) -> tuple[Tensor, Tensor]:
    """An encoded wire's first stage: ``values`` (``(entries,)`` fp32) padded, cut into segments and
    encoded; returns ``(bytes to send, (W, row_bytes); what the encoding rounded away, (entries,))``."""
    segments = pad(plan, values)
    send, decoded = encode_decoded(plan, segments)
    return send, segments.sub_(decoded).view(-1)[:plan.entries]


def wire_own_pass(plan: WirePlan, received: Tensor, kept: Tensor) -> Tensor:
    """The owner's stage: the mean of every rank's copy of its segment, encoded; returns the encoded
    mean and adds ``W`` times what that encoding rounded away to ``kept`` (this rank's share of the
    send buffer's rounding, its segment's entries: the owner's residual keeps it), in place."""
    mean = owner_mean(plan, received)
    own, decoded = encode_decoded(plan, mean)
    rounded = mean.sub_(decoded).mul_(plan.world).view(-1)
    kept.add_(rounded[:kept.numel()])
    return own


def wire_decode_pass(plan: WirePlan, gathered: Tensor) -> Tensor:
    """Every owner's encoded mean (``(W, row_bytes)``) decoded: the step's means, ``(entries,)``."""
    return decode(plan, gathered).view(-1)[:plan.entries]


class CompiledWire:
    """:class:`WireBuffers`'s stages as the compiled passes (:func:`wire_send_pass`,
    :func:`wire_own_pass`, :func:`wire_decode_pass`), the same interface."""

    def __init__(self, kernels: Kernels, plan: WirePlan, rank: int, device: torch.device) -> None:
        self.kernels, self.plan = kernels, plan
        self.received = torch.empty(plan.world, plan.row_bytes, dtype=torch.uint8, device=device)
        self.gathered = torch.empty(plan.world * plan.row_bytes, dtype=torch.uint8, device=device)
        self.lo = rank * plan.segment  # the owner's segment among the entries
        self.hi = max(self.lo, min(self.lo + plan.segment, plan.entries))
        self._kept: Tensor | None = None

    def send(self, values: Tensor) -> tuple[Tensor, Tensor]:
        sent, self._kept = self.kernels.get("wire", wire_send_pass, self.plan)(self.plan, values)
        return sent, self._kept

    def own_mean(self) -> Tensor:
        kept = self._kept[self.lo:self.hi]
        return self.kernels.get("wire_own", wire_own_pass, (self.plan, kept.numel()))(self.plan, self.received, kept)

    def decode_gathered(self) -> Tensor:
        gathered = self.gathered.view(self.plan.world, self.plan.row_bytes)
        return self.kernels.get("wire_decode", wire_decode_pass, self.plan)(self.plan, gathered)


def stages(kernels: Kernels, plan: WirePlan, rank: int, device: torch.device) -> "WireBuffers | CompiledWire":
    """The encoded wire's stages for ``plan`` on rank ``rank``: on buffers made once (eager,
    :class:`WireBuffers`) or the compiled passes (:class:`CompiledWire`). The last plan's is kept (a ramp's
    denser plans are dropped once the density changes).

    Example:
        >>> codec = stages(Kernels("eager"), WirePlan("int8", entries=4, world=1, block=4), 0, torch.device("cpu"))
        >>> sent, kept = codec.send(torch.tensor([1.0, -2.0, 0.5, 0.0]))
        >>> _ = codec.received.copy_(sent), codec.gathered.copy_(codec.own_mean())  # as the collectives would
        >>> codec.decode_gathered()             # 127 steps of max / 127
        tensor([ 1.0079, -2.0000,  0.5039,  0.0000])
    """
    if kernels.compiled:
        return kernels.last("wire", (plan, rank, device), lambda: CompiledWire(kernels, plan, rank, device))
    return kernels.last("wire", (plan, rank, device), lambda: WireBuffers(plan, rank, device))
