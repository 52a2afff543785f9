"""The mask schedule (scape_core/schedule.py): warm-up, ramp, delay and refresh as one pure object."""

import pytest

from scape_core import ScapeConfig
from scape_core.schedule import MaskSchedule


def test_ramp_stages_then_the_target():
    s = MaskSchedule(sparsity=0.99, warmup_steps=10, ramp_steps=30)
    assert [s.density_at(t) for t in (10, 19, 20, 29, 30, 39, 40, 500)] == \
        [0.25, 0.25, 0.0625, 0.0625, 0.015625, 0.015625, pytest.approx(0.01), pytest.approx(0.01)]
    assert MaskSchedule(sparsity=0.9, warmup_steps=10, ramp_steps=30).density_at(25) == pytest.approx(0.1)  # only
    # the stages denser than the target
    assert MaskSchedule(sparsity=0.99, warmup_steps=10, ramp_steps=0).densities() == (pytest.approx(0.01),)
    assert ScapeConfig(sparsity=0.99, warmup_steps=10, ramp_steps=30, wire="native").schedule.density_at(20) == 0.0625


@pytest.mark.parametrize("delay", [0, 1])
def test_which_step_selects_which_mask(delay):
    s = MaskSchedule(sparsity=0.9, warmup_steps=4, ramp_steps=0, mask_delay=delay, mask_refresh=3)
    assert [s.is_dense(t) for t in range(6)] == [True] * 4 + [False] * 2
    assert s.target_after(5) == 6 + delay
    assert [s.selects(t) for t in range(3, 11)] == [False, True, False, False, True, False, False, True]
    assert s.first_selected() == 4
    assert MaskSchedule(sparsity=0.9, warmup_steps=0, mask_delay=1).first_selected() == 2  # steps 0, 1: fixed masks


def test_sparsity_zero_is_dense_everywhere():
    s = MaskSchedule(sparsity=0.0)
    assert s.dense and all(s.is_dense(t) for t in (0, 50, 10_000)) and s.densities() == ()


def test_an_encoded_wire_spends_the_same_bytes_on_more_coordinates():
    native = ScapeConfig(sparsity=0.99, wire="native")
    assert native.resolved_wire == "native" and native.density == pytest.approx(0.01)
    auto = ScapeConfig(sparsity=0.99)  # the default wire: int4 from 97% up, native below
    wires = [ScapeConfig(sparsity=s).resolved_wire for s in (0.97, 0.96, 0.95, 0.94)]
    assert wires == ["int4", "int8", "int8", "native"]
    assert auto.resolved_wire == "int4"
    assert auto.density == pytest.approx(0.01 * 32 / (4 + 32 / 128))  # 4 bits a value, an fp32 scale per 128
    assert ScapeConfig(sparsity=0.99, wire="int8", wire_block=64).density == pytest.approx(0.01 * 32 / 8.5)
    assert ScapeConfig(sparsity=0.99, wire="bfloat16").density == pytest.approx(0.02)
    assert auto.schedule.density == pytest.approx(auto.density) and auto.schedule.ramp_densities == (0.25,)
    assert ScapeConfig(sparsity=0.0, wire="int4").dense  # dense steps are plain all-reduces whatever the wire
    with pytest.raises(ValueError, match="every coordinate"):
        ScapeConfig(sparsity=0.8, wire="int4")  # 20% of the bytes in 4 bits: more than every coordinate
    with pytest.raises(ValueError, match="wire must be one of"):
        ScapeConfig(wire="int3")
    with pytest.raises(ValueError, match="wire_block"):
        ScapeConfig(wire_block=4)


@pytest.mark.parametrize("ramp, stages", [
    (10, [0.25] * 4 + [0.0625] * 3 + [0.015625] * 3),  # 10 / 3 is not whole: the first stage takes the extra step
    (2, [0.25, 0.0625]),  # fewer steps than stages: the last stage gets none
])
def test_ramp_stage_edges_when_ramp_steps_is_not_a_multiple_of_3(ramp, stages):
    s = MaskSchedule(sparsity=0.99, warmup_steps=5, ramp_steps=ramp)
    assert [s.density_at(t) for t in range(5, 5 + ramp)] == stages
    assert s.density_at(5 + ramp) == pytest.approx(0.01)  # the target from warmup + ramp_steps on
    assert ScapeConfig(sparsity=0.99, warmup_steps=5, ramp_steps=ramp, wire="native").target_step == 5 + ramp
    # only the 25% stage is denser than 10%: it lasts ramp_steps / 3 steps (rounded up), then the target
    s = MaskSchedule(sparsity=0.9, warmup_steps=5, ramp_steps=ramp)
    first = -(-ramp // 3)
    assert [s.density_at(t) for t in range(5, 5 + first + 1)] == [0.25] * first + [pytest.approx(0.1)]
    assert ScapeConfig(sparsity=0.9, warmup_steps=5, ramp_steps=ramp).target_step == 5 + first
