"""Property tests for the encoded wires' codec (scape_core/wire.py): shapes, bytes, rounding, NaN."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from benchmarks.experiments import candidate_wires  # noqa: F401  (registers the int2 prototype)
from scape_core.wire import WirePlan, decode, encode, owner_mean, pad

QMAX = {"int8": 127, "int4": 7, "int2": 1}
wires = st.sampled_from(["bfloat16", "int8", "int4", "int2"])
plans = st.builds(WirePlan, wires, entries=st.integers(1, 3000), world=st.integers(1, 9),
                  block=st.sampled_from([8, 16, 100, 128, 1024]))


@settings(max_examples=200, deadline=None)
@given(plans)
def test_plan_covers_every_entry_in_equal_segments_of_whole_blocks(plan):
    per_rank = -(-plan.entries // plan.world)
    assert plan.blocks * plan.block_len == plan.segment >= per_rank
    assert plan.segment - per_rank < plan.blocks * 4  # padding: less than a few values per block
    if plan.scaled:
        assert plan.block_len < plan.block + 4  # at most `block` values per scale, rounded to whole bytes
    values = plan.segment * {"bfloat16": 16, "int8": 8, "int4": 4, "int2": 2}[plan.wire]
    assert values % 8 == 0 and plan.row_bytes == values // 8 + (4 * plan.blocks if plan.scaled else 0)
    assert plan.nbytes == plan.world * plan.row_bytes


@settings(max_examples=200, deadline=None)
@given(plans, st.integers(0, 2**31 - 1), st.sampled_from([1e-30, 1e-3, 1.0, 1e6]))
def test_decoded_values_are_within_half_a_step_of_the_block_grid(plan, seed, scale):
    g = torch.Generator().manual_seed(seed)
    x = pad(plan, torch.randn(plan.world, plan.entries, generator=g).mul_(scale))  # (W, W, segment)
    data = encode(plan, x)
    assert data.dtype == torch.uint8 and data.shape == (plan.world, plan.world, plan.row_bytes)
    y = decode(plan, data)
    assert y.shape == x.shape and y.dtype == torch.float32
    if plan.wire == "bfloat16":
        assert torch.equal(y, x.bfloat16().float())
        return
    blocks = x.unflatten(-1, (plan.blocks, plan.block_len))
    step = blocks.abs().amax(-1, keepdim=True) / QMAX[plan.wire]
    err = (y.unflatten(-1, (plan.blocks, plan.block_len)) - blocks).abs()
    assert (err <= step / 2 * (1 + 1e-5) + 1e-45).all()
    assert torch.equal(y[x == 0], x[x == 0])  # padding and zeros travel as zeros
    assert torch.equal(decode(plan, encode(plan, y)), y)  # values on the grid are exact


@given(plans, st.sampled_from([float("nan"), float("inf"), float("-inf")]), st.integers(0, 2**31 - 1))
def test_a_non_finite_value_makes_its_block_non_finite_and_leaves_the_others_as_they_were(plan, bad, seed):
    x = torch.randn(plan.segment, generator=torch.Generator().manual_seed(seed))
    at = seed % plan.segment
    poisoned = x.clone()
    poisoned[at] = bad
    y = decode(plan, encode(plan, poisoned))
    clean = decode(plan, encode(plan, x))
    assert not torch.isfinite(y[at])  # the entry poisons the exchange wherever it travels
    block = torch.arange(plan.segment) // plan.block_len == at // plan.block_len
    if plan.scaled:  # its block's scale is not finite: the block's every value is not (the exchange is dropped)
        assert not torch.isfinite(y[block]).any()
    others = ~block if plan.scaled else torch.arange(plan.segment) != at
    assert torch.equal(y[others], clean[others])  # every other block (bf16: every other value) as it was


def test_owner_mean_is_the_mean_of_the_decoded_copies_in_rank_order():
    plan = WirePlan("int8", entries=40, world=4, block=8)
    copies = encode(plan, torch.randn(4, plan.segment))  # what rank j receives: one copy per sender
    want = decode(plan, copies)
    assert torch.equal(owner_mean(plan, copies), (((want[0] + want[1]) + want[2]) + want[3]) / 4)
