"""Masks: partitioned top-k selection and the compact encoding exchanged by all-gather.

A mask is, per parameter, the sorted flat indices of the coordinates exchanged on a step.
Every parameter is split into ``world_size`` contiguous partitions (as a ZeRO-1 optimizer
would shard it); rank ``r`` selects only inside partition ``r``, then one all-gather of every
rank's encoded picks gives every rank the identical full mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

INDEX_BYTES = 4  # picks travel as int32 offsets inside their partition


def partition_bounds(numel: int, world_size: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, end)`` of each rank's partition; sizes differ by at most one.

    Example:
        >>> partition_bounds(10, 3)
        [(0, 4), (4, 7), (7, 10)]
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    base, extra = divmod(numel, world_size)
    bounds, start = [], 0
    for r in range(world_size):
        end = start + base + (1 if r < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def topk_count(size: int, density: float) -> int:
    """Coordinates kept in a partition of ``size``: ``ceil(density * size)``, at most ``size``."""
    if size <= 0 or density <= 0.0:
        return 0
    return min(size, math.ceil(density * size - 1e-9))


def mask_encoding(size: int, k: int) -> str:
    """``"indices"`` (int32 each) or ``"bitmap"`` (one bit per coordinate), whichever is smaller."""
    return "indices" if INDEX_BYTES * k <= (size + 7) // 8 else "bitmap"


def encoded_bytes(size: int, k: int) -> int:
    """Bytes one partition's picks take on the wire."""
    return INDEX_BYTES * k if mask_encoding(size, k) == "indices" else (size + 7) // 8


def mask_score(kind: str, m: Tensor, *, target: int = 0, synced_at: Tensor | None = None,
               residual: Tensor | None = None, beta1: float = 0.9) -> Tensor:
    """A partition's selection score (non-negative; :func:`select_topk` picks the largest).

    ``kind`` is a resolved ``ScapeConfig`` score: ``"age_momentum"`` scores ``|m| (n - 1)``,
    ``n - 1 = target - synced_at`` (``synced_at``: the optimizer step, from 1, of each
    coordinate's last sync; ``target``: the step the mask is for); ``"momentum_residual"``
    scores ``|beta1 m + (1 - beta1) e_r|``; ``"momentum"``, or a score whose input is missing
    (no window or residual yet), scores ``|m|``.

    Example:
        >>> mask_score("age_momentum", torch.tensor([1.0, -2.0]), target=5, synced_at=torch.tensor([4, 1]))
        tensor([1., 8.])
    """
    if kind == "age_momentum" and synced_at is not None:
        return m.abs().mul_(target - synced_at.float())
    if kind == "momentum_residual" and residual is not None:
        return (beta1 * m + (1 - beta1) * residual).abs_()
    return m.abs()


def scheduled_in(indices: Tensor, start: int, size: int) -> Tensor:
    """The sorted ``indices`` that fall in the partition ``[start, start + size)``, relative to ``start``.

    Example:
        >>> scheduled_in(torch.tensor([1, 4, 6, 9]), 3, 5)
        tensor([1, 3])
    """
    lo, hi = torch.searchsorted(indices, torch.tensor([start, start + size], device=indices.device))
    return indices[lo:hi] - start


SAMPLED_TOPK_MIN = 32_768  # below this, torch.topk is as fast as the sampled threshold


def select_topk(score: Tensor, k: int, exclude: Tensor | None = None) -> Tensor:
    """Sorted indices of the ``k`` largest scores; ``exclude`` (indices) is picked only if needed.

    Scores must be non-negative; ``score`` may be overwritten. Large inputs first keep the
    candidates above a threshold estimated from a fixed sample (a little below the k-th largest),
    then take the exact top-k among those: the same set as a full top-k, several times faster.

    Example:
        >>> select_topk(torch.tensor([0.1, 3.0, 2.0, 5.0]), 2, exclude=torch.tensor([3]))
        tensor([1, 2])
    """
    n = score.numel()
    if k <= 0:
        return torch.empty(0, dtype=torch.long, device=score.device)
    if k >= n:
        return torch.arange(n, device=score.device)
    if exclude is not None and exclude.numel():
        score[exclude] = -1.0  # scores are absolute values: excluded ones rank last
    if n >= SAMPLED_TOPK_MIN and k <= n // 4:
        size = min(max(n // 16, 2048), 16_384)
        g = torch.Generator(device=score.device).manual_seed(n)  # deterministic: resume is bit-for-bit
        sample = score[torch.randint(n, (size,), generator=g, device=score.device)]
        rank_in_sample = max(1, size - int(1.2 * k * size / n) - 32)  # a margin below the k-th largest
        threshold = sample.kthvalue(rank_in_sample).values
        candidates = (score >= threshold).nonzero().view(-1)
        if candidates.numel() >= k:
            best = score.index_select(0, candidates).topk(k, sorted=False).indices
            return candidates.index_select(0, best).sort().values
    return score.topk(k, sorted=False).indices.sort().values


def strided_pick(size: int, k: int, device: torch.device | None = None) -> Tensor:
    """``k`` evenly spaced indices in ``[0, size)``: the mask used before any momentum exists."""
    return (torch.arange(k, device=device) * size) // max(k, 1)


def _pack_bits(local: Tensor, size: int) -> Tensor:
    bits = torch.zeros((size + 7) // 8 * 8, dtype=torch.uint8, device=local.device)
    bits[local] = 1
    weights = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=local.device)
    return (bits.view(-1, 8) * weights).sum(1, dtype=torch.uint8)


def _unpack_bits(packed: Tensor, size: int) -> Tensor:
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed.unsqueeze(1) >> shifts) & 1
    return bits.view(-1)[:size].nonzero().view(-1)


def encode_picks(local: Tensor, size: int, k: int) -> Tensor:
    """Encode one partition's ``k`` picks (offsets inside a partition of ``size``) as bytes."""
    if mask_encoding(size, k) == "indices":
        return local.to(torch.int32).view(torch.uint8)
    return _pack_bits(local, size)


def decode_picks(data: Tensor, size: int, k: int) -> Tensor:
    """Inverse of :func:`encode_picks`: sorted int64 offsets inside the partition."""
    if mask_encoding(size, k) == "indices":
        return data.clone().view(torch.int32).to(torch.long).sort().values  # clone: realign
    return _unpack_bits(data, size)


@dataclass(frozen=True)
class _Slot:
    name: str
    start: int  # partition start inside the flat parameter
    size: int
    k: int
    offset: int  # byte offset inside the owning rank's payload
    nbytes: int


class MaskLayout:
    """Where each parameter's picks sit in every rank's all-gather payload.

    Depends only on the parameter sizes, the world size and the density, so every rank
    computes the same layout without talking to the others.

    Example:
        >>> layout = MaskLayout({"w": 1000}, world_size=2, density=0.01)
        >>> layout.payload_bytes, layout.k("w")
        (20, 10)
    """

    def __init__(self, numels: dict[str, int], world_size: int, density: float) -> None:
        self.world_size = world_size
        self.density = density
        self.numels = dict(numels)
        self.slots: list[list[_Slot]] = []
        for r in range(world_size):
            slots, offset = [], 0
            for name, numel in numels.items():
                start, end = partition_bounds(numel, world_size)[r]
                k = topk_count(end - start, density)
                nbytes = encoded_bytes(end - start, k)
                slots.append(_Slot(name, start, end - start, k, offset, nbytes))
                offset += nbytes
            self.slots.append(slots)
        self.payload_bytes = max((s[-1].offset + s[-1].nbytes if s else 0) for s in self.slots)

    def k(self, name: str) -> int:
        """Coordinates of ``name`` in a full mask (all partitions)."""
        return sum(slot.k for slots in self.slots for slot in slots if slot.name == name)

    def partition(self, rank: int) -> list[_Slot]:
        """This rank's slots, in parameter order."""
        return self.slots[rank]

    def encode(self, rank: int, picks: dict[str, Tensor], device: torch.device | None = None) -> Tensor:
        """Rank ``rank``'s payload: its picks (offsets in its partitions), padded to the maximum."""
        payload = torch.zeros(self.payload_bytes, dtype=torch.uint8, device=device)
        for slot in self.slots[rank]:
            if slot.k:
                payload[slot.offset:slot.offset + slot.nbytes] = encode_picks(picks[slot.name], slot.size, slot.k)
        return payload

    def decode(self, payloads: list[Tensor]) -> dict[str, Tensor]:
        """Full masks (sorted global flat indices) from every rank's payload."""
        parts: dict[str, list[Tensor]] = {name: [] for name in self.numels}
        for r, payload in enumerate(payloads):
            for slot in self.slots[r]:
                if slot.k:
                    local = decode_picks(payload[slot.offset:slot.offset + slot.nbytes], slot.size, slot.k)
                    parts[slot.name].append(local + slot.start)
        return {
            name: torch.cat(p) if p else torch.empty(0, dtype=torch.long)
            for name, p in parts.items()
        }

    def strided(self) -> dict[str, Tensor]:
        """Full masks of evenly spaced picks in every partition (no communication needed)."""
        return self.decode([self.encode(r, {s.name: strided_pick(s.size, s.k) for s in self.slots[r]})
                            for r in range(self.world_size)])
