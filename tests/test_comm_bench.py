"""benchmarks/comm_bench.py: its byte counting and its network namespace (numbers, not timings)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.dist import run_distributed

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"

from benchmarks import comm_bench  # noqa: E402


def _count_collectives(rank: int, world_size: int) -> dict:
    import torch
    import torch.distributed as dist

    from benchmarks import comm_bench as cb

    counter = cb.CollectiveCounter()
    counter.install()
    dist.all_reduce(torch.ones(10))  # not counted: no method is running
    counter.method = "m"
    dist.all_reduce(torch.ones(10))
    out = [torch.empty(7, dtype=torch.uint8) for _ in range(world_size)]
    dist.all_gather(out, torch.zeros(7, dtype=torch.uint8), async_op=True).wait()
    dist.broadcast(torch.zeros(3, dtype=torch.float64), src=0)
    counter.method = None
    return dict(counter.totals["m"])


def test_counter_counts_what_each_rank_hands_to_collectives():
    for totals in run_distributed(_count_collectives):
        assert totals == {"calls": 3, "values": 10 + 3, "bytes": 40 + 7 + 24}


def test_results_say_what_was_measured_not_goals():
    rows = {"no-comm + AdamS": {"time_s": 1.0}, "DDP + AdamW": {"time_s": 4.0, "bytes": 1000, "lo_bytes": 2000},
            "PowerSGD r4 + AdamW": {"time_s": 1.5}, "SCAPE 99%": {"time_s": 1.2, "bytes": 30, "lo_bytes": 60}}
    lines = comm_bench.results({"loopback/1": rows, "slow/1": rows}, "slow", 1)
    assert lines[0] == "- SCAPE 99% hands 3.00% of dense DDP's bytes to the collectives a step (loopback/1; 3.00% " \
                       "crossed the interface)"
    assert lines[1] == ("- slow/1 (default batch): SCAPE 99%'s step is 3.33x faster than dense DDP + AdamW's; it takes "
                        "1.20x the step without communication; PowerSGD rank 4 takes 1.25x its time")
    assert not any("MET" in line for line in lines)  # results, not the project's internal targets


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("tc"),
                    reason="network namespaces need root and iproute2")
def test_namespace_is_shaped_and_removed():
    ns = comm_bench.Namespace(f"scape-bench-test-{os.getpid()}")
    try:
        ns.create()
        ns.shape(2000)
        qdisc = subprocess.run(ns.prefix() + ["tc", "qdisc", "show", "dev", "lo"], capture_output=True,
                               text=True, timeout=30).stdout
        assert "tbf" in qdisc and "2Gbit" in qdisc
        ns.shape(None)
        qdisc = subprocess.run(ns.prefix() + ["tc", "qdisc", "show", "dev", "lo"], capture_output=True,
                               text=True, timeout=30).stdout
        assert "tbf" not in qdisc
    finally:
        ns.remove()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    assert ns.name not in listed


@pytest.mark.slow
def test_tiny_run_counts_dense_and_scape_bytes(tmp_path):
    out = tmp_path / "r.json"
    subprocess.run([sys.executable, str(BENCH / "comm_bench.py"), "--params", "3e5", "--layers", "1",
                    "--context", "32", "--batches", "1,2", "--steps", "1", "--rounds", "2", "--links", "loopback",
                    "--methods", "all", "--json", str(out), "--plot", str(tmp_path / "p.png")], check=True, timeout=600)
    report = json.loads(out.read_text())
    n, world = report["params"], next(iter(report["raw"].values()))["world_size"]
    for rows in report["summary"].values():
        assert rows["DDP + AdamW"]["bytes"] == 4 * n and rows["DDP + AdamW"]["values"] == n
        assert rows["no-comm + AdamS"]["bytes"] == 0
        for name in ("SCAPE 90%", "SCAPE 99%", "SCAPE 99% sharded"):  # bytes as ScapeState.stats() counts them
            assert rows[name]["bytes"] == rows[name]["scape_bytes_sent"]
            assert rows[name]["values"] == rows[name]["scape_values_sent"]
        for name in ("SCAPE 90%", "SCAPE 99% sharded"):  # native wire: the wrapper's count agrees
            assert rows[name]["handed_bytes"] == rows[name]["bytes"]
        # SCAPE 99% is on the int4 wire: SCAPE counts one all-reduce of the encoded buffer (what a ring moves);
        # the wrapper counts what is handed over: the whole buffer to the all-to-all, one segment to the all-gather
        assert rows["SCAPE 99%"]["handed_bytes"] == rows["SCAPE 99%"]["bytes"] * (world + 1) / world
        assert rows["SCAPE 99%"]["bytes"] < rows["SCAPE 90%"]["bytes"] < rows["DDP + AdamW"]["bytes"]
        # sharded: the same all-reduce, plus the owners' updates and masks (all-gathered)
        assert rows["SCAPE 99%"]["bytes"] < rows["SCAPE 99% sharded"]["bytes"] < 2 * rows["SCAPE 99%"]["bytes"]
    assert (tmp_path / "p.png").stat().st_size > 0


def test_overhead_components_subtract_nested_timers_once():
    from benchmarks import overhead_bench

    raw = {"step": 1.0, "forward_backward": 0.7, "opt_step": 0.3, "compact": 0.02, "allreduce_launch": 0.005,
           "finish": 0.03, "select": 0.2, "topk": 0.1, "gather_launch": 0.002, "mask_wait": 0.04, "end_step": 0.25,
           "optimizer": 0.05}
    c = overhead_bench.derive(raw)
    assert c["hook"] == pytest.approx(0.055)
    assert c["score"] == pytest.approx(0.2 - 0.1 - 0.002)
    assert c["selection"] == pytest.approx(0.24) and c["end_step_other"] == pytest.approx(0.01)
    assert c["overhead"] == pytest.approx(0.055 + 0.24)


def test_defaults_are_the_short_set_and_write_outside_docs():
    args = comm_bench.parse([])
    assert args.methods == list(comm_bench.DEFAULT_METHODS) and len(args.methods) == 5
    assert comm_bench.parse(["--methods", "all"]).methods == list(comm_bench.METHODS)
    root = BENCH.parent
    for path in (args.json, args.plot):  # untracked (.gitignore's /runs/), never the tracked docs/
        assert Path(path).parent == root / "runs"
    assert "/runs/" in (root / ".gitignore").read_text().split()


def test_launch_prints_progress_and_times_out_in_one_line(tmp_path, monkeypatch, capsys):
    from benchmarks import bench_common

    monkeypatch.setattr(bench_common, "PROGRESS_EVERY", 0.3)
    status = tmp_path / "status.txt"
    bench_common.report_status(status, "per-rank batch 1, pass 2: SCAPE 99%")
    with pytest.raises(TimeoutError) as e:
        bench_common.launch(["-c", "import time; time.sleep(60)"], 1, timeout=1.5, status=status, label="slow link")
    assert str(e.value) == "slow link did not finish within the 1.5 s limit; rank 0 was at: per-rank batch 1, " \
                           "pass 2: SCAPE 99%"
    assert "s of 1.5 s] slow link: per-rank batch 1, pass 2: SCAPE 99%" in capsys.readouterr().out


def test_a_stopped_run_reports_the_rounds_every_method_finished():
    window = {"steps": 1, "calls": 1, "values": 10, "bytes": 40, "lo_bytes": 80}
    finished = {"times": {"1": [1.0, 1.2]}, "cpu": {"1": [0.5, 0.5]}, "windows": {"1": [window, window]}}
    raw = {"slow": {"methods": {"no-comm + AdamS": finished, "DDP + AdamW": finished}}}
    summary = comm_bench.summarize(raw, [1, 4])  # batch 4 never started: left out, not an error
    assert list(summary) == ["slow/1"] and summary["slow/1"]["DDP + AdamW"]["bytes"] == 40
    assert comm_bench.rounds_done(raw["slow"]) == \
        "the tables above keep the 2 round(s) every method finished at per-rank batch 1"
    assert comm_bench.rounds_done({}) == "no method finished a timed round"
