"""accelerate_scape: settings precedence, the accelerate-scape CLI, and ScapePlugin on 2 CPU processes.

The training script the launch tests start is this file itself
(``accelerate launch tests/test_accelerate.py MODE OUT``), so each check sits next to the code
that produces its numbers. Each launch costs several seconds of start-up, so one launch runs
several trainings and the tests below read its results.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import types
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch
from accelerate.tracking import GeneralTracker
from torch import nn

from accelerate_scape.settings import (
    default_config_file,
    load_config_file,
    resolve_settings,
    to_environ,
    write_config_file,
)
from scape_core import AdamS, ScapeConfig

HERE = Path(__file__).resolve()
STEPS = 8  # optimizer steps of the uninterrupted run; the resumed run saves at STEPS // 2
SPARSE = dict(sparsity=0.9, warmup_steps=2)


def counted(stats: dict) -> dict:
    """``stats()`` without its step times, which a resumed run measures anew."""
    return {k: v for k, v in stats.items() if not k.startswith("step_seconds_")}


# ======================================================================================
# The launched training script
# ======================================================================================
def _build(accelerator_kwargs: dict, scape_kwargs: dict, compile: bool = False, late_scheduler: bool = False):
    from accelerate import Accelerator
    from torch.optim.lr_scheduler import LambdaLR
    from torch.utils.data import DataLoader, TensorDataset

    from accelerate_scape import ScapePlugin

    accelerator = Accelerator(**accelerator_kwargs)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    if compile:
        model = torch.compile(model, backend="eager")  # DDP(OptimizedModule) after prepare
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=1e-2, betas=(0.9, 0.95))
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(128, 16, generator=g), torch.randn(128, 4, generator=g))
    loader = DataLoader(data, batch_size=4)
    scape = ScapePlugin(**scape_kwargs)
    if late_scheduler:  # built on the user's own optimizer object after scape.prepare, prepared alone
        mine = optimizer
        model, optimizer, loader = scape.prepare(accelerator, model, optimizer, loader)
        scheduler = accelerator.prepare(LambdaLR(mine, lambda s: 1.0 / (1.0 + 0.1 * s)))
        return accelerator, scape, model, optimizer, loader, scheduler
    scheduler = LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.1 * s))
    model, optimizer, loader, scheduler = scape.prepare(accelerator, model, optimizer, loader, scheduler)
    return accelerator, scape, model, optimizer, loader, scheduler


def _train(accelerator, model, optimizer, loader, scheduler, steps: int) -> None:
    batches = iter(loader)
    for _ in range(steps * accelerator.gradient_accumulation_steps):
        x, y = next(batches)
        with accelerator.accumulate(model):
            loss = (model(x) - y).pow(2).mean()
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()


def _report(scape, model, optimizer, scheduler) -> dict:
    return {
        "params": torch.cat([p.detach().float().flatten() for p in model.parameters()]),
        "momentum": torch.cat([optimizer.state[p]["exp_avg"].flatten() for p in model.parameters()]),
        "stats": scape.stats(),
        "active": scape.active,
        "optimizer": type(optimizer.optimizer).__name__,
        "lr": [g["lr"] for g in optimizer.param_groups],
        "scheduler_lr": scheduler.get_last_lr(),
        "scheduler_bound": scheduler.scheduler.optimizer is optimizer.optimizer,
        "settings": {n: (getattr(scape.config, n), s) for n, s in scape.settings.sources.items()},
    }


class ListTracker(GeneralTracker):
    """An Accelerate tracker that keeps what it is given."""

    name = "list"
    requires_logging_directory = False

    def __init__(self):
        super().__init__()
        self.logged: list = []

    @property
    def tracker(self):
        return self.logged

    def store_init_configuration(self, values):
        pass

    def log(self, values, step=None, **kwargs):
        self.logged.append((step, dict(values)))


def _script_main(out: Path) -> None:
    """bf16 + clip + LR scheduler + logging; save/load resume; accumulation under torch.compile."""
    rank = int(os.environ["RANK"])
    result = {}
    # 1. uninterrupted run, stats logged through a tracker
    tracker = ListTracker()
    acc, scape, model, opt, loader, sched = _build(dict(log_with=[tracker]), dict(SPARSE, log_every=1))
    acc.init_trackers("scape-test")
    _train(acc, model, opt, loader, sched, STEPS)
    result["full"] = _report(scape, model, opt, sched)
    result["full"]["logged"] = tracker.logged if acc.is_main_process else None
    result["full"]["mixed_precision"] = acc.mixed_precision
    # 2. first half, then save_state
    acc, scape, model, opt, loader, sched = _build({}, SPARSE)
    _train(acc, model, opt, loader, sched, STEPS // 2)
    acc.save_state(str(out / "ckpt"))
    acc.wait_for_everyone()  # rank 0 writes the files every rank reads next
    # 3. fresh objects, load_state, second half
    acc, scape, model, opt, loader, sched = _build({}, SPARSE)
    acc.load_state(str(out / "ckpt"))
    _train(acc, model, opt, acc.skip_first_batches(loader, STEPS // 2), sched, STEPS - STEPS // 2)
    result["resumed"] = _report(scape, model, opt, sched)
    # 4. gradient accumulation (no_sync) on a torch.compile'd model
    acc, scape, model, opt, loader, sched = _build(dict(gradient_accumulation_steps=2), SPARSE, compile=True)
    _train(acc, model, opt, loader, sched, 4)
    result["accumulate"] = _report(scape, model, opt, sched)
    result["accumulate"]["model"] = type(model).__name__
    # 5. the LR scheduler built on the user's optimizer after scape.prepare: the same run as 1
    acc, scape, model, opt, loader, sched = _build({}, SPARSE, late_scheduler=True)
    _train(acc, model, opt, loader, sched, STEPS)
    result["late_scheduler"] = _report(scape, model, opt, sched)
    # 6. sharded optimizer state (accelerate-scape's shard_optimizer): save_state, load_state, as 2 and 3
    sharded = dict(SPARSE, shard_optimizer=True)
    acc, scape, model, opt, loader, sched = _build({}, sharded)
    _train(acc, model, opt, loader, sched, STEPS // 2)
    acc.save_state(str(out / "ckpt_sharded"))
    acc.wait_for_everyone()
    acc, scape, model, opt, loader, sched = _build({}, sharded)
    acc.load_state(str(out / "ckpt_sharded"))
    _train(acc, model, opt, acc.skip_first_batches(loader, STEPS // 2), sched, STEPS - STEPS // 2)
    saved = torch.load(out / "ckpt_sharded" / "optimizer.bin", weights_only=True)["state"]
    result["sharded"] = dict(params=torch.cat([p.detach().float().flatten() for p in model.parameters()]),
                             sharded=scape.state.sharded, stats=scape.stats(),
                             saved=sorted(v["exp_avg"].shape for v in saved.values()),
                             shapes=sorted(p.shape for p in model.parameters()))
    result["resume_defaults"] = _resume_defaults(out)
    torch.save(result, out / f"main_{rank}.pt")


def _resume_defaults(out: Path) -> dict:
    """The defaults at 99% (int4) and 90% (native), small DDP buckets (regrouped after each new DDP's
    first iteration): save_state, then fresh objects, load_state, the second half."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedDataParallelKwargs
    from torch.utils.data import DataLoader, TensorDataset

    from accelerate_scape import ScapePlugin
    from tests.test_resume import CONFIGS, SCHEDULE, TinyTransformer

    def build(config):
        acc = Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=0.02)])
        model = TinyTransformer()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
        tokens = torch.randint(0, 64, (256, 13), generator=torch.Generator().manual_seed(2))
        scape = ScapePlugin(**config, **SCHEDULE)
        return (acc, scape, *scape.prepare(acc, model, opt, DataLoader(TensorDataset(tokens), batch_size=4)))

    def train(acc, model, opt, loader, steps):
        batches = iter(loader)
        for _ in range(steps):
            (tokens,) = next(batches)
            logits = model(tokens[:, :-1])
            acc.backward(nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()))
            opt.step()
            opt.zero_grad()

    result = {}
    for name, config in CONFIGS.items():
        acc, scape, model, opt, loader = build(config)
        train(acc, model, opt, loader, 30)
        full = [p.detach().clone() for p in model.parameters()]
        acc, scape, model, opt, loader = build(config)
        train(acc, model, opt, loader, 16)
        acc.save_state(str(out / f"ckpt_{name}"))
        acc.wait_for_everyone()
        acc, scape, model, opt, loader = build(config)
        acc.load_state(str(out / f"ckpt_{name}"))
        train(acc, model, opt, acc.skip_first_batches(loader, 16), 14)
        result[name] = dict(full=full, resumed=[p.detach().clone() for p in model.parameters()],
                            wire=scape.config.resolved_wire, steps=scape.state.step,
                            hook_calls=scape.state.comm.counters["hook_calls"])
    return result


def _script_cli(out: Path) -> None:
    """Settings from `accelerate-scape launch`; the script's own argument beats them all."""
    from tests.dist import said

    rank = int(os.environ["RANK"])
    with said() as heard:  # the start-of-run line at prepare, with where each setting came from
        acc, scape, model, opt, loader, sched = _build({}, dict(mask_delay=0, max_steps=8))
    _train(acc, model, opt, loader, sched, 6)
    result = _report(scape, model, opt, sched)
    result["said"] = dict(lines=heard.lines, warnings=[w for w in heard.warnings if w.startswith("SCAPE")])
    result["env"] = {k: v for k, v in os.environ.items() if k.startswith("SCAPE_")}
    result["model"] = type(model).__name__
    # a NaN on rank 1 only: every rank skips the step, Accelerate sees it and holds the scheduler
    lr = sched.get_last_lr()
    x, y = next(iter(loader))
    acc.backward((model(x) - y).pow(2).mean() * (float("nan") if rank == 1 else 1.0))
    opt.step()
    sched.step()
    opt.zero_grad()
    result["nan"] = dict(skipped=acc.optimizer_step_was_skipped, lr_held=sched.get_last_lr() == lr,
                         stats=scape.stats(), unchanged=torch.equal(_report(scape, model, opt, sched)["params"],
                                                                   result["params"]))
    _train(acc, model, opt, loader, sched, 1)  # and training goes on
    result["after"] = _report(scape, model, opt, sched) | {"skipped": acc.optimizer_step_was_skipped}
    torch.save(result, out / f"cli_{rank}.pt")


def _script_single(out: Path) -> None:
    """One process: SCAPE inactive, AdamS, checkpoints still work."""
    acc, scape, model, opt, loader, sched = _build({}, SPARSE)
    _train(acc, model, opt, loader, sched, 3)
    acc.save_state(str(out / "ckpt"))
    result = _report(scape, model, opt, sched) | {"num_processes": acc.num_processes}
    result["saved"] = torch.load(out / "ckpt" / "custom_checkpoint_0.pkl", weights_only=False)
    torch.save(result, out / "single.pt")


# ======================================================================================
# Helpers for the tests
# ======================================================================================
def _scape_cli() -> list[str]:
    exe = shutil.which("accelerate-scape")
    return [exe] if exe else [sys.executable, "-m", "accelerate_scape.cli"]


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SCAPE_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", HF_HOME=str(tmp_path / "hf"), PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def _run(cmd: list[str], env: dict[str, str], timeout: int = 300, input: str | None = None,
         check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, input=input)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}")
    return proc


def _launch_args(dynamo_backend: str = "no") -> list[str]:
    from tests.dist import free_port

    return ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--dynamo_backend", dynamo_backend,
            "--main_process_port", str(free_port())]


def _load(out: Path, name: str) -> list[dict]:
    return [torch.load(out / f"{name}_{r}.pt", weights_only=False) for r in range(2)]


# ======================================================================================
# Tests: settings (in process)
# ======================================================================================
def test_precedence_arguments_env_file_defaults(tmp_path):
    file = tmp_path / "scape_config.yaml"
    file.write_text("sparsity: 0.8\nwarmup_steps: 7\nmask_refresh: 3\n")
    env = {"SCAPE_WARMUP_STEPS": "11", "SCAPE_MASK_REFRESH": "4", "SCAPE_ERROR_FEEDBACK": "no"}
    s = resolve_settings({"mask_refresh": 5, "score": None}, config_file=file, environ=env)
    assert s.config == ScapeConfig(sparsity=0.8, warmup_steps=11, mask_refresh=5, error_feedback=False)
    assert s.sources["mask_refresh"] == "argument"
    assert s.sources["warmup_steps"] == "env SCAPE_WARMUP_STEPS"
    assert s.sources["error_feedback"] == "env SCAPE_ERROR_FEEDBACK"
    assert s.sources["sparsity"] == f"file {file}"
    assert s.sources["score"] == "default" and s.config.score == ScapeConfig().score
    # the file is found through the variables Accelerate uses, or SCAPE_CONFIG_FILE
    hf = tmp_path / "hf"
    write_config_file(ScapeConfig(sparsity=0.7), hf / "accelerate" / "scape_config.yaml")
    assert resolve_settings(environ={"HF_HOME": str(hf)}).config.sparsity == 0.7
    assert resolve_settings(environ={"SCAPE_CONFIG_FILE": str(file)}).config.sparsity == 0.8
    xdg = {"XDG_CACHE_HOME": str(tmp_path / "xdg")}
    assert default_config_file(xdg) == tmp_path / "xdg" / "huggingface" / "accelerate" / "scape_config.yaml"
    assert resolve_settings(environ=xdg).sources["sparsity"] == "default"


def test_a_config_file_variable_naming_no_file_is_an_error(tmp_path):
    (tmp_path / "a.yaml").write_text("sparsity: 0.8\n")
    for named, what in ((tmp_path / "a.yml", "does not exist"), (tmp_path, "is a folder")):
        with pytest.raises(FileNotFoundError) as e:  # was: ignored, the run at the defaults
            resolve_settings(environ={"SCAPE_CONFIG_FILE": str(named)})
        assert f"SCAPE_CONFIG_FILE={named} names no SCAPE config file" in str(e.value) and what in str(e.value)
    assert resolve_settings(environ={"SCAPE_CONFIG_FILE": str(tmp_path / "a.yaml")}).config.sparsity == 0.8


def test_environment_round_trip():
    config = ScapeConfig(sparsity=0.95, warmup_steps=3, mask_delay=0, error_feedback=False, score="momentum")
    assert resolve_settings(environ=to_environ(config) | {"HF_HOME": "/nonexistent"}).config == config


@pytest.mark.parametrize("text, message", [
    ("sparsity: 0.9\nsparsty: 0.5\n", "unknown key 'sparsty' (did you mean 'sparsity'?)"),
    ("sparsity: 1.5\n", "key 'sparsity': sparsity must be in [0, 1)"),
    ("warmup_steps: 2.5\n", "key 'warmup_steps': warmup_steps must be an int"),
    ("error_feedback: maybe\n", "key 'error_feedback'"),
    ("update: nope\n", "key 'update': update must be one of"),
    ("- 0.9\n", "expected a mapping"),
    ('sparsity: "0.9"\n', "sparsity must be a float in [0, 1), got the string '0.9'"),  # quoted: says so
    ("sparsity: [\n", "not valid YAML"),
])
def test_bad_config_file_names_file_and_key(tmp_path, text, message):
    file = tmp_path / "scape_config.yaml"
    file.write_text(text)
    with pytest.raises(ValueError) as e:
        resolve_settings(environ={"SCAPE_CONFIG_FILE": str(file)})
    assert str(file) in str(e.value) and message in str(e.value)
    with pytest.raises(ValueError):  # even where the environment overrides that key
        resolve_settings(environ={"SCAPE_CONFIG_FILE": str(file), "SCAPE_SPARSITY": "0.5"})


def test_numbers_as_written_in_yaml_and_numpy(tmp_path):
    import numpy as np

    file = tmp_path / "scape_config.yaml"
    file.write_text("sparsity: 1e-1\nwarmup_steps: 10\n")  # PyYAML alone reads 1e-1 as the string '1e-1'
    assert load_config_file(file) == {"sparsity": 0.1, "warmup_steps": 10}
    s = resolve_settings({"sparsity": np.float32(0.5), "ramp_steps": np.int64(30)}, environ={"HF_HOME": str(tmp_path)})
    assert (s.config.sparsity, s.config.ramp_steps) == (0.5, 30)


def test_unreadable_and_unwritable_config_files_are_named(tmp_path, capsys):
    from accelerate_scape.cli import main

    file = tmp_path / "scape_config.yaml"
    file.write_bytes(b"sparsity: 0.9\xff\n")
    with pytest.raises(ValueError, match=f"{file}: not UTF-8 text"):
        load_config_file(file)
    assert main(["env", "--scape_config_file", str(file)]) == 2
    assert f"accelerate-scape env: error: {file}: not UTF-8 text" in capsys.readouterr().err
    blocked = tmp_path / "a_file" / "scape_config.yaml"  # its parent is a file: not writable, even as root
    (tmp_path / "a_file").write_text("")
    assert main(["config", "--sparsity", "0.9", "--scape_config_file", str(blocked)]) == 2
    err = capsys.readouterr().err
    assert f"accelerate-scape config: error: [Errno 17] cannot write the SCAPE config file {blocked}" in err
    assert "Traceback" not in err


@pytest.mark.parametrize("argv", [["--help"], ["config", "--help"], ["env", "--help"], ["launch", "--help"]])
def test_every_help_prints(argv, capsys, monkeypatch):
    from accelerate_scape.cli import main

    monkeypatch.setattr(sys, "argv", ["accelerate-scape", *argv])  # Accelerate's help formatter reads it
    with pytest.raises(SystemExit) as exit:
        main(argv)
    out = capsys.readouterr().out
    assert exit.value.code == 0 and out.startswith("usage: accelerate-scape")
    if argv == ["--help"]:
        assert all(f"    {command} " in out for command in ("config", "env", "launch"))
    else:
        assert argv[0] == "env" or "(25%, 6.25%, 1.6% density)" in " ".join(out.split())


def test_bad_environment_and_arguments(tmp_path):
    env = {"HF_HOME": str(tmp_path)}
    with pytest.raises(ValueError, match=r"SCAPE_WARMUP_STEPS='ten'.*expects an int"):
        resolve_settings(environ=env | {"SCAPE_WARMUP_STEPS": "ten"})
    with pytest.raises(ValueError, match=r"argument sparsity=-0.1"):
        resolve_settings({"sparsity": -0.1}, environ=env)
    with pytest.raises(TypeError, match="unknown SCAPE setting"):
        resolve_settings({"sparsty": 0.9}, environ=env)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_settings(config_file=tmp_path / "missing.yaml", environ=env)
    with pytest.warns(UserWarning, match="SCAPE_SPARSTY is not a SCAPE setting.*SCAPE_SPARSITY"):
        resolve_settings(environ=env | {"SCAPE_SPARSTY": "0.5"})


def test_config_dir_matches_accelerate(tmp_path):
    code = ("from accelerate.commands.config.config_args import default_config_file as a;"
            "from accelerate_scape.settings import accelerate_config_dir as s;"
            "import os; assert os.path.dirname(a) == str(s()), (a, s()); print('same')")
    env = _env(tmp_path, XDG_CACHE_HOME=str(tmp_path / "xdg"))
    env.pop("HF_HOME")
    assert _run([sys.executable, "-c", code], env).stdout.strip() == "same"


def test_refuses_fp16_and_other_backends():
    from accelerate.utils import DistributedType

    from accelerate_scape.plugin import _check_accelerator

    fp16 = types.SimpleNamespace(distributed_type=DistributedType.MULTI_CPU, mixed_precision="fp16", scaler=None)
    with pytest.raises(ValueError, match="does not support mixed_precision='fp16'.*bf16"):
        _check_accelerator(fp16, multi=True)
    _check_accelerator(fp16, multi=False)  # single process: SCAPE inactive, nothing to refuse
    ds = types.SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, mixed_precision="no", scaler=None)
    with pytest.raises(ValueError, match="DDP data parallelism"):
        _check_accelerator(ds, multi=True)


def test_optimizer_conversion_rules():
    from scape_core.convert import adams_param_groups

    model = nn.Linear(3, 2)
    adamw = torch.optim.AdamW([{"params": [model.weight], "tag": "w"}, {"params": [model.bias], "lr": 5e-3}],
                              lr=1e-3, betas=(0.8, 0.9), eps=1e-6, weight_decay=0.2)
    groups, defaults = adams_param_groups(adamw)
    converted = AdamS(groups, **defaults)
    assert [g["params"] for g in converted.param_groups] == [g["params"] for g in adamw.param_groups]
    assert [(g["lr"], g["betas"], g["eps"], g["weight_decay"]) for g in converted.param_groups] == \
        [(1e-3, (0.8, 0.9), 1e-6, 0.2), (5e-3, (0.8, 0.9), 1e-6, 0.2)]
    assert converted.param_groups[0]["tag"] == "w"
    with pytest.raises(TypeError, match="got optimizer SGD"):
        adams_param_groups(torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="amsgrad=True"):
        adams_param_groups(torch.optim.Adam(model.parameters(), amsgrad=True))
    with pytest.warns(UserWarning, match="L2"):
        adams_param_groups(torch.optim.Adam(model.parameters(), weight_decay=0.01))
    model(torch.ones(1, 3)).sum().backward()
    adamw.step()
    with pytest.raises(ValueError, match="already holds state"):
        adams_param_groups(adamw)


# ======================================================================================
# Tests: the CLI
# ======================================================================================
def test_console_script_is_declared():
    (script,) = [e for e in entry_points(group="console_scripts") if e.name == "accelerate-scape"]
    assert script.value == "accelerate_scape.cli:main"


def test_cli_config_interactive_flags_and_env(tmp_path):
    env = _env(tmp_path)
    path = Path(env["HF_HOME"]) / "accelerate" / "scape_config.yaml"
    # interactive: an invalid answer is asked again, empty answers keep defaults
    # one line per ScapeConfig field (abc: asked again); the ten fields up to shard_optimizer, then defaults
    answers = "0.8\nabc\n5\n\n\nno\n\n\n\n\nyes\n" + "\n" * (len(dataclasses.fields(ScapeConfig)) - 10)
    proc = _run(_scape_cli() + ["config"], env, input=answers)
    assert "expects an int" in proc.stdout and str(path) in proc.stdout
    # only the answers given are written: the rest take each script's own defaults
    assert load_config_file(path) == dict(sparsity=0.8, warmup_steps=5, error_feedback=False, shard_optimizer=True)
    # flags: no prompts, hyphen or underscore spelling; the flags are written over the file's settings, which stay
    # (an earlier config's keys were once dropped silently), and the command says which it kept
    kept = _run(_scape_cli() + ["config", "--sparsity", "0.9", "--warmup-steps", "3", "--mask_refresh", "2"], env)
    assert load_config_file(path) == dict(sparsity=0.9, warmup_steps=3, error_feedback=False, shard_optimizer=True,
                                          mask_refresh=2)
    assert "kept from the file: error_feedback=False, shard_optimizer=True" in kept.stdout
    path.write_text("sparsity: 0.9\nwarmup_steps: 3\nmask_refresh: 2\n")
    bad = _run(_scape_cli() + ["config", "--sparsity", "1.5"], env, check=False)
    assert bad.returncode != 0 and "sparsity must be in [0, 1), got 1.5" in bad.stderr
    assert load_config_file(path)["sparsity"] == 0.9  # a refused command writes nothing
    # env: the resolved settings and their sources
    out = _run(_scape_cli() + ["env"], env | {"SCAPE_WARMUP_STEPS": "4"}).stdout
    lines = {line.split("=")[0].strip(): line for line in out.splitlines() if "=" in line}
    assert "0.9" in lines["sparsity"] and f"(file {path})" in lines["sparsity"]
    assert "4" in lines["warmup_steps"] and "(env SCAPE_WARMUP_STEPS)" in lines["warmup_steps"]
    assert "(default)" in lines["ramp_steps"] and "(default)" not in lines["mask_refresh"]
    path.write_text("sparsity: 0.9\nwarmup: 3\n")
    bad = _run(_scape_cli() + ["env"], env, check=False)
    assert bad.returncode == 2 and f"{path}: unknown key 'warmup'" in bad.stderr and "Traceback" not in bad.stderr


# ======================================================================================
# Tests: 2-process training
# ======================================================================================
@pytest.fixture(scope="module")
def main_run(tmp_path_factory):
    """One `accelerate launch` (2 CPU processes, bf16) running four trainings."""
    out = tmp_path_factory.mktemp("accelerate_main")
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", *_launch_args(),
           "--mixed_precision", "bf16", str(HERE), "main", str(out)]
    proc = _run(cmd, _env(out, ACCELERATE_USE_CPU="1"))
    return proc, _load(out, "main")


def test_hook_runs_sparse_and_replicas_agree(main_run):
    proc, ranks = main_run
    full = [r["full"] for r in ranks]
    assert all(f["active"] and f["optimizer"] == "ScapeAdamS" for f in full)
    assert full[0]["mixed_precision"] == "bf16"
    stats = full[0]["stats"]
    assert stats["steps"] == STEPS and stats["hook_calls"] >= STEPS and stats["skipped_steps"] == 0
    assert stats["bytes_sent"] < 0.6 * stats["dense_bytes"]  # 2 dense warm-up steps, then ~10% (+ masks)
    assert torch.equal(full[0]["params"], full[1]["params"])
    assert torch.equal(full[0]["momentum"], full[1]["momentum"])
    assert "SCAPE: active on 2 processes, AdamW -> ScapeAdamS" in proc.stdout
    # the start-of-run line once per plugin, on rank 0 only: 5 plugins of these settings in the launch
    assert proc.stderr.count("SCAPE: sparsity=0.9, warmup_steps=2 (the rest default); steps 0-1 dense (warm-up)") == 5


def test_scheduler_rebound_and_stats_logged(main_run):
    _, ranks = main_run
    full = ranks[0]["full"]
    assert full["scheduler_bound"]
    assert full["lr"] == full["scheduler_lr"] and full["lr"][0] < 1e-2  # the schedule drives the new optimizer
    logged = full["logged"]
    assert [step for step, _ in logged] == list(range(1, STEPS + 1))
    assert logged[-1][1]["scape/bytes_sent"] == full["stats"]["bytes_sent"]
    # each step's own compression beside the run's: 1 on the 2 dense steps, then a ramp step's (density 0.25)
    assert [values["scape/step_compression"] for _, values in logged[:2]] == [1.0, 1.0]
    assert logged[-1][1]["scape/step_compression"] > 1.3 * logged[-1][1]["scape/compression"]
    assert ranks[1]["full"]["logged"] is None


def test_scheduler_built_after_prepare_on_the_users_optimizer(main_run):
    _, ranks = main_run
    for r in ranks:
        late = r["late_scheduler"]
        assert late["scheduler_bound"] and late["optimizer"] == "ScapeAdamS"
        assert late["lr"] == late["scheduler_lr"] == r["full"]["lr"]  # the schedule reaches the optimizer that trains
        assert torch.equal(late["params"], r["full"]["params"])


def test_save_state_load_state_resumes_bit_for_bit(main_run):
    _, ranks = main_run
    for r in ranks:
        assert torch.equal(r["resumed"]["params"], r["full"]["params"])
        assert torch.equal(r["resumed"]["momentum"], r["full"]["momentum"])
        assert counted(r["resumed"]["stats"]) == counted(r["full"]["stats"])
        assert r["resumed"]["lr"] == r["full"]["lr"]


def test_the_defaults_resume_bit_for_bit(main_run):
    _, ranks = main_run
    for r in ranks:
        runs = r["resume_defaults"]
        assert runs["int4_99"]["wire"] == "int4" and runs["native_90"]["wire"] == "native"
        for name, run in runs.items():
            assert run["steps"] == 30 and run["hook_calls"] > 2 * 30, name  # several buckets
            for p, q in zip(run["full"], run["resumed"]):
                assert torch.equal(p, q), f"{name}: max |diff| {(p - q).abs().max().item():.3g}"
    for name in ranks[0]["resume_defaults"]:
        for p, q in zip(ranks[0]["resume_defaults"][name]["resumed"], ranks[1]["resume_defaults"][name]["resumed"]):
            assert torch.equal(p, q), name  # replicas bit-identical


def test_save_state_load_state_of_a_sharded_optimizer(main_run):
    _, ranks = main_run
    for r in ranks:
        sharded = r["sharded"]
        assert sharded["sharded"] and sharded["saved"] == sharded["shapes"]  # the whole state in optimizer.bin
        assert torch.equal(sharded["params"], r["full"]["params"])  # bit-for-bit the replicated run
        assert sharded["stats"]["shard_bytes"] > 0 and sharded["stats"]["steps"] == r["full"]["stats"]["steps"]


def test_accumulation_under_torch_compile(main_run):
    _, ranks = main_run
    acc = [r["accumulate"] for r in ranks]
    assert acc[0]["model"] == "DistributedDataParallel"  # wrapping an OptimizedModule
    assert acc[0]["stats"]["steps"] == 4  # 8 micro-batches, one synced backward per 2
    assert acc[0]["stats"]["hook_calls"] == 4 * (acc[0]["stats"]["hook_calls"] // 4) > 0
    assert acc[0]["stats"]["bytes_sent"] < acc[0]["stats"]["dense_bytes"]
    assert torch.equal(acc[0]["params"], acc[1]["params"])


def test_accelerate_scape_launch_exports_settings(tmp_path):
    """config file < SCAPE_* env < launch flag (exported) < the script's own argument.

    Also: Accelerate's own flags pass through (``--dynamo_backend eager`` compiles the DDP model,
    whose hook SCAPE still finds), and a NaN on one rank skips the step on every rank.
    """
    env = _env(tmp_path, ACCELERATE_USE_CPU="1", SCAPE_MASK_REFRESH="2")
    _run(_scape_cli() + ["config", "--sparsity", "0.9", "--warmup-steps", "2", "--mask-refresh", "1",
                         "--score", "momentum"], env)
    cmd = _scape_cli() + ["launch", *_launch_args("eager"), "--warmup_steps", "3", str(HERE), "cli", str(tmp_path)]
    proc = _run(cmd, env)
    # the launcher says what it exports and where each setting came from; defaults are not exported
    assert ("SCAPE settings exported to every process: SCAPE_SPARSITY, SCAPE_WARMUP_STEPS, SCAPE_MASK_REFRESH, "
            "SCAPE_SCORE (flag >") in proc.stderr
    said = {line.split("=")[0].strip(): line for line in proc.stderr.splitlines() if line.startswith("  ")}
    assert said["warmup_steps"].endswith("(flag)") and said["mask_refresh"].endswith("(env SCAPE_MASK_REFRESH)")
    assert said["sparsity"].endswith("scape_config.yaml)") and "ramp_steps" not in said  # only what applies (45)
    assert "The others are not exported: the script's own values apply" in proc.stderr
    assert "SCAPE is not active" not in proc.stderr  # the launcher's watch saw ScapeAdamS step
    ranks = _load(tmp_path, "cli")
    settings = ranks[0]["settings"]
    assert settings["sparsity"] == (0.9, "env SCAPE_SPARSITY")  # from the file, exported by the launcher
    assert settings["score"] == ("momentum", "env SCAPE_SCORE")
    assert settings["warmup_steps"] == (3, "env SCAPE_WARMUP_STEPS")  # launch flag beat the file
    assert settings["mask_refresh"] == (2, "env SCAPE_MASK_REFRESH")  # environment beat the file
    assert settings["mask_delay"] == (0, "argument")  # the script's argument beat everything
    assert settings["ramp_steps"] == (150, "default")  # not exported: the script's own default would apply
    assert ranks[0]["env"] == dict(SCAPE_SPARSITY="0.9", SCAPE_WARMUP_STEPS="3", SCAPE_MASK_REFRESH="2",
                                   SCAPE_SCORE="momentum") and ranks[1]["env"] == ranks[0]["env"]
    # the start-of-run line (rank 0): the settings that differ from the defaults, with their sources, and the
    # warning that 8 steps end before the target density (3 dense steps, then the default 150-step ramp)
    line, = ranks[0]["said"]["lines"]
    assert line.startswith("SCAPE: sparsity=0.9 (env SCAPE_SPARSITY), warmup_steps=3 (env SCAPE_WARMUP_STEPS), "
                           "mask_delay=0, mask_refresh=2 (env SCAPE_MASK_REFRESH), score='momentum' (env SCAPE_SCORE) "
                           "(the rest default); steps 0-2 dense (warm-up), sparse from step 3 at density 0.25")
    assert line.endswith("; 8 steps in this run") and ranks[1]["said"]["lines"] == []
    assert [w.split(",")[0] for w in ranks[0]["said"]["warnings"]] == ["SCAPE: this run has 8 optimizer steps"]
    stats = ranks[0]["stats"]
    assert stats["steps"] == 6 and stats["bytes_sent"] < stats["dense_bytes"]
    assert torch.equal(ranks[0]["params"], ranks[1]["params"])
    assert ranks[0]["model"] == "OptimizedModule"  # torch.compile(DDP(model)) by Accelerate
    for r in ranks:
        assert r["nan"]["skipped"] and r["nan"]["lr_held"] and r["nan"]["unchanged"]
        assert r["nan"]["stats"]["skipped_steps"] == 1 and r["nan"]["stats"]["steps"] == 7
        assert not r["after"]["skipped"] and r["after"]["stats"]["steps"] == 8
        assert torch.isfinite(r["after"]["params"]).all() and not torch.equal(r["after"]["params"], r["params"])
    assert torch.equal(ranks[0]["after"]["params"], ranks[1]["after"]["params"])


def test_processes_that_each_train_alone_are_told_why(monkeypatch, capsys):
    """One of WORLD_SIZE=2 launched processes whose Accelerator runs alone (a CPU machine without
    ACCELERATE_USE_CPU=1): the plugin says why at prepare, and the launcher's watch does not advise
    ScapePlugin().prepare, which the script calls. In this process, with Accelerate's state reset."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from accelerate_scape import ScapePlugin, watch

    for name in [k for k in os.environ if k.startswith(("ACCELERATE_", "LOCAL_RANK"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    AcceleratorState._reset_state(reset_partial_state=True)
    try:
        model = nn.Linear(4, 2)
        with pytest.warns(UserWarning, match="SCAPE: inactive: this process is one of WORLD_SIZE=2 launched, but its "
                                             "Accelerator runs alone.*ACCELERATE_USE_CPU=1"):
            model, opt = ScapePlugin().prepare(Accelerator(), model, torch.optim.AdamW(model.parameters()))
        watch._hooks.append(register_optimizer_step_pre_hook(watch.check_first_step))  # as the launcher's watch
        model(torch.ones(1, 4)).sum().backward()
        opt.step()
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
    assert not watch._hooks and watch.NOT_ACTIVE not in capsys.readouterr().err  # it ran, and said nothing


def test_single_process_is_inactive_and_dense(tmp_path):
    proc = _run([sys.executable, str(HERE), "single", str(tmp_path)], _env(tmp_path, ACCELERATE_USE_CPU="1"))
    result = torch.load(tmp_path / "single.pt", weights_only=False)
    assert result["num_processes"] == 1 and not result["active"] and result["stats"] == {}
    assert result["optimizer"] == "AdamS" and result["scheduler_bound"]
    assert "SCAPE: inactive (single process)" in proc.stdout
    assert result["saved"] == {"scape_active": False}


if __name__ == "__main__":  # the launched training script
    torch.set_num_threads(1)
    sys.path.insert(0, str(HERE.parents[1]))  # the repository: `tests` (test_resume's model) imports
    mode, out_dir = sys.argv[1], Path(sys.argv[2])
    {"main": _script_main, "cli": _script_cli, "single": _script_single}[mode](out_dir)
