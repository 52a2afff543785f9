"""benchmarks/traffic_bench.py: the counter on operators whose traffic is known, and one tiny run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.traffic_bench import TrafficCounter, count_compiled

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"

N = 1000  # fp32 values: 4000 bytes


def counted(fn) -> dict:
    counter = TrafficCounter()
    with counter:
        fn()
    return counter.totals()


def test_elementwise_reads_its_inputs_and_writes_its_output_or_mutated_input():
    x, y, z = torch.randn(N), torch.randn(N), torch.empty(N)
    for fn in (lambda: x.add_(y), lambda: torch.add(x, y), lambda: torch.add(x, y, out=z)):
        t = counted(fn)
        assert (t["operators"], t["read"], t["written"]) == (1, 8 * N, 4 * N)
    t = counted(lambda: x.sum())
    assert (t["read"], t["written"]) == (4 * N, 4)
    t = counted(lambda: x.add_(torch.tensor(2.0).expand(N)))  # a broadcast input is read once
    assert (t["read"], t["written"]) == (4 * N + 4, 4 * N)


def test_sites_name_the_innermost_function_of_a_package_that_issued_an_operator():
    x, y = torch.randn(N), torch.randn(N)

    def residual_pass():
        x.add_(y)

    counter = TrafficCounter(sites="tests")
    with counter:
        residual_pass()
    assert counter.totals()["by_site"] == {"test_traffic_bench.residual_pass: add_": [1, 8 * N, 4 * N]}


def test_fills_and_copies_only_write_their_destination():
    x, half = torch.randn(N), torch.randn(N).half()
    assert counted(lambda: x.zero_())["read"] == 0 and counted(lambda: x.zero_())["written"] == 4 * N
    t = counted(lambda: x.copy_(half))
    assert (t["read"], t["written"]) == (2 * N, 4 * N)


def test_views_are_free():
    x = torch.randn(10, 100)
    t = counted(lambda: (x.view(-1), x.t(), x[2:5], x.reshape(100, 10), x.detach(), x[0].expand(3, 100),
                         x.unsqueeze(0), torch.empty_like(x)))
    assert (t["operators"], t["read"], t["written"]) == (0, 0, 0) and t["views"] >= 7


def test_index_operators_count_the_rows_they_touch():
    src, k = torch.randn(50, 20), 7
    rows = torch.tensor([3, 1, 4, 1, 5, 9, 2])
    t = counted(lambda: src.index_select(0, rows))
    assert (t["read"], t["written"]) == (k * 20 * 4 + k * 8, k * 20 * 4)
    t = counted(lambda: src.index_copy_(0, rows.unique(), torch.ones(6, 20)))  # unique: one host sync
    assert t["by_op"]["index_copy_"][1:] == [6 * 20 * 4 + 6 * 8, 6 * 20 * 4] and t["host_syncs"] == 1
    flat, idx, ones = src.view(-1), torch.arange(0, 1000, 100), torch.ones(10)
    t = counted(lambda: flat.index_add_(0, idx, ones))  # accumulates: reads the touched values too
    assert (t["read"], t["written"]) == (10 * 4 + 10 * 8 + 10 * 4, 10 * 4)
    cols = torch.zeros(50, 2, dtype=torch.long)
    t = counted(lambda: torch.gather(src, 1, cols))
    assert (t["read"], t["written"]) == (100 * 8 + 100 * 4, 100 * 4)


def test_foreach_operators_count_every_tensor_of_every_list():
    a, b = [torch.randn(N), torch.randn(3 * N)], [torch.randn(N), torch.randn(3 * N)]
    t = counted(lambda: torch._foreach_add_(a, b))
    assert (t["operators"], t["read"], t["written"]) == (1, 8 * 4 * N, 4 * 4 * N)


def test_host_reads_are_counted_apart():
    x = torch.randn(N)
    t = counted(lambda: (x[0].item(), bool(x[1] > 0)))
    assert t["host_reads"] == 2 and t["by_op"].keys() == {"gt"}


def test_a_compiled_function_counts_its_inputs_outputs_and_mutations():
    def residual_pass(e, g):
        e.add_(g)
        return (e * 2).sum()

    fn = count_compiled(torch.compile(residual_pass, backend="aot_eager"), "residual_pass")  # no C++ build
    e, g = torch.zeros(N), torch.ones(N)
    fn(e, g)  # compiled outside the counter
    t = counted(lambda: fn(e, g))
    assert t["by_op"] == {"compiled:residual_pass": [1, 8 * N, 4 * N + 4]}  # reads e, g; writes e and the sum
    assert float(fn(e, g)) == 6 * N  # the wrapper returns what the function does


@pytest.mark.slow
def test_an_inductor_compiled_function_is_counted_at_its_boundary():
    fn = count_compiled(torch.compile(lambda e, g: e.add_(g).mul(3)), "f")
    e, g = torch.zeros(N), torch.ones(N)
    fn(e, g)
    assert counted(lambda: fn(e, g))["by_op"] == {"compiled:f": [1, 8 * N, 8 * N]}


def test_tiny_run_adds_the_known_optimizer_passes_and_a_sparse_step(tmp_path):
    out = tmp_path / "t.json"
    subprocess.run([sys.executable, str(BENCH / "traffic_bench.py"), "--methods",
                    "DDP + AdamW fused,DDP + AdamS,SCAPE 99% native", "--params", "2e5", "--layers", "1",
                    "--context", "16", "--batch", "1", "--out", str(out)], check=True, timeout=120,
                   capture_output=True)
    rows = json.loads(out.read_text())["methods"]
    # p, g, m, v in; p, m, v out
    assert rows["DDP + AdamW fused"]["added"]["bytes_per_param"] == pytest.approx(28, abs=0.1)
    assert rows["DDP + AdamS"]["added"]["bytes_per_param"] == pytest.approx(88, abs=0.1)
    scape = rows["SCAPE 99% native"]
    assert scape["sparse"] and scape["skipped_steps"] == 0 and scape["host_reads"] == 0
    # on the CPU the C loops read and write the buckets, p.grad and the parameters where they are: no staging
    # copies, no zeroed update buffer added to every parameter, no indexed add per parameter
    ops = scape["added"]["by_op"]
    assert not {"_foreach_copy_", "_foreach_add_", "zero_", "index_add_"} & set(ops), sorted(ops)
    stage, finish, update = ops["fused_stage"], ops["fused_finish"], ops["fused_update"]
    assert stage["calls"] == finish["calls"] == update["calls"] == ops["fused_gather"]["calls"] == 1
    assert stage["bytes_per_param"] == pytest.approx(4, abs=0.3)  # every gradient read once: its finiteness
    assert update["bytes_per_param"] == pytest.approx(8, abs=0.3)  # every parameter decayed: read and written
    assert 16 <= finish["bytes_per_param"] <= 20  # g and e read, both written (e on the padded layout)
    assert scape["added"]["bytes_per_param"] < 50  # the staging buffer's path: about 98 at this size
    assert any(site.startswith("fused.finish: ") for site in scape["by_site"])  # on the hook's thread


@pytest.mark.slow  # compiles 4 passes in a fresh process (~1-2 min); the arithmetic tests run the compiled path
def test_compiled_kernels_cut_the_passes_and_the_operators(tmp_path):
    out = tmp_path / "t.json"
    subprocess.run([sys.executable, str(BENCH / "traffic_bench.py"), "--methods",
                    "DDP + AdamS compiled,SCAPE 99% native torch,SCAPE 99% native compiled", "--params", "2e5",
                    "--layers", "1", "--context", "16", "--batch", "1", "--out", str(out)], check=True, timeout=600,
                   capture_output=True)
    rows = json.loads(out.read_text())["methods"]
    # one loop per tensor: p, g, m read; p, m written
    assert rows["DDP + AdamS compiled"]["added"]["bytes_per_param"] == pytest.approx(20, abs=0.1)
    eager, compiled = rows["SCAPE 99% native torch"], rows["SCAPE 99% native compiled"]  # against torch's operators
    assert compiled["sparse"] and compiled["skipped_steps"] == 0 and compiled["host_reads"] == 0
    ops = compiled["added"]["by_op"]
    # the residual's add is one compiled loop with the non-finite drop (12: read g and e, write e; no masked_fill_
    # of the buckets); the buckets' one zeroing stays eager (4: in a graph it went through a temporary); the
    # compiled finish writes the entries only (under 1 at 1% density); the optimizer writes nothing back into the
    # buckets (no dense delta: no second zero)
    assert ops["compiled:residual"]["bytes_per_param"] == pytest.approx(12, abs=0.2)
    assert ops.get("masked_fill_", {"bytes_per_param": 0})["bytes_per_param"] < 4  # the bucket's was 8; top-k padding
    assert ops["_foreach_zero_"]["bytes_per_param"] == pytest.approx(4, abs=0.1)
    assert ops["compiled:finish"]["bytes_per_param"] < 1.0
    assert "zero_" not in ops
    assert compiled["added"]["operators"] <= 80 < eager["added"]["operators"]
    assert compiled["added"]["bytes_per_param"] < 0.6 * eager["added"]["bytes_per_param"]
