"""accelerate_scape.trainer: ScapeTrainer (and TRL's SFTTrainer through the mixin) on 2 gloo processes.

One spawn of 2 processes runs every 2-process training (transformers takes seconds to import),
and the tests below read what each rank returned. The launch tests start this file itself
(``accelerate-scape launch tests/test_transformers.py MODE OUT``).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from scape_core.state import LOGGED
from tests.dist import free_port, run_distributed

HERE = Path(__file__).resolve()
STEPS = 8  # optimizer steps of the uninterrupted run; checkpoints every STEPS // 2
LR = 1e-2
SPARSE = dict(sparsity=0.9, warmup_steps=2, ramp_steps=0, wire="native")
needs_trl = pytest.mark.skipif(importlib.util.find_spec("trl") is None, reason="pip install trl")


class Tokens(torch.utils.data.Dataset):
    """Random token sequences, each its own label (the model shifts them)."""

    def __init__(self, n: int = 64, length: int = 16, vocab: int = 64) -> None:
        self.ids = torch.randint(vocab, (n, length), generator=torch.Generator().manual_seed(1))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def counted(stats: dict) -> dict:
    """``stats()`` without its step times, which a resumed run measures anew."""
    return {k: v for k, v in stats.items() if not k.startswith("step_seconds_")}


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None)
    return GPT2LMHeadModel(config)


def training_args(out: Path, **overrides):
    from transformers import TrainingArguments

    kwargs = dict(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=2, learning_rate=LR,
                  weight_decay=0.1, lr_scheduler_type="linear", logging_steps=1, save_steps=STEPS // 2,
                  report_to="none", use_cpu=True, disable_tqdm=True, seed=0, ddp_find_unused_parameters=False)
    return TrainingArguments(**(kwargs | overrides))


def report(trainer) -> dict:
    """What a rank saw: parameters, momentum, optimizer, learning rates, SCAPE counters, logs."""
    from accelerate_scape.trainer import ScapeTrainer  # noqa: F401 - the package imports without lightning

    params = list(trainer.model.parameters())
    optimizer = trainer.optimizer.optimizer
    return {
        "params": torch.cat([p.detach().flatten() for p in params]),
        "momentum": torch.cat([optimizer.state[p]["exp_avg"].flatten() for p in params]),
        "optimizer": type(optimizer).__name__,
        "weight_decay": sorted(g["weight_decay"] for g in optimizer.param_groups),
        "lr": [g["lr"] for g in optimizer.param_groups],
        "scheduler_lr": trainer.lr_scheduler.get_last_lr(),
        "logged_lr": [log["learning_rate"] for log in trainer.state.log_history if "loss" in log],
        "logged_scape": [{k: v for k, v in log.items() if k.startswith("scape/")}
                         for log in trainer.state.log_history if "loss" in log],
        "log_keys": [sorted(log) for log in trainer.state.log_history],
        "stats": trainer.scape.stats(),
        "settings": {n: (getattr(trainer.scape.config, n), s) for n, s in trainer.scape.settings.sources.items()},
        "lightning": any(m.startswith("lightning") for m in sys.modules),
    }


def _trainings(rank: int, world: int, out: str) -> dict:
    """Every 2-process training the tests check, on one rank."""
    from transformers import TrainerCallback

    from accelerate_scape.trainer import ScapeTrainer

    class Steps(TrainerCallback):
        """Optimizer steps this train() call ran; SCAPE's counters at the end of the warm-up."""

        def __init__(self):
            self.run = 0

        def on_step_end(self, args, state, control, **kwargs):
            self.run += 1
            if state.global_step == SPARSE["warmup_steps"]:
                self.stats = trainer.scape.stats()

    from tests.dist import said

    out, result = Path(out), {}
    # 1. uninterrupted, checkpoints at STEPS // 2 and STEPS
    steps = Steps()
    trainer = ScapeTrainer(model=tiny_gpt2(), args=training_args(out / "full"), train_dataset=Tokens(),
                           callbacks=[steps], scape=SPARSE)
    with said() as heard:
        trainer.train()
    result["full"] = report(trainer) | {"warmup_stats": steps.stats, "steps_run": steps.run, "lines": heard.lines,
                                        "warnings": [w for w in heard.warnings if w.startswith("SCAPE")]}
    result["full"]["files"] = sorted(os.listdir(out / "full" / f"checkpoint-{STEPS // 2}"))
    # 2. a fresh Trainer resumes the first checkpoint
    steps = Steps()
    trainer = ScapeTrainer(model=tiny_gpt2(), args=training_args(out / "full"), train_dataset=Tokens(),
                           callbacks=[steps], scape=SPARSE)
    trainer.train(resume_from_checkpoint=str(out / "full" / f"checkpoint-{STEPS // 2}"))
    result["resumed"] = report(trainer) | {"steps_run": steps.run}
    # 3. the same with sharded optimizer state: optimizer.pt holds every shard, and the resume is exact
    sharded = dict(SPARSE, shard_optimizer=True)
    ScapeTrainer(model=tiny_gpt2(), args=training_args(out / "sharded"), train_dataset=Tokens(), scape=sharded).train()
    trainer = ScapeTrainer(model=tiny_gpt2(), args=training_args(out / "sharded"), train_dataset=Tokens(),
                           scape=sharded)
    trainer.train(resume_from_checkpoint=str(out / "sharded" / f"checkpoint-{STEPS // 2}"))
    saved = torch.load(out / "sharded" / f"checkpoint-{STEPS // 2}" / "optimizer.pt", weights_only=True)["state"]
    result["sharded"] = dict(params=torch.cat([p.detach().flatten() for p in trainer.model.parameters()]),
                             sharded=trainer.scape.state.sharded,
                             saved=sorted(v["exp_avg"].shape for v in saved.values()),
                             shapes=sorted(p.shape for p in trainer.model.parameters()))
    # 4. gradient accumulation (DDP no_sync on the first micro-batch of each step), evaluated every 2 steps;
    # a ramp longer than the run
    args = training_args(out / "accumulate", max_steps=4, save_strategy="no", gradient_accumulation_steps=2,
                         eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4)
    trainer = ScapeTrainer(model=tiny_gpt2(), args=args, train_dataset=Tokens(), eval_dataset=Tokens(8),
                           scape=dict(SPARSE, ramp_steps=30))
    with said() as heard:
        trainer.train()
    result["accumulate"] = report(trainer) | {"warnings": [w for w in heard.warnings if w.startswith("SCAPE")]}
    if importlib.util.find_spec("trl") is not None:
        result["sft"] = _sft(out / "sft")
    return result


def _sft(out: Path) -> dict:
    """TRL's SFTTrainer with the mixin, on pre-tokenized text and a tokenizer built offline."""
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl import SFTConfig, SFTTrainer

    from accelerate_scape.trainer import ScapeTrainerMixin

    class ScapeSFTTrainer(ScapeTrainerMixin, SFTTrainer):
        pass

    vocab = {f"w{i}": i for i in range(62)} | {"<pad>": 62, "<eos>": 63}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>")
    ids = Tokens(32, 15, 62).ids
    data = Dataset.from_dict({"text": [" ".join(f"w{i}" for i in row.tolist()) for row in ids]})
    args = SFTConfig(output_dir=str(out), max_steps=4, per_device_train_batch_size=2, learning_rate=LR,
                     logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, disable_tqdm=True,
                     max_length=16, packing=False, ddp_find_unused_parameters=False, dataset_num_proc=None)
    trainer = ScapeSFTTrainer(model=tiny_gpt2(), args=args, train_dataset=data, processing_class=tokenizer,
                              scape=SPARSE)
    trainer.train()
    return report(trainer)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(_trainings, str(tmp_path_factory.mktemp("hf_trainer")))


def test_optimizer_is_scape_adams_with_both_parameter_groups(ranks):
    for r in ranks:
        assert r["full"]["optimizer"] == "ScapeAdamS"
        assert r["full"]["weight_decay"] == [0.0, 0.1]  # the Trainer's decay / no-decay groups
        assert not r["full"]["lightning"]  # accelerate_scape.trainer imports neither lightning nor lightning_scape


def test_lr_schedule_is_followed(ranks):
    full = ranks[0]["full"]
    assert full["lr"] == full["scheduler_lr"] == [0.0, 0.0]  # linear decay to 0 at max_steps
    expected = [LR * (1 - step / STEPS) for step in range(STEPS)]  # the lr each step trained with
    assert full["logged_lr"] == pytest.approx(expected, rel=1e-6)


def test_replicas_identical_and_sparse_bytes(ranks):
    full = [r["full"] for r in ranks]
    assert torch.equal(full[0]["params"], full[1]["params"])
    assert torch.equal(full[0]["momentum"], full[1]["momentum"])
    stats, warm = full[0]["stats"], full[0]["warmup_stats"]
    assert stats["steps"] == STEPS and warm["steps"] == SPARSE["warmup_steps"] and stats["skipped_steps"] == 0
    assert warm["bytes_sent"] == warm["dense_bytes"] > 0  # the warm-up is dense
    sent = (stats["bytes_sent"] - warm["bytes_sent"]) / (stats["dense_bytes"] - warm["dense_bytes"])
    assert sent == pytest.approx(1 - SPARSE["sparsity"], rel=0.15)  # per sparse step: about 1 - sparsity


def test_scape_stats_reach_the_trainer_logs(ranks):
    full = ranks[0]["full"]
    logged = full["logged_scape"]
    assert len(logged) == STEPS and set(logged[-1]) == {"scape/compression", "scape/step_compression",
                                                        "scape/bytes_sent", "scape/dense_bytes",
                                                        "scape/skipped_steps", "scape/skipped_streak",
                                                        "scape/step_seconds_dense", "scape/step_seconds_sparse"}
    assert logged[-1]["scape/bytes_sent"] == full["stats"]["bytes_sent"]
    assert logged[0]["scape/compression"] == 1.0 and logged[-1]["scape/compression"] > 2
    # the last step's own share (a sparse step at density 0.1: about 10x) beside the run's (2 dense steps in it)
    assert logged[0]["scape/step_compression"] == 1.0 and logged[-1]["scape/step_compression"] > 8


def test_the_start_of_run_line_the_closing_line_and_the_short_run_warning(ranks):
    for rank, r in enumerate(ranks):
        assert r["full"]["lines"][:1] == ([
            "SCAPE: sparsity=0.9, warmup_steps=2, ramp_steps=0, wire='native' (the rest default); steps 0-1 dense "
            "(warm-up), sparse "
            f"from step 2, at the target density 0.1 (native wire, 10% of dense bytes) from step 2; {STEPS} steps in "
            "this run"] if rank == 0 else [])
        # the end of train(): whether SCAPE paid (2 warm-up steps are too few to time: it says so)
        closing = r["full"]["lines"][1:]
        if rank == 0:
            assert len(closing) == 1 and closing[0].startswith("SCAPE: sparse steps ")
            assert "the dense warm-up was not timed" in closing[0] and "sent instead of" in closing[0]
        else:
            assert closing == []
        assert r["full"]["warnings"] == []  # 8 steps reach the target at step 2
        # the Trainer's max_steps=4 ends inside the 30-step ramp: said on rank 0
        assert [w.split(",")[0] for w in r["accumulate"]["warnings"]] == (
            ["SCAPE: this run has 4 optimizer steps"] if rank == 0 else [])


def test_ddp_find_unused_parameters_is_off_unless_chosen(tmp_path):
    from accelerate_scape.trainer import ScapeTrainer

    def chosen(value):
        args = training_args(tmp_path, ddp_find_unused_parameters=value)
        return ScapeTrainer(model=tiny_gpt2(), args=args, train_dataset=Tokens()).accelerator.ddp_handler

    # transformers' own default (None) is True for a PreTrainedModel: a graph search and a warning every run
    assert chosen(None).find_unused_parameters is False
    assert chosen(True).find_unused_parameters is True


def test_scape_keys_are_on_training_logs_only(ranks):
    """The training logs (``loss``) carry ``scape/*``; the evaluations' logs and the final metrics do not."""
    logs = ranks[0]["accumulate"]["log_keys"]
    scape = [{k for k in keys if k.startswith("scape/")} for keys in logs]
    training = [s for keys, s in zip(logs, scape) if "loss" in keys]
    other = [(keys, s) for keys, s in zip(logs, scape) if "loss" not in keys]
    assert len(training) == 4 and all(len(s) == len(LOGGED) for s in training), logs
    assert sum("eval_loss" in keys for keys, _ in other) == 2, logs  # at steps 2 and 4
    assert any("train_runtime" in keys for keys, _ in other), logs  # the final metrics
    assert not any(s for _, s in other), other


def test_save_steps_checkpoint_resumes_bit_for_bit(ranks):
    assert {"scape_state.pt", "optimizer.pt", "scheduler.pt", "rng_state_0.pth", "rng_state_1.pth",
            "model.safetensors"} <= set(ranks[0]["full"]["files"])
    for r in ranks:
        assert r["full"]["steps_run"] == STEPS and r["resumed"]["steps_run"] == STEPS - STEPS // 2
        assert torch.equal(r["resumed"]["params"], r["full"]["params"])
        assert torch.equal(r["resumed"]["momentum"], r["full"]["momentum"])
        assert counted(r["resumed"]["stats"]) == counted(r["full"]["stats"])  # residuals, masks, counters came back
        assert r["resumed"]["lr"] == r["full"]["lr"]


def test_sharded_optimizer_checkpoint_resumes_bit_for_bit(ranks):
    for r in ranks:
        sharded = r["sharded"]
        assert sharded["sharded"] and sharded["saved"] == sharded["shapes"]  # every parameter's whole state
        assert torch.equal(sharded["params"], r["full"]["params"])  # bit-for-bit the replicated run


def test_gradient_accumulation(ranks):
    acc = [r["accumulate"] for r in ranks]
    stats = acc[0]["stats"]
    assert stats["steps"] == 4 and stats["hook_calls"] == 4 * (stats["hook_calls"] // 4) > 0  # synced once per step
    assert stats["bytes_sent"] < stats["dense_bytes"]
    assert torch.equal(acc[0]["params"], acc[1]["params"])


@needs_trl
def test_trl_sft_trainer_through_the_mixin(ranks):
    sft = [r["sft"] for r in ranks]
    assert sft[0]["optimizer"] == "ScapeAdamS" and sft[0]["stats"]["steps"] == 4
    assert sft[0]["stats"]["bytes_sent"] < sft[0]["stats"]["dense_bytes"]
    assert torch.equal(sft[0]["params"], sft[1]["params"])
    assert sft[0]["lr"] == sft[0]["scheduler_lr"]


def test_single_process_is_inactive_and_trains_with_adams(tmp_path):
    from accelerate_scape.trainer import SCAPE_STATE_NAME, ScapeTrainer

    trainer = ScapeTrainer(model=tiny_gpt2(), args=training_args(tmp_path, max_steps=2, save_steps=2),
                           train_dataset=Tokens(), scape=SPARSE)
    trainer.train()
    assert not trainer.scape.active and type(trainer.optimizer.optimizer).__name__ == "AdamS"
    saved = torch.load(tmp_path / "checkpoint-2" / SCAPE_STATE_NAME, weights_only=True)
    assert saved == {"scape_active": False}  # a multi-process resume of it warns and starts SCAPE fresh


# ----- accelerate-scape launch ---------------------------------------------------------------------

def _launch(tmp_path: Path, mode: str, *flags: str) -> subprocess.CompletedProcess:
    exe = shutil.which("accelerate-scape")
    cli = [exe] if exe else [sys.executable, "-m", "accelerate_scape.cli"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SCAPE_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf"), PYTHONUNBUFFERED="1", ACCELERATE_USE_CPU="1",
               # tests.* importable from the launched script
               PYTHONPATH=os.pathsep.join(filter(None, [str(HERE.parents[1]), os.environ.get("PYTHONPATH")])))
    cmd = cli + ["launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
                 "--dynamo_backend", "no", "--main_process_port", str(free_port()), *flags, str(HERE), mode,
                 str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def test_accelerate_scape_launch_configures_the_trainer(tmp_path):
    proc = _launch(tmp_path, "scape", "--sparsity", "0.9", "--warmup_steps", "2")
    from accelerate_scape.watch import NOT_ACTIVE

    ranks = [torch.load(tmp_path / f"scape_{r}.pt", weights_only=False) for r in range(2)]
    assert ranks[0]["settings"]["sparsity"] == (0.9, "env SCAPE_SPARSITY")
    assert ranks[0]["settings"]["warmup_steps"] == (2, "env SCAPE_WARMUP_STEPS")
    assert ranks[0]["optimizer"] == "ScapeAdamS" and ranks[0]["stats"]["bytes_sent"] < ranks[0]["stats"]["dense_bytes"]
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])
    assert NOT_ACTIVE not in proc.stdout + proc.stderr
    # ddp_find_unused_parameters=None: SCAPE's Trainer turns DDP's search off, so DDP has nothing to warn of
    assert "find_unused_parameters=True was specified" not in proc.stderr


def test_accelerate_scape_launch_says_once_when_scape_is_off(tmp_path):
    proc = _launch(tmp_path, "plain")
    from accelerate_scape.watch import NOT_ACTIVE

    said = (proc.stdout + proc.stderr).count(NOT_ACTIVE)
    assert said == 1, proc.stderr[-3000:]  # once, on rank 0, at the first optimizer step
    assert "AdamW on 2 process(es)" in proc.stderr and "ScapeTrainer" in proc.stderr
    assert "find_unused_parameters=True was specified" in proc.stderr  # the stock Trainer's DDP warns (see above)


def _script(mode: str, out: Path) -> None:
    """The launched script: a ScapeTrainer configured by the launcher, or a plain Trainer."""
    from transformers import Trainer

    from accelerate_scape.trainer import ScapeTrainer

    rank = int(os.environ["RANK"])
    # the Trainer's own DDP settings (find_unused_parameters=True for a PreTrainedModel), as a user's script has them
    args = training_args(out / mode, max_steps=3, save_strategy="no", ddp_find_unused_parameters=None)
    if mode == "plain":
        Trainer(model=tiny_gpt2(), args=args, train_dataset=Tokens()).train()
        return
    trainer = ScapeTrainer(model=tiny_gpt2(), args=args, train_dataset=Tokens())
    trainer.train()
    torch.save(report(trainer), out / f"{mode}_{rank}.pt")


if __name__ == "__main__":
    torch.set_num_threads(1)
    _script(sys.argv[1], Path(sys.argv[2]))
