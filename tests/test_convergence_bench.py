"""benchmarks/convergence.py end to end on a tiny model: runs, files, report."""

import json

from benchmarks.convergence import main, parse_method


def test_parse_method():
    want = dict(kind="scape", sparsity=0.99, update="linear", ramp=150)
    assert parse_method("scape99+update=linear+ramp=150") == want


def test_tiny_run_and_report(tmp_path, capsys):
    methods = ["adams", "scape99+update=linear+ramp=3+score=age_momentum", "topk99_eqbytes",
               "scape99+update=linear+ramp=3+score=age_momentum+wire=auto"]  # int4 at 99%
    main(["--methods", *methods, "--seeds", "0", "--steps", "8", "--world-size", "2", "--batch", "4",
          "--context", "16", "--width", "16", "--layers", "1", "--heads", "2", "--scape-warmup", "2",
          "--eval-every", "4", "--val-batches", "1", "--out", str(tmp_path)])
    runs = {r["method"]: r for r in (json.loads(p.read_text()) for p in tmp_path.glob("*.json"))}
    assert set(runs) == set(methods)
    assert all(r["completed"] and r["curve"][-1][0] == 8 for r in runs.values())
    scape = runs[methods[1]]
    assert scape["bytes_per_step"] < 0.5 * scape["dense_bytes_per_step"]  # 2 dense of 8 steps, then sparse
    assert runs["adams"]["bytes_per_step"] == runs["adams"]["dense_bytes_per_step"]
    # the default wire at 99% (int4): no more bytes than fp32 (its ramp keeps only the 25% stage: fewer)
    assert 0 < runs[methods[3]]["sparse_bytes_per_step"] <= scape["sparse_bytes_per_step"]
    main(["--report", "--out", str(tmp_path)])
    table = capsys.readouterr().out
    assert "| `adams` |" in table and "+0.0%" in table and methods[1] in table


def test_another_corpus_is_recorded_with_its_provenance(tmp_path):
    main(["--methods", "adams", "--seeds", "0", "--steps", "2", "--world-size", "2", "--batch", "2",
          "--context", "8", "--width", "8", "--layers", "1", "--heads", "2", "--eval-every", "2",
          "--val-batches", "1", "--corpus", "python-source", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("*.json")
    run = json.loads(path.read_text())
    assert path.name.endswith("__python-source.json") and run["corpus"] == "python-source"
    info = run["corpus_info"]
    assert info["source"].startswith("stdlib source of argparse") and len(info["sha256"]) == 64
    assert run["completed"] and info["vocab"] > 65  # code has more characters than tiny Shakespeare
