"""Two "nodes" on one machine: SCAPE's multi-node path, rehearsed with the real launchers.

The harness creates two network namespaces of its own (``scape-mn-<pid>-0`` and ``-1``), joined
by a veth pair (``mn0`` in each, 10.231.0.1/24 and 10.231.0.2/24) whose link is shaped with
``tc``: ``--gbit`` is a ``tbf`` rate per direction, ``--delay-ms`` a ``netem`` delay per direction
(when the kernel has netem). Each namespace is a node with 2 ranks: traffic between the ranks of
a node stays on the namespace's own loopback, traffic between nodes crosses the veth, and both
are counted per node. Nothing but those two addresses is used; every launch is bounded by a
timeout; the namespaces and anything still running in them are removed afterwards, also on
failure or SIGTERM. Without root or ``ip``/``tc`` it says so and skips. While a launch runs it
prints its time against the limit and the last line of node 0's output every 20 s.

    sudo python benchmarks/multinode.py bench --gbit 1        # comm_bench's methods on 2 x 2 ranks
    sudo python benchmarks/multinode.py rehearse --gbit 1     # the examples: torchrun, Lightning, Accelerate
    sudo python benchmarks/multinode.py faults                # a node killed mid-training; a link lost
    sudo python benchmarks/multinode.py fsdp --gbit 1         # FSDP2 in each node: stock HSDP vs SCAPE across

Reports go to ``runs/multinode_*.json`` (untracked) unless ``--json`` names a path.

On two real machines the launch is the same with their addresses and interface (see README,
"Multi-node"). Both namespaces share one hostname, so torchrun's c10d rendezvous is told which
node hosts it (``--rdzv-conf is_host=1``/``0``) and each node's address (``--local-addr``);
without them the workers are given ``MASTER_ADDR=localhost`` and hang. gloo is pointed at the
node's interface with ``GLOO_SOCKET_IFNAME``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
from benchmarks import comm_bench, fsdp_bench  # noqa: E402
from benchmarks.bench_common import RESULTS, Progress, core_version, launch, machine, read_status  # noqa: E402
from benchmarks.comm_bench import Namespace  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ADDRESSES = ("10.231.0.1", "10.231.0.2")
IFACE = "mn0"  # the veth end inside each node
PORT = 29400  # rendezvous port: free in namespaces that only this harness uses
RANKS_PER_NODE = 2


# ----- the two nodes --------------------------------------------------------------------------
class TwoNodes:
    """Two network namespaces joined by a shaped veth pair; a context manager that removes them.

    Example::

        with TwoNodes(gbit=1.0) as nodes:
            run_on_nodes(nodes, [torchrun(nodes, n, ["train.py"]) for n in (0, 1)], 300, Path("logs"))
            print(nodes.counters())   # [{"lo": ..., "mn0": ...}, {...}]: bytes sent, per node
    """

    def __init__(self, gbit: float | None = None, delay_ms: float = 0.0) -> None:
        stem = f"scape-mn-{os.getpid()}"
        self.namespaces = [Namespace(f"{stem}-{i}", stale_prefix="scape-mn-") for i in range(2)]
        self.addresses = ADDRESSES
        self.gbit, self.delay_ms = gbit, delay_ms

    @staticmethod
    def unavailable() -> str | None:
        """Why two nodes cannot be made here (not root, no ``ip``/``tc``), or None."""
        return Namespace.unavailable(install=False)

    def __enter__(self) -> "TwoNodes":
        try:
            self.create()
            self.shape(self.gbit, self.delay_ms)
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def _ip(self, *cmd: str) -> None:
        r = subprocess.run(["ip", *cmd], capture_output=True, text=True, timeout=30)
        if r.returncode:
            raise RuntimeError(f"`ip {' '.join(cmd)}` failed: {r.stderr.strip()}")

    def create(self) -> None:
        """Both namespaces, the veth pair between them (created inside them), addresses, links up."""
        for ns in self.namespaces:
            ns.create()
        a, b = (ns.name for ns in self.namespaces)
        self._ip("link", "add", IFACE, "netns", a, "type", "veth", "peer", "name", IFACE, "netns", b)
        for ns, address in zip(self.namespaces, self.addresses):
            self._ip("-n", ns.name, "addr", "add", f"{address}/24", "dev", IFACE)
            self._ip("-n", ns.name, "link", "set", IFACE, "up")

    def shape(self, gbit: float | None, delay_ms: float = 0.0) -> None:
        """Shape each direction of the link: ``gbit`` (tbf) and ``delay_ms`` (netem); None/0: unshaped."""
        for node in (0, 1):
            tc = self.prefix(node) + ["tc", "qdisc"]
            subprocess.run(tc + ["del", "dev", IFACE, "root"], capture_output=True, timeout=30)
            if delay_ms:
                rate = ["rate", f"{gbit * 1000:g}mbit"] if gbit else []
                cmd = tc + ["add", "dev", IFACE, "root", "netem", "delay", f"{delay_ms:g}ms", *rate, "limit", "100000"]
            elif gbit:
                cmd = tc + ["add", "dev", IFACE, "root", "tbf", "rate", f"{gbit * 1000:g}mbit", "burst", "512kb",
                            "latency", "100ms"]
            else:
                continue
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
            if r.returncode:
                hint = (" (this kernel has no netem, CONFIG_NET_SCH_NETEM: latency cannot be added here; "
                        "use --delay-ms 0)" if delay_ms and "unknown" in r.stderr else "")
                raise RuntimeError(f"`{' '.join(cmd[4:])}` failed: {r.stderr.strip()}{hint}")
        self.gbit, self.delay_ms = gbit, delay_ms

    def describe(self) -> str:
        rate = f"{self.gbit:g} Gbit/s" if self.gbit else "unshaped"
        return rate + (f", +{self.delay_ms:g} ms each way" if self.delay_ms else "")

    def prefix(self, node: int) -> list[str]:
        """The command prefix that runs a program on ``node``."""
        return self.namespaces[node].prefix()

    def env(self, node: int) -> dict[str, str]:
        """The environment a rank on ``node`` needs: gloo on the node's interface, one thread."""
        return dict(os.environ, GLOO_SOCKET_IFNAME=IFACE, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT),
                    PYTHONUNBUFFERED="1")

    def counters(self) -> list[dict[str, int]]:
        """Bytes each node has sent, per interface: ``[{"lo": n, "mn0": n}, ...]``."""
        out = []
        for ns in self.namespaces:
            r = subprocess.run(["ip", "-n", ns.name, "-s", "-j", "link", "show"], capture_output=True, text=True,
                               timeout=30, check=True)
            out.append({link["ifname"]: link["stats64"]["tx"]["bytes"] for link in json.loads(r.stdout)})
        return out

    def kill(self, node: int, launcher: bool = False) -> list[int]:
        """SIGKILL the ranks of ``node`` (and its launcher too if ``launcher``): a node going down."""
        pids = self.namespaces[node].pids()
        launchers = set() if launcher else {p for p in pids if _parent(p) not in pids}
        killed = [p for p in pids if p not in launchers]
        for pid in killed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return killed

    def set_link(self, node: int, up: bool) -> None:
        """Take ``node``'s end of the veth down (the node loses its link) or bring it back up."""
        self._ip("-n", self.namespaces[node].name, "link", "set", IFACE, "up" if up else "down")

    def remove(self) -> None:
        """Kill whatever still runs in the namespaces and delete them (the veth pair goes with them)."""
        for ns in self.namespaces:
            ns.remove()


def _parent(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return -1


# ----- launchers ------------------------------------------------------------------------------
def torchrun(nodes: TwoNodes, node: int, argv: Sequence[str], max_restarts: int = 0,
             run_id: str = "scape-mn") -> list[str]:
    """``torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d ...`` for ``node`` (``argv``: script + args).

    Example:
        >>> shown(torchrun(TwoNodes(), 1, ["train.py"]))  # doctest: +ELLIPSIS
        'torchrun --nnodes 2 ... --rdzv-conf is_host=0 --local-addr 10.231.0.2 --max-restarts 0 train.py'
    """
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(RANKS_PER_NODE),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{nodes.addresses[0]}:{PORT}", "--rdzv-id", run_id,
            "--rdzv-conf", f"is_host={int(node == 0)}", "--local-addr", nodes.addresses[node],
            "--max-restarts", str(max_restarts), *argv]


def accelerate_launch(nodes: TwoNodes, node: int, argv: Sequence[str]) -> list[str]:
    """``accelerate-scape launch --num_machines 2 --machine_rank <node> ...`` (``argv``: script + args)."""
    return [sys.executable, "-m", "accelerate_scape.cli", "launch", "--multi_gpu",
            "--num_machines", "2", "--machine_rank", str(node), "--num_processes", str(2 * RANKS_PER_NODE),
            "--main_process_ip", nodes.addresses[0], "--main_process_port", str(PORT),
            "--mixed_precision", "no", "--dynamo_backend", "no", *argv]


def shown(cmd: Sequence[str]) -> str:
    """A launch command as a person types it (``torchrun``, ``accelerate-scape``, repository paths)."""
    words = list(cmd)
    if words[:3] == [sys.executable, "-m", "torch.distributed.run"]:
        words = ["torchrun"] + words[3:]
    elif words[:3] == [sys.executable, "-m", "accelerate_scape.cli"]:
        words = ["accelerate-scape"] + words[3:]
    return " ".join(str(Path(w).relative_to(ROOT)) if w.startswith(str(ROOT) + "/") else w for w in words)


@dataclass
class NodeRun:
    """What one node's launcher did: its exit code, its output, how long it ran."""

    returncode: int
    output: str
    seconds: float


def run_on_nodes(nodes: TwoNodes, commands: Sequence[Sequence[str]], timeout: float, logs: Path,
                 watch: Callable[[float], None] | None = None, env: dict[str, str] | None = None,
                 label: str | None = None, status: Callable[[], str] | None = None) -> list[NodeRun]:
    """Run ``commands[i]`` on node i, all at once; every node's launcher must exit within ``timeout`` s.

    ``watch(elapsed)`` is called every 0.1 s while they run (to inject a fault); ``env`` adds to
    each node's environment. With a ``label``, a progress line every 20 s shows the time against
    ``timeout`` and ``status()`` (default: the last line of node 0's log). On timeout (or any
    error) the launchers get SIGTERM, then every process in both namespaces SIGKILL, and
    ``TimeoutError`` names the timeout and shows the end of each node's log (``logs/node<i>.log``).

    Example::

        runs = run_on_nodes(nodes, [torchrun(nodes, n, ["train.py"]) for n in (0, 1)], 300, Path("logs"))
        assert [r.returncode for r in runs] == [0, 0]
    """
    logs.mkdir(parents=True, exist_ok=True)
    files = [open(logs / f"node{i}.log", "w") for i in range(len(commands))]
    start = time.monotonic()
    procs = [subprocess.Popen(nodes.prefix(i) + list(cmd), env={**nodes.env(i), **(env or {})}, stdout=f,
                              stderr=subprocess.STDOUT) for i, (cmd, f) in enumerate(zip(commands, files))]
    ended: list[float | None] = [None] * len(procs)
    progress = Progress(label, timeout, status or (lambda: last_line(logs / "node0.log"))) if label else None
    try:
        while any(e is None for e in ended):
            elapsed = time.monotonic() - start
            for i, p in enumerate(procs):
                if ended[i] is None and p.poll() is not None:
                    ended[i] = elapsed
            if elapsed > timeout:
                raise TimeoutError(f"the launchers did not finish within the {timeout:g} s timeout:\n"
                                   + tails(logs, len(procs)))
            if watch is not None:
                watch(elapsed)
            if progress is not None:
                progress.tick()
            time.sleep(0.1)
    finally:
        if any(p.poll() is None for p in procs):  # stopped early: no process of this run may outlive it
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)  # torchrun then stops its workers
            for p in procs:
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    pass
            for node in range(len(procs)):
                nodes.kill(node, launcher=True)
        for p, f in zip(procs, files):
            p.wait()
            f.close()
    return [NodeRun(p.returncode, (logs / f"node{i}.log").read_text(errors="replace"), ended[i])
            for i, p in enumerate(procs)]


def last_line(log: Path, chars: int = 120) -> str:
    """The last non-empty line of ``log`` (progress bars' carriage returns count as line ends), shortened."""
    try:
        with open(log, "rb") as f:
            f.seek(max(f.seek(0, os.SEEK_END) - 4096, 0))
            tail = f.read().decode(errors="replace")
    except OSError:
        return "starting"
    lines = [line.strip() for line in tail.replace("\r", "\n").splitlines() if line.strip()]
    return (lines[-1][:chars] if lines else "starting (no output yet)")


def tails(logs: Path, count: int, chars: int = 3000) -> str:
    return "\n".join(f"--- node {i} (last {chars} characters) ---\n"
                     + (logs / f"node{i}.log").read_text(errors="replace")[-chars:] for i in range(count))


# ----- the elastic job: replicas, a node killed, a link lost -----------------------------------
ELASTIC = ROOT / "tests" / "scripts" / "elastic_train.py"
# torchrun shares its agent's store with the workers by default; a restart then depends on every
# node counting restarts alike, which they do not (see elastic_train.init_after_restart)
FRESH_STORE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


@dataclass
class RankResult:
    """What one rank of ``elastic_train.py`` ended with: digests and where it ran."""

    params: str
    momenta: str
    residuals: str
    step: int
    where: dict[str, str]


def elastic_job(nodes: TwoNodes, out: Path, *script_args: str, max_restarts: int = 0, timeout: float = 180,
                watch: Callable[[float], None] | None = None) -> tuple[list[NodeRun], list[RankResult | None]]:
    """``tests/scripts/elastic_train.py OUT`` on 2 x 2 ranks under torchrun; each rank's result (None if absent)."""
    out.mkdir(parents=True, exist_ok=True)
    script = [str(ELASTIC), str(out), *script_args]
    runs = run_on_nodes(nodes, [torchrun(nodes, n, script, max_restarts=max_restarts) for n in (0, 1)],
                        timeout, out / "logs", watch=watch, env=FRESH_STORE, label=f"elastic job {out.name}")
    return runs, [rank_result(out, r) for r in range(2 * RANKS_PER_NODE)]


def rank_result(out: Path, rank: int) -> RankResult | None:
    digest, where = out / f"rank{rank}.txt", out / f"rank{rank}.json"
    if not digest.exists():
        return None
    params, momenta, residuals, step = digest.read_text().split()
    return RankResult(params, momenta, residuals, int(step), json.loads(where.read_text()))


def node_kill(nodes: TwoNodes, workdir: Path, whole_node: bool = False, keep_buckets: bool = True, steps: int = 40,
              step_seconds: float = 0.2, timeout: float = 240) -> dict:
    """Node 1 killed mid-training under ``torchrun --max-restarts 1``, against the same job uninterrupted.

    Both ranks of node 1 are SIGKILLed once the first checkpoint exists; torchrun restarts every
    worker, which resume from the last checkpoint. ``whole_node``: its torchrun dies too and a
    replacement (the same command) starts on it, as a cluster scheduler would. ``keep_buckets``:
    the model's DDP keeps its first bucket layout (``--find-unused-parameters``); otherwise DDP
    rebuilds it after the restarted workers' first step, which SCAPE's sparse steps no longer
    depend on (docs/reliability.md).
    """
    args = ("--steps", str(steps), "--step-seconds", str(step_seconds),
            *(["--find-unused-parameters"] if keep_buckets else []))
    _, straight = elastic_job(nodes, workdir / "straight", *args, timeout=timeout)
    crashed_dir = workdir / "crashed"
    events: dict[str, float] = {}
    replacement_log = crashed_dir / "logs" / "node1-replacement.log"
    replacement: list[subprocess.Popen] = []

    def kill_once(elapsed: float) -> None:
        if "killed_at" not in events and (crashed_dir / "ckpt.pt").exists():
            events["killed_at"] = elapsed
            events["killed"] = len(nodes.kill(1, launcher=whole_node))
            if whole_node:
                cmd = torchrun(nodes, 1, [str(ELASTIC), str(crashed_dir), *args], max_restarts=1)
                with open(replacement_log, "w") as log:  # the child keeps its own copy of the descriptor
                    replacement.append(subprocess.Popen(nodes.prefix(1) + cmd, env={**nodes.env(1), **FRESH_STORE},
                                                        stdout=log, stderr=subprocess.STDOUT))

    runs, crashed = elastic_job(nodes, crashed_dir, *args, max_restarts=1, timeout=timeout, watch=kill_once)
    if replacement:  # node 1's result is the replacement's
        runs[1] = NodeRun(replacement[0].wait(timeout=timeout), replacement_log.read_text(errors="replace"),
                          float("nan"))
        crashed = [rank_result(crashed_dir, r) for r in range(2 * RANKS_PER_NODE)]
    logs = "".join(r.output for r in runs)
    resumed = sorted({int(line.split("resumed at step ")[1].split()[0]) for line in logs.splitlines()
                      if "resumed at step " in line})
    return {"straight": straight, "crashed": crashed, "returncodes": [r.returncode for r in runs],
            "resumed_at": resumed, "whole_node": whole_node, "keep_buckets": keep_buckets,
            "difference": parameter_difference(workdir / "straight", crashed_dir), **events}


def parameter_difference(a: Path, b: Path) -> dict[str, float]:
    """How far rank 0's final parameters of two elastic_train.py runs are apart (0 and 0: identical)."""
    import torch

    x, y = (torch.cat([t.flatten() for t in torch.load(d / "rank0.pt")]) for d in (a, b))
    return {"values_differing": int((x != y).sum()), "of": x.numel(), "max_abs": float((x - y).abs().max())}


def link_loss(nodes: TwoNodes, workdir: Path, timeout_s: float = 10, outage_s: float = 30,
              harness_timeout: float = 240) -> dict:
    """Node 1's link goes down mid-training for ``outage_s`` (longer than the ranks' ``timeout_s``).

    Returns when each node's launcher exited (seconds after the link went down), their exit
    codes and the error lines the ranks printed; a hang raises ``TimeoutError`` after
    ``harness_timeout`` seconds.
    """
    events: dict[str, float] = {}
    out = workdir / "link"

    def cut(elapsed: float) -> None:
        if "down_at" not in events and (out / "ckpt.pt").exists():
            nodes.set_link(1, up=False)
            events["down_at"] = elapsed
        elif "down_at" in events and "up_at" not in events and elapsed > events["down_at"] + outage_s:
            nodes.set_link(1, up=True)
            events["up_at"] = elapsed

    runs, _ = elastic_job(nodes, out, "--steps", "400", "--step-seconds", "0.2", "--timeout", f"{timeout_s:g}",
                          timeout=harness_timeout, watch=cut)
    errors = sorted({line.split("RuntimeError: ")[-1].strip() for r in runs for line in r.output.splitlines()
                     if line.startswith("[rank") and "RuntimeError" in line})
    return {"timeout_s": timeout_s, "outage_s": outage_s, "returncodes": [r.returncode for r in runs],
            "exited_after_s": [round(r.seconds - events["down_at"], 1) for r in runs], "errors": errors, **events}


# ----- the rehearsal: the examples under the three launchers ----------------------------------
EXAMPLES = {"torchrun": "ddp_hook.py", "lightning": "gpt_finetune.py", "accelerate": "accelerate_gpt.py"}
REHEARSAL_FLAGS = ["--max-steps", "40", "--warmup-steps", "10", "--ramp-steps", "0", "--sparsity", "0.99",
                   "--val-every", "20", "--val-batches", "8"]


def example_commands(nodes: TwoNodes, launcher: str, flags: Sequence[str], out: Path) -> list[list[str]]:
    """Each node's command for ``examples/<EXAMPLES[launcher]>`` on 2 x 2 ranks."""
    argv = [str(ROOT / "examples" / EXAMPLES[launcher]), *flags, "--out", str(out)]
    if launcher == "accelerate":
        return [accelerate_launch(nodes, n, argv) for n in (0, 1)]
    if launcher == "lightning":  # Lightning reads the ranks torchrun gives it; it must agree on the shape
        argv += ["--devices", str(RANKS_PER_NODE), "--num-nodes", "2"]
    return [torchrun(nodes, n, argv) for n in (0, 1)]


def rehearse(nodes: TwoNodes, launcher: str, workdir: Path, flags: Sequence[str] = tuple(REHEARSAL_FLAGS),
             timeout: float = 600) -> dict:
    """Train an example on 2 x 2 ranks through ``launcher``; its summary and the bytes each node sent."""
    out = workdir / launcher
    commands = example_commands(nodes, launcher, flags, out)
    before = nodes.counters()
    runs = run_on_nodes(nodes, commands, timeout, out / "logs", label=launcher)
    if any(r.returncode for r in runs):
        raise RuntimeError(f"{launcher}: the example failed (exit codes {[r.returncode for r in runs]}):\n"
                           + tails(out / "logs", 2))
    after = nodes.counters()
    return {"launcher": launcher, "link": nodes.describe(),
            "environment": f"GLOO_SOCKET_IFNAME={IFACE} OMP_NUM_THREADS=1", "commands": [shown(c) for c in commands],
            "seconds": round(max(r.seconds for r in runs), 1),
            "summary": json.loads((out / "summary.json").read_text()),
            "veth_bytes": [after[n][IFACE] - before[n][IFACE] for n in (0, 1)],
            "lo_bytes": [after[n]["lo"] - before[n]["lo"] for n in (0, 1)]}


# ----- the benchmark: comm_bench's methods on 2 x 2 ranks --------------------------------------
BENCH_METHODS = ("no-comm + AdamS", "DDP + AdamW", "PowerSGD r4 + AdamW", "SCAPE 90%", "SCAPE 99%")


def run_checked(nodes: TwoNodes, commands: Sequence[Sequence[str]], timeout: float, logs: Path,
                label: str | None = None, status: Callable[[], str] | None = None) -> list[NodeRun]:
    """:func:`run_on_nodes`, raising if a node's launcher failed (with the end of each log)."""
    runs = run_on_nodes(nodes, commands, timeout, logs, label=label, status=status)
    if any(r.returncode for r in runs):
        raise RuntimeError(f"exit codes {[r.returncode for r in runs]}:\n" + tails(logs, len(runs)))
    return runs


def bench_two_nodes(nodes: TwoNodes, args: argparse.Namespace, logs: Path) -> dict:
    """comm_bench's worker on 2 x 2 ranks under torchrun; each node counts its own lo and veth."""
    argv = comm_bench.worker_argv(args) + ["--link", IFACE]

    def run(command: list[str], status: Path) -> None:
        run_checked(nodes, [torchrun(nodes, n, command) for n in (0, 1)], args.timeout, logs, label="2 x 2 ranks",
                    status=lambda: read_status(status))
    return comm_bench.measure(run, argv)


def bench_one_namespace(gbit: float, args: argparse.Namespace) -> dict:
    """The same run on 2 ranks in one namespace whose loopback gives each rank ``gbit`` (comm_bench's slow link)."""
    ns = Namespace(f"scape-mn-{os.getpid()}-ref", stale_prefix="scape-mn-")
    try:
        ns.create()
        ns.shape(gbit * 1000 * 2 if gbit else None)  # both ranks' traffic crosses the one loopback queue
        return comm_bench.measure(lambda a, status: launch(a, 2, args.timeout, prefix=ns.prefix(), status=status,
                                                           label="2 ranks, one namespace"),
                                  comm_bench.worker_argv(args))
    finally:
        ns.remove()


def bench_table(rows: dict, reference: dict | None) -> str:
    """Markdown: step time, paired ratios, bytes per step (handed, across the veth, inside nodes), 2-rank ratio."""
    bound, dense = comm_bench.BOUND, comm_bench.DENSE
    fmt = comm_bench.fmt_bytes
    head = ("| method | step (s, median) | / no-comm (paired) | dense DDP / this (paired) | bytes sent / step "
            "(one rank, as ScapeState.stats() counts) | across the veth / step (both ways) | % of dense DDP's | "
            "inside the nodes (lo) / step |")
    sep = "|---|---|---|---|---|---|---|---|"
    if reference:
        head += " 2 ranks, one namespace: step (s) | 2 x 2 / 2 ranks |"
        sep += "---|---|"
    lines = [head, sep]
    for name, r in rows.items():
        link = max(r.get("link_bytes", 0), 0)  # what two barriers cost is subtracted: tiny negatives are noise
        known = dense in rows and rows[dense].get("link_bytes")
        pct = f"{100 * link / rows[dense]['link_bytes']:.2f}%" if known else "-"
        line = (f"| {name} | {r['time_s']:.3f} | {comm_bench.ratio(rows, name, bound):.2f}x | "
                f"{comm_bench.ratio(rows, dense, name):.2f}x | {fmt(r.get('bytes', 0))} | {fmt(link)} | "
                f"{pct} | {fmt(max(r.get('lo_bytes', 0), 0))} |")
        if reference:
            ref = reference.get(name)
            line += (f" {ref['time_s']:.3f} | {r['time_s'] / ref['time_s']:.2f}x |" if ref else " - | - |")
        lines.append(line)
    return "\n".join(lines)


def bench(args: argparse.Namespace) -> dict:
    """Every ``--gbit`` link: the 2 x 2 run and (``--reference run``) the 2-rank one-namespace run."""
    report: dict = {"command": " ".join(["python", "benchmarks/multinode.py"] + sys.argv[1:]), "machine": machine(),
                    "core": core_version(), "nodes": 2, "ranks_per_node": RANKS_PER_NODE, "links": {}}
    start = time.time()
    for gbit in args.gbit:
        with TwoNodes(gbit=gbit or None, delay_ms=args.delay_ms) as nodes, tempfile.TemporaryDirectory() as tmp:
            key = f"{gbit:g}gbit" + (f"+{args.delay_ms:g}ms" if args.delay_ms else "")
            print(f"[{time.time() - start:5.0f}s] 2 x 2 ranks, link {nodes.describe()}: {args.methods}", flush=True)
            before = nodes.counters()
            raw = bench_two_nodes(nodes, args, Path(tmp))
            after = nodes.counters()
        entry = {"link": nodes.describe(), "raw": raw, "summary": comm_bench.summarize({"x": raw}, args.batches),
                 "veth_bytes_whole_run": [after[n][IFACE] - before[n][IFACE] for n in (0, 1)]}
        entry["summary"] = {k.split("/")[1]: v for k, v in entry["summary"].items()}
        if args.reference == "run":
            print(f"[{time.time() - start:5.0f}s] reference: 2 ranks in one namespace, {gbit:g} Gbit/s per rank",
                  flush=True)
            ref = bench_one_namespace(gbit, args)
            entry["reference"] = {"link": f"{gbit:g} Gbit/s per rank (tbf {2000 * gbit:g} mbit on lo)", "raw": ref,
                                  "summary": {k.split("/")[1]: v for k, v in
                                              comm_bench.summarize({"x": ref}, args.batches).items()}}
        report["links"][key] = entry
    report["params"] = next(iter(report["links"].values()))["raw"]["params"]
    return report


def bench_report(report: dict) -> str:
    """The markdown tables of a :func:`bench` report, one per link and batch."""
    out = []
    for key, entry in report["links"].items():
        for batch, rows in entry["summary"].items():
            ref = entry.get("reference", {}).get("summary", {}).get(batch)
            out += [f"\n**2 nodes x 2 ranks, link {entry['link']} per direction, per-rank batch {batch} x "
                    f"{entry['raw']['context']} tokens**\n", bench_table(rows, ref)]
    return "\n".join(out)


# ----- FSDP2: shard inside each node, SCAPE (or stock HSDP) across the veth ---------------------
def fsdp(args: argparse.Namespace) -> dict:
    """``fsdp_bench.py``'s worker on 2 x 2 ranks under torchrun: mesh (replicate, shard) = (nodes, node's ranks)."""
    report: dict = {"command": " ".join(["python", "benchmarks/multinode.py"] + sys.argv[1:]), "machine": machine(),
                    "core": core_version(), "nodes": 2, "ranks_per_node": RANKS_PER_NODE}
    with TwoNodes(gbit=args.gbit or None) as nodes, tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        argv = fsdp_bench.worker_argv(args, IFACE, str(result))
        print(f"2 x 2 ranks, FSDP2 in each node, link {nodes.describe()}: {args.methods}", flush=True)
        load = os.getloadavg()[0]
        before = nodes.counters()
        runs = run_checked(nodes, [torchrun(nodes, n, argv) for n in (0, 1)], args.timeout, Path(tmp) / "logs",
                           label="FSDP2, 2 x 2 ranks")
        after = nodes.counters()
        report.update(link=nodes.describe(), seconds=round(max(r.seconds for r in runs), 1),
                      commands=[shown(torchrun(nodes, n, ["benchmarks/fsdp_bench.py", "..."])) for n in (0, 1)],
                      loadavg=[round(load, 2), round(os.getloadavg()[0], 2)],
                      veth_bytes_whole_run=[after[n][IFACE] - before[n][IFACE] for n in (0, 1)],
                      **json.loads(result.read_text()))
    return report


# ----- driver ------------------------------------------------------------------------------------
def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    sub = p.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench", help="comm_bench's methods on 2 x 2 ranks over the shaped link")
    comm_bench.add_run_args(b, methods=BENCH_METHODS, batches="1")
    b.add_argument("--gbit", default="1,0.1", help="link rates to run, Gbit/s per direction, comma-separated "
                                                    "(0: unshaped)")
    b.add_argument("--delay-ms", type=float, default=0.0, help="added latency per direction (needs netem)")
    b.add_argument("--reference", choices=("run", "none"), default="run",
                   help="run: also time the 2-rank one-namespace run at the same rate (comm_bench's slow link)")
    b.add_argument("--timeout", type=float, default=600, help="seconds per run before every rank is killed")
    b.add_argument("--json", default=str(RESULTS / "multinode_bench.json"))
    r = sub.add_parser("rehearse", help="the examples on 2 x 2 ranks: torchrun, Lightning, Accelerate")
    r.add_argument("--gbit", type=float, default=1.0, help="link rate, Gbit/s per direction (0: unshaped)")
    r.add_argument("--delay-ms", type=float, default=0.0, help="added latency per direction (needs netem)")
    r.add_argument("--launchers", default=",".join(EXAMPLES))
    r.add_argument("--timeout", type=float, default=600, help="seconds per launch")
    r.add_argument("--json", default=str(RESULTS / "multinode_rehearsal.json"))
    f = sub.add_parser("faults", help="a node killed mid-training (its ranks; all of it; its ranks with DDP's "
                                      "bucket rebuild); a link lost")
    f.add_argument("--timeout", type=float, default=10, help="the ranks' collective timeout for the link loss")
    f.add_argument("--outage", type=float, default=30, help="seconds the link stays down")
    f.add_argument("--json", default=str(RESULTS / "multinode_faults.json"))
    d = sub.add_parser("fsdp", help="FSDP2 inside each node: stock 2-D HSDP + AdamS vs SCAPE across the veth")
    fsdp_bench.add_args(d)
    d.add_argument("--gbit", type=float, default=1.0, help="link rate, Gbit/s per direction (0: unshaped)")
    d.add_argument("--timeout", type=float, default=360, help="seconds before every rank is killed")
    d.add_argument("--json", default=str(RESULTS / "multinode_fsdp.json"))
    args = p.parse_args(argv)
    if args.command == "fsdp":
        args.methods = [m.strip() for m in args.methods.split(",")]
        if set(args.methods) - set(fsdp_bench.METHODS):
            d.error(f"--methods: choose from {list(fsdp_bench.METHODS)}")
    if args.command == "bench":
        comm_bench.check_run_args(b, args)
        args.gbit = [float(g) for g in args.gbit.split(",")]
    if args.command == "rehearse":
        args.launchers = [name.strip() for name in args.launchers.split(",")]
        if set(args.launchers) - set(EXAMPLES):
            r.error(f"--launchers: choose from {list(EXAMPLES)}")
    return args


def main() -> None:
    args = parse()
    why = TwoNodes.unavailable()
    if why:
        print(f"SKIPPED: two nodes need network namespaces and a veth pair ({why}).")
        return
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the namespaces are removed
    if args.command == "bench":
        report = bench(args)
        text = bench_report(report)
    elif args.command == "fsdp":
        report = fsdp(args)
        text = (f"GPT {report['params'] / 1e6:.1f}M, per-rank batch {report['batch']} x {report['context']}, "
                f"link {report['link']}, {report['seconds']} s\n" + fsdp_bench.table(report))
    elif args.command == "rehearse":
        report = {"command": " ".join(["python", "benchmarks/multinode.py"] + sys.argv[1:]), "machine": machine(),
                  "core": core_version(), "runs": []}
        with TwoNodes(gbit=args.gbit or None, delay_ms=args.delay_ms) as nodes, tempfile.TemporaryDirectory() as tmp:
            for launcher in args.launchers:
                print(f"{launcher}: {EXAMPLES[launcher]} on 2 x 2 ranks, link {nodes.describe()}", flush=True)
                report["runs"].append(rehearse(nodes, launcher, Path(tmp), timeout=args.timeout))
        text = "\n".join(rehearsal_line(run) for run in report["runs"])
    else:
        report = {"command": " ".join(["python", "benchmarks/multinode.py"] + sys.argv[1:]), "machine": machine(),
                  "core": core_version()}
        with TwoNodes() as nodes, tempfile.TemporaryDirectory() as tmp:
            for name, whole, keep in (("node_kill", False, True), ("node_kill_whole", True, True),
                                      ("node_kill_ddp_rebuilds_buckets", False, False)):
                result = node_kill(nodes, Path(tmp) / name, whole_node=whole, keep_buckets=keep)
                report[name] = describe_kill(result)
            report["link_loss"] = link_loss(nodes, Path(tmp), timeout_s=args.timeout, outage_s=args.outage)
        text = json.dumps({k: v for k, v in report.items() if k not in ("machine", "core")}, indent=1)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    print(f"\nmachine {machine()}; {core_version()}\n{text}\n\nwrote {args.json}")


def describe_kill(result: dict) -> dict:
    """A node_kill result as plain values: did it restart, resume, and end where the straight run did."""
    same = [c is not None and s is not None and (c.params, c.momenta, c.residuals, c.step)
            == (s.params, s.momenta, s.residuals, s.step) for c, s in zip(result["crashed"], result["straight"])]
    return {"returncodes": result["returncodes"], "whole_node": result["whole_node"],
            "keep_buckets": result["keep_buckets"], "difference": result["difference"], "killed": result.get("killed"),
            "killed_at_s": result.get("killed_at"), "resumed_at_step": result["resumed_at"],
            "bit_identical_per_rank": same, "replicas_identical": len({(c.params, c.momenta) for c in result["crashed"]
                                                                        if c is not None}) == 1}


def rehearsal_line(run: dict) -> str:
    s = run["summary"]
    return (f"- {run['launcher']}: val loss {s['val_loss_before']:.2f} -> {s['val_loss_after']:.2f} "
            f"in {s['steps']} steps, "
            f"{s['scape']['compression']:.1f}x fewer bytes than dense, {sum(run['veth_bytes']) / 1e6:.0f} MB across "
            f"the veth ({run['link']}), {run['seconds']:.0f} s\n    "
            + "\n    ".join(f"{run['environment']} {c}" for c in run["commands"]))


if __name__ == "__main__":
    main()
