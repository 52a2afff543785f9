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
travels as the one code no finite value uses (int8's -128, int4's 15 before the offset) and
decodes as NaN: a rank with a non-finite gradient poisons those entries of the step, and the
block's other values keep their finite scale.

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
    """:func:`encode`, and what :func:`decode` gives back from those bytes (the same fp32 values,
    NaN where ``x`` is not finite), computed before packing rather than decoded: what the sender
    keeps of a value is ``x`` minus it.

    Example:
        >>> plan = WirePlan("int4", entries=4, world=1, block=4)
        >>> data, back = encode_decoded(plan, torch.tensor([[1.0, -2.0, 0.3, float("nan")]]))
        >>> back, torch.equal(back.nan_to_num(), decode(plan, data).nan_to_num())
        (tensor([[ 0.8571, -2.0000,  0.2857,     nan]]), True)
    """
    if plan.wire == "bfloat16":
        data = x.to(torch.bfloat16)
        return data.view(torch.uint8), data.float()
    qmax = _QMAX[plan.wire]
    blocks = x.unflatten(-1, (plan.blocks, plan.block_len))
    bad = ~torch.isfinite(blocks)  # travel as the reserved code: the block's other values keep their scale
    scale = blocks.abs().masked_fill_(bad, 0.0).amax(-1, keepdim=True).div_(qmax)
    q = blocks.div(torch.where(scale > 0, scale, 1.0)).round_().clamp_(-qmax, qmax)
    decoded = (q * scale).masked_fill_(bad, float("nan")).flatten(-2)  # decode's q * scale, before packing
    q = q.flatten(-2)
    bad = bad.flatten(-2)
    if plan.wire == "int8":
        values = q.masked_fill_(bad, -qmax - 1).to(torch.int8).view(torch.uint8)
    else:  # several values per byte, offset to 0..2 qmax
        bits = _BITS[plan.wire]
        u = q.add_(qmax).masked_fill_(bad, 2 * qmax + 1).to(torch.uint8)
        values = u[..., 0::8 // bits].clone()
        for i in range(1, 8 // bits):
            values.bitwise_or_(u[..., i::8 // bits].bitwise_left_shift(bits * i))
    return torch.cat([values, scale.squeeze(-1).contiguous().view(torch.uint8)], dim=-1), decoded


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
        bits = _BITS[plan.wire]
        parts = [values.bitwise_right_shift(bits * i).bitwise_and_((1 << bits) - 1) for i in range(8 // bits)]
        q = torch.stack(parts, dim=-1).flatten(-2).float().sub_(qmax)
    q.masked_fill_(q.abs() > qmax, float("nan"))  # the reserved code: a non-finite value
    return q.unflatten(-1, (plan.blocks, plan.block_len)).mul_(scale.unsqueeze(-1)).flatten(-2)


def pad(plan: WirePlan, x: Tensor) -> Tensor:
    """``x`` (``(..., entries)``) zero-padded and cut into segments: ``(..., world, segment)``."""
    out = x.new_zeros(*x.shape[:-1], plan.world * plan.segment)
    out[..., :plan.entries] = x
    return out.unflatten(-1, (plan.world, plan.segment))


def owner_mean(plan: WirePlan, received: Tensor) -> Tensor:
    """The owner's mean of its segment from every rank's encoded copy (``(world, row_bytes)``), ranks in order."""
    return decode(plan, received).sum(0).div_(plan.world)
