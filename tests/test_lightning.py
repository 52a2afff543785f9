"""lightning_scape with lightning.Trainer and Fabric: 2 gloo processes on CPU (tests/dist.py sets the environment,
so Lightning finds its ranks already launched and its process group already initialized)."""

from __future__ import annotations

import traceback
import warnings
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F
from lightning.fabric.plugins import MixedPrecision as FabricMixedPrecision
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import Logger
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning_scape
from lightning_scape import ScapeFabricStrategy, ScapeStrategy
from scape_core import AdamS
from tests.dist import failure, run_distributed, said
from tests.test_resume import CONFIGS as RESUME_CONFIGS
from tests.test_resume import SCHEDULE as RESUME_SCHEDULE
from tests.test_resume import TinyTransformer

SAMPLES = 64  # 8 batches of 4 per rank per epoch


class Recorder(Logger):
    """Keeps what the Trainer logs (rank 0 only, as every logger)."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "recorder"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append(dict(metrics))


class Regression(L.LightningModule):
    """Tiny MLP; ``optimizer`` picks what configure_optimizers returns."""

    def __init__(self, optimizer: str = "adamw", scheduler: bool = True, loss_scale: float = 1.0) -> None:
        super().__init__()
        self.automatic_optimization = optimizer != "two"  # Lightning itself refuses 2 optimizers otherwise
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
        self.optimizer, self.scheduler, self.loss_scale = optimizer, scheduler, loss_scale
        self.autocast_dtypes: set[torch.dtype] = set()
        self.grad_norms: list[tuple[float, float]] = []  # (before, after) clipping

    def training_step(self, batch, batch_idx):
        x, y = batch
        out = self.net(x)
        self.autocast_dtypes.add(out.dtype)
        return F.mse_loss(out.float(), y) * self.loss_scale

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        before = grad_norm(self)
        self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
        self.grad_norms.append((before, grad_norm(self)))

    def configure_optimizers(self):
        weights = [p for n, p in self.named_parameters() if n.endswith("weight")]
        biases = [p for n, p in self.named_parameters() if n.endswith("bias")]
        groups = [{"params": weights, "weight_decay": 0.1}, {"params": biases, "weight_decay": 0.0}]
        hp = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-7)
        if self.optimizer == "adamw":
            opt = torch.optim.AdamW(groups, **hp)
        elif self.optimizer == "adam":
            opt = torch.optim.Adam(self.parameters(), **hp)
        elif self.optimizer == "adams":
            opt = AdamS(groups, **hp)
        elif self.optimizer == "sgd":
            opt = torch.optim.SGD(self.parameters(), lr=1e-2)
        elif self.optimizer == "two":
            return torch.optim.AdamW(weights, lr=1e-2), torch.optim.AdamW(biases, lr=1e-2)
        if not self.scheduler:
            return opt
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.9 ** step)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def grad_norm(module: nn.Module) -> float:
    return torch.cat([p.grad.flatten() for p in module.parameters() if p.grad is not None]).norm().item()


def loader(batch_size: int = 4) -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, 8, generator=g)
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True).sin()), batch_size=batch_size)


def trainer(strategy, tmp: str, **kwargs) -> L.Trainer:
    defaults = dict(accelerator="cpu", devices=2, max_epochs=1, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, enable_checkpointing=False, num_sanity_val_steps=0,
                    default_root_dir=tmp)
    return L.Trainer(strategy=strategy, **{**defaults, **kwargs})


def sparse(**kwargs) -> ScapeStrategy:
    return ScapeStrategy(sparsity=0.9, warmup_steps=2, **kwargs)


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# ----------------------------------------------------------------------------------------
def _registered_name_part(rank, tmp):
    """strategy="scape" with its defaults (50 dense warm-up steps, 99% sparsity): 60 steps."""
    model = Regression(scheduler=False)
    t = trainer("scape", tmp, max_steps=60, max_epochs=-1)
    with said() as heard:
        t.fit(model, loader(batch_size=1))
    return dict(strategy=type(t.strategy).__name__, stats=t.strategy.scape_state.stats(),
                global_step=t.global_step, params=params(model),
                closing=[line for line in heard.lines if "sent instead of" in line])


def test_registered_name_runs_the_hook_and_sends_fewer_bytes(ranks):
    results = part(ranks, "registered_name")
    for r in results:
        s = r["stats"]
        assert r["strategy"] == "ScapeStrategy"
        assert r["global_step"] == s["steps"] == 60
        assert s["hook_calls"] >= 60  # at least one bucket per synced backward
        assert s["bytes_sent"] < s["dense_bytes"] and s["compression"] > 1.1  # 10 sparse steps of 60
        # the warm-up's steps are timed; the 10 sparse steps are the ramp's, which are not
        assert s["step_seconds_dense"] > 0 and s["step_seconds_sparse"] == 0
    # the end of fit: one line on rank 0, the dense time and why no sparse step was timed
    assert len(results[0]["closing"]) == 1 and results[0]["closing"][0].startswith("SCAPE: dense warm-up steps ")
    assert "no sparse step at the target density was timed (it starts at step 100" in results[0]["closing"][0]
    assert results[1]["closing"] == []
    for p, q in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(p, q)


# ----------------------------------------------------------------------------------------
def _train_part(rank, tmp):
    model, recorder = Regression(), Recorder()
    t = trainer(sparse(), tmp, max_epochs=2, logger=recorder, log_every_n_steps=1)
    t.fit(model, loader())
    opt, scheduler = t.optimizers[0], t.lr_scheduler_configs[0].scheduler
    return dict(
        stats=t.strategy.scape_state.stats(), global_step=t.global_step, params=params(model),
        optimizer=type(opt).__name__, scheduler_bound=scheduler.optimizer is opt,
        groups=[{k: g[k] for k in ("lr", "initial_lr", "betas", "eps", "weight_decay")} for g in opt.param_groups],
        residual=sum(r.abs().sum().item() for r in t.strategy.scape_state.residuals.values()),
        logged=recorder.metrics, progress_bar=dict(t.progress_bar_metrics),
    )


def test_trainer_hook_runs_and_parameters_match_across_ranks(ranks):
    trained = part(ranks, "train")
    for r in trained:
        s = r["stats"]
        assert r["global_step"] == s["steps"] == 16
        assert s["hook_calls"] >= 16 and s["bytes_sent"] < s["dense_bytes"]
        assert r["residual"] > 0  # sparse steps left gradient behind in the residuals
    for p, q in zip(trained[0]["params"], trained[1]["params"]):
        assert torch.equal(p, q)


def test_optimizer_converted_with_groups_and_scheduler_still_decays(ranks):
    trained = part(ranks, "train")
    r = trained[0]
    assert r["optimizer"] == "ScapeAdamS" and r["scheduler_bound"]
    assert [g["weight_decay"] for g in r["groups"]] == [0.1, 0.0]
    for g in r["groups"]:
        assert g["betas"] == (0.9, 0.95) and g["eps"] == 1e-7 and g["initial_lr"] == 1e-2
        assert g["lr"] == pytest.approx(1e-2 * 0.9 ** 16)


def test_metrics_reach_loggers_and_progress_bar(ranks):
    trained = part(ranks, "train")
    names = {f"scape/{k}" for k in ("bytes_sent", "dense_bytes", "compression", "step_compression", "skipped_steps")}
    r = trained[0]
    # the bar shows text (compression as 2.1x, bytes in MB); the loggers keep the raw numbers
    assert r["progress_bar"]["scape/compression"] == f"{r['stats']['compression']:.1f}x"
    assert r["progress_bar"]["scape/sent"] == f"{r['stats']['bytes_sent'] / 1e6:,.1f} MB"
    assert names & set(r["progress_bar"]) == {"scape/compression"}  # the raw counters stay off the bar
    assert len([m for m in r["logged"] if names <= set(m)]) == 16
    last = [m for m in r["logged"] if names <= set(m)][-1]
    assert last["scape/bytes_sent"] == r["stats"]["bytes_sent"]
    assert last["scape/compression"] == pytest.approx(r["stats"]["compression"])
    assert last["scape/skipped_steps"] == 0
    # the last step's own compression (a ramp step at density 0.25: 3.9x) beside the run's (2 dense steps in it: 2.9x)
    first = [m for m in r["logged"] if names <= set(m)][0]
    assert first["scape/step_compression"] == 1.0 and last["scape/step_compression"] > 1.3 * last["scape/compression"]


# ----------------------------------------------------------------------------------------
def _resume_part(rank, tmp, **scape):
    full = Regression()
    trainer(sparse(**scape), tmp, max_epochs=2).fit(full, loader())

    ckpt = ModelCheckpoint(dirpath=tmp, filename="epoch1")
    trainer(sparse(**scape), tmp, max_epochs=1, enable_checkpointing=True, callbacks=[ckpt]).fit(Regression(), loader())
    path = str(Path(tmp) / "epoch1.ckpt")
    saved_ckpt = torch.load(path, weights_only=True)
    saved = saved_ckpt["scape"]

    resumed = Regression()
    t = trainer(sparse(**scape), tmp, max_epochs=2)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Be aware that when using `ckpt_path`")  # no ModelCheckpoint needed here
        t.fit(resumed, loader(), ckpt_path=path)
    momenta = [s["exp_avg"].shape for s in saved_ckpt["optimizer_states"][0]["state"].values()]
    return dict(full=params(full), resumed=params(resumed), saved_step=saved["step"],
                saved_ranks=len(saved["residuals"]), saved_masks=sorted(saved["masks"]),
                saved_residual=sum(r.abs().sum().item() for d in saved["residuals"] for r in d.values()),
                steps=t.strategy.scape_state.stats()["steps"], saved_momenta=momenta,
                sharded=t.strategy.scape_state.sharded)


@pytest.mark.parametrize("name", ["resume", "resume_sharded"])
def test_resume_from_checkpoint_continues_bit_for_bit(ranks, name):
    results = part(ranks, name)
    for r in results:
        assert r["sharded"] == name.endswith("sharded")
        assert r["saved_step"] == 8 and r["saved_ranks"] == 2 and r["saved_residual"] > 0
        assert r["saved_masks"] == [8, 9]  # the masks already chosen for the next two steps
        assert r["steps"] == 16  # the resumed counters continue
        # the optimizer's whole state, also when each rank keeps half of it (consolidated on rank 0)
        assert sorted(r["saved_momenta"]) == sorted(p.shape for p in r["full"])
        for p, q in zip(r["full"], r["resumed"]):
            assert torch.equal(p, q)
    for p, q in zip(results[0]["full"], part(ranks, "resume")[0]["full"]):  # sharded or not: the same run
        assert torch.equal(p, q)


# ----------------------------------------------------------------------------------------
def _variants_part(rank, tmp):
    out = {}
    # accumulation (Lightning's no_sync) and clipping, from a plain AdamS
    model = Regression(optimizer="adams", loss_scale=100.0)
    t = trainer(sparse(), tmp, max_epochs=2, accumulate_grad_batches=2, gradient_clip_val=0.05)
    t.fit(model, loader())
    out["accumulate"] = dict(stats=t.strategy.scape_state.stats(), global_step=t.global_step,
                             optimizer=type(t.optimizers[0]).__name__, params=params(model),
                             grad_norms=model.grad_norms)
    # dense SCAPE: accumulating 2 x 4 samples matches one batch of 8
    for name, batch, accumulate in (("acc2x4", 4, 2), ("batch8", 8, 1)):
        model = Regression()
        trainer(ScapeStrategy(sparsity=0.0), tmp, accumulate_grad_batches=accumulate).fit(model, loader(batch))
        out[name] = params(model)
    # bf16-mixed, from torch.optim.Adam
    model = Regression(optimizer="adam")
    t = trainer(sparse(), tmp, precision="bf16-mixed")
    t.fit(model, loader())
    out["bf16"] = dict(stats=t.strategy.scape_state.stats(), optimizer=type(t.optimizers[0]).__name__,
                       params=params(model), dtypes=model.autocast_dtypes)
    model = Regression()
    t = trainer(sparse(), tmp, precision="bf16-true")
    t.fit(model, loader())
    out["bf16_true"] = dict(stats=t.strategy.scape_state.stats(), params=params(model))
    # refused at setup, with the message saying what to do
    out["sgd"] = failure(lambda: trainer(sparse(), tmp).fit(Regression(optimizer="sgd"), loader()))
    out["two"] = failure(lambda: trainer(sparse(), tmp).fit(Regression(optimizer="two"), loader()))
    fp16 = MixedPrecision("16-mixed", "cpu")  # Trainer(precision="16-mixed") on CPU would become bf16
    out["fp16"] = failure(lambda: trainer(sparse(), tmp, plugins=[fp16]).fit(Regression(), loader()))
    return out


def test_gradient_accumulation_and_clipping(ranks):
    variants = part(ranks, "variants")
    for r in variants:
        a = r["accumulate"]
        assert a["optimizer"] == "ScapeAdamS"
        assert a["global_step"] == a["stats"]["steps"] == 8  # 16 batches, 2 per step
        assert a["stats"]["bytes_sent"] < a["stats"]["dense_bytes"]
        assert len(a["grad_norms"]) == 8
        assert all(after <= 0.05 * (1 + 1e-4) for _, after in a["grad_norms"])
        assert any(before > 0.1 for before, _ in a["grad_norms"])  # clipping really acted
    for p, q in zip(variants[0]["accumulate"]["params"], variants[1]["accumulate"]["params"]):
        assert torch.equal(p, q)
    for p, q in zip(variants[0]["acc2x4"], variants[0]["batch8"]):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_bf16_mixed_and_bf16_true(ranks):
    variants = part(ranks, "variants")
    for r in variants:
        b = r["bf16"]
        assert b["optimizer"] == "ScapeAdamS" and torch.bfloat16 in b["dtypes"]  # autocast was on
        assert all(p.dtype == torch.bfloat16 for p in r["bf16_true"]["params"])
        for run in (b, r["bf16_true"]):
            assert run["stats"]["steps"] == 8 and run["stats"]["bytes_sent"] < run["stats"]["dense_bytes"]
            assert all(torch.isfinite(p).all() for p in run["params"])
    for run in ("bf16", "bf16_true"):
        for p, q in zip(variants[0][run]["params"], variants[1][run]["params"]):
            assert torch.equal(p, q)


def test_unsupported_optimizers_are_refused(ranks):
    variants = part(ranks, "variants")
    for r in variants:
        assert r["sgd"].startswith("TypeError") and "got optimizer SGD" in r["sgd"]
        assert "torch.optim.AdamW, torch.optim.Adam, scape_core.AdamS" in r["sgd"]
        assert r["two"].startswith("ValueError") and "exactly one optimizer, got 2" in r["two"]


def test_16_mixed_is_refused(ranks):
    variants = part(ranks, "variants")
    for r in variants:
        assert r["fp16"].startswith("ValueError") and "precision='16-mixed'" in r["fp16"]
        assert "bf16-mixed" in r["fp16"]


# ----------------------------------------------------------------------------------------
def _fabric_part(rank, tmp, sharded=False):
    path = str(Path(tmp) / "fabric.ckpt")

    def launch(**kwargs):
        fabric = L.Fabric(accelerator="cpu", devices=2, **kwargs)
        fabric.launch()
        return fabric

    def setup():
        fabric = launch(strategy=ScapeFabricStrategy(sparsity=0.9, warmup_steps=2, shard_optimizer=sharded))
        net = Regression().net
        opt = torch.optim.AdamW(net.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.9 ** step)
        return (fabric, *fabric.setup(net, opt, scheduler=scheduler))

    def train(fabric, model, opt, scheduler, steps):
        for step in steps:
            for micro in range(2):  # accumulate: only the last micro-batch synchronizes
                g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
                x = torch.randn(4, 8, generator=g)
                with fabric.no_backward_sync(model, enabled=micro == 0):
                    fabric.backward(F.mse_loss(model(x), x.sum(1, keepdim=True).sin()) / 2)
            opt.step()
            opt.zero_grad()
            scheduler.step()

    fabric, model, opt, scheduler = setup()
    out = dict(optimizer=type(opt.optimizer).__name__, scheduler_bound=scheduler.optimizer is opt.optimizer)
    train(fabric, model, opt, scheduler, range(4))
    fabric.save(path, {"model": model, "optimizer": opt, "scheduler": scheduler, "step": 4})
    train(fabric, model, opt, scheduler, range(4, 8))
    out.update(full=params(model), stats=fabric.strategy.scape_state.stats(), lr=opt.param_groups[0]["lr"])

    fabric, model, opt, scheduler = setup()
    remainder = fabric.load(path, {"model": model, "optimizer": opt, "scheduler": scheduler})
    out.update(remainder=remainder, loaded_step=fabric.strategy.scape_state.step)
    train(fabric, model, opt, scheduler, range(4, 8))
    out["resumed"] = params(model)
    if sharded:
        out["saved_momenta"] = [s["exp_avg"].shape for s in torch.load(path)["optimizer"]["state"].values()]
        return out

    out["second_model"] = failure(lambda: fabric.setup(Regression().net))
    # the scheduler is built on the user's optimizer and not given to setup: it still drives training
    fabric = launch(strategy=ScapeFabricStrategy(sparsity=0.9, warmup_steps=2, max_steps=3))
    net = Regression().net
    mine = torch.optim.AdamW(net.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(mine, step_size=1, gamma=0.5)
    with said() as heard:  # the start-of-run line, at setup, with the run's length Fabric was told
        model, opt = fabric.setup(net, mine)
    out["said"] = dict(lines=heard.lines, warnings=[w for w in heard.warnings if w.startswith("SCAPE")])
    train(fabric, model, opt, scheduler, range(3))
    out["unpassed_scheduler"] = dict(lr=opt.param_groups[0]["lr"], scheduled=scheduler.get_last_lr()[0],
                                     same=opt.optimizer is mine, kind=type(mine).__name__)
    net = Regression().net
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    out["sgd"] = failure(lambda: launch(strategy="scape").setup(net, sgd))
    # a plugin: Fabric(precision="16-mixed") on CPU would become bf16
    fp16 = launch(strategy="scape", plugins=FabricMixedPrecision("16-mixed", "cpu"))
    out["fp16"] = failure(lambda: fp16.setup(Regression().net))
    return out


def test_fabric_setup_accumulation_save_load(ranks):
    results = part(ranks, "fabric")
    for rank, r in enumerate(results):
        assert r["said"]["lines"] == (["SCAPE: sparsity=0.9, warmup_steps=2 (the rest default); steps 0-1 dense "
                                       "(warm-up), sparse "
                                       "from step 2 at density 0.25, at the target density 0.1 (native wire, 10% of "
                                       "dense bytes) from step 52; 3 steps in this run"] if rank == 0 else [])
        assert [w.split(",")[0] for w in r["said"]["warnings"]] == (
            ["SCAPE: this run has 3 optimizer steps"] if rank == 0 else [])
        assert r["optimizer"] == "ScapeAdamS" and r["scheduler_bound"]
        assert r["stats"]["steps"] == 8 and r["stats"]["hook_calls"] >= 8
        assert r["stats"]["bytes_sent"] < r["stats"]["dense_bytes"]
        assert r["lr"] == pytest.approx(1e-2 * 0.9 ** 8)
        assert r["remainder"] == {"step": 4} and r["loaded_step"] == 4
        for p, q in zip(r["full"], r["resumed"]):
            assert torch.equal(p, q)
        assert r["sgd"].startswith("TypeError") and "got optimizer SGD" in r["sgd"]
        assert r["second_model"].startswith("RuntimeError") and "one model per Fabric" in r["second_model"]
        assert r["fp16"].startswith("ValueError") and "precision='16-mixed'" in r["fp16"]
        unpassed = r["unpassed_scheduler"]
        assert unpassed["same"] and unpassed["kind"] == "ScapeAdamS"
        assert unpassed["lr"] == unpassed["scheduled"] == pytest.approx(1e-2 * 0.5 ** 3)
    for p, q in zip(results[0]["full"], results[1]["full"]):
        assert torch.equal(p, q)


def test_fabric_save_load_of_a_sharded_optimizer(ranks):
    replicated = part(ranks, "fabric")
    for rank, r in enumerate(part(ranks, "fabric_sharded")):
        assert r["remainder"] == {"step": 4} and r["loaded_step"] == 4
        assert r["saved_momenta"] == [p.shape for p in r["full"]]  # the whole state, consolidated on rank 0
        for p, q, o in zip(r["full"], r["resumed"], replicated[rank]["full"]):
            assert torch.equal(p, q) and torch.equal(p, o)


# ----------------------------------------------------------------------------------------
class HalfUsed(Regression):
    """A layer the training step never uses, and no find_unused_parameters."""

    def __init__(self) -> None:
        super().__init__(scheduler=False)
        self.unused = nn.Linear(8, 1)


def _misuse_part(rank, tmp):
    out = {}
    out["unused_layer"] = failure(lambda: trainer(sparse(), tmp, max_steps=2).fit(HalfUsed(), loader()))
    # a run that ends inside the warm-up: said at setup, on rank 0, with the start-of-run line
    t = trainer(ScapeStrategy(sparsity=0.99, ramp_steps=1000), tmp, max_steps=8, max_epochs=-1)
    with said() as heard:
        t.fit(Regression(), loader())
    out["short_run"] = [w for w in heard.warnings if "SCAPE: this run" in w]
    out["start_line"] = heard.lines
    # its checkpoint resumed with the stock DDP strategy
    path = str(Path(tmp) / "scape.ckpt")
    t.save_checkpoint(path)
    stock = trainer("ddp", tmp, max_steps=10, max_epochs=-1)
    out["stock_resume"] = failure(lambda: stock.fit(Regression(), loader(), ckpt_path=path))
    return out


def test_misuse_in_lightning_is_named(ranks):
    results = part(ranks, "misuse")
    for rank, r in enumerate(results):
        assert "parameter(s) ['unused.weight', 'unused.bias'] received no gradient" in r["unused_layer"]
        assert "find_unused_parameters=True" in r["unused_layer"]
        assert r["short_run"] == ([
            "SCAPE: this run has 8 optimizer steps, but its dense warm-up lasts warmup_steps=50: every step is dense, "
            "no communication is saved. Lower warmup_steps / ramp_steps (or train longer) to train at the sparsity "
            "you set."] if rank == 0 else [])
        assert r["start_line"][:1] == ([
            "SCAPE: ramp_steps=1000 (the rest default); steps 0-49 dense (warm-up), sparse from step "
            "50 at density 0.25, at the target density 0.0753 (int4 wire, 1% of dense bytes) from step 384; 8 steps "
            "in this run"] if rank == 0 else [])
        # and at the end of fit, the closing line: dense steps timed, no sparse step at the target density
        assert [line.startswith("SCAPE: dense warm-up steps ") for line in r["start_line"][1:]] == (
            [True] if rank == 0 else [])
        assert r["stock_resume"].startswith("RuntimeError: this AdamW was loaded with optimizer state saved by "
                                            "SCAPE's AdamS")
        assert "the checkpoint is a SCAPE checkpoint" in r["stock_resume"]


# ----------------------------------------------------------------------------------------
class Tokens(L.LightningModule):
    """test_resume's tiny transformer (DDP rebuilds its buckets into other groups) as a LightningModule."""

    def __init__(self) -> None:
        super().__init__()
        self.net = TinyTransformer()

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self.net(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)


def token_loader() -> DataLoader:  # 8 batches of 4 per rank per epoch
    tokens = torch.randint(0, 64, (SAMPLES, 13), generator=torch.Generator().manual_seed(2))
    return DataLoader(TensorDataset(tokens), batch_size=4)


def _resume_defaults_part(rank, tmp):
    """The defaults at 99% (int4) and 90% (native): a Trainer checkpoint at an epoch's end and a Fabric
    save resume bit-for-bit in a new Trainer / Fabric, whose new DDP rebuilds its buckets."""
    out = {}
    for name, config in RESUME_CONFIGS.items():
        def strategy():  # small buckets: several, which DDP regroups after a process's first iteration
            return ScapeStrategy(**config, **RESUME_SCHEDULE, bucket_cap_mb=0.02)

        full = Tokens()
        trainer(strategy(), tmp, max_epochs=4).fit(full, token_loader())
        first = trainer(strategy(), tmp, max_epochs=2)
        first.fit(Tokens(), token_loader())
        path = str(Path(tmp) / f"{name}.ckpt")
        first.save_checkpoint(path)
        resumed = Tokens()
        t = trainer(strategy(), tmp, max_epochs=4)
        t.fit(resumed, token_loader(), ckpt_path=path)
        out[f"trainer_{name}"] = dict(full=params(full), resumed=params(resumed),
                                      wire=t.strategy.scape_config.resolved_wire, steps=t.strategy.scape_state.step,
                                      hook_calls=t.strategy.scape_state.comm.counters["hook_calls"])

        def fabric_setup():
            fabric = L.Fabric(accelerator="cpu", devices=2,
                              strategy=ScapeFabricStrategy(**config, **RESUME_SCHEDULE, bucket_cap_mb=0.02))
            fabric.launch()
            net = TinyTransformer()
            opt = torch.optim.AdamW(net.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
            return (fabric, *fabric.setup(net, opt))

        def fabric_train(model, opt, steps):
            for step in steps:
                tokens = torch.randint(0, 64, (4, 13), generator=torch.Generator().manual_seed(100 * step + rank))
                logits = model(tokens[:, :-1])
                fabric.backward(F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()))
                opt.step()
                opt.zero_grad()

        fabric, model, opt = fabric_setup()
        fabric_train(model, opt, range(16))
        fabric.save(str(Path(tmp) / f"{name}.fabric"), {"model": model, "optimizer": opt})
        fabric_train(model, opt, range(16, 30))
        full_params = params(model)
        fabric, model, opt = fabric_setup()
        fabric.load(str(Path(tmp) / f"{name}.fabric"), {"model": model, "optimizer": opt})
        fabric_train(model, opt, range(16, 30))
        out[f"fabric_{name}"] = dict(full=full_params, resumed=params(model), steps=fabric.strategy.scape_state.step,
                                     hook_calls=fabric.strategy.scape_state.comm.counters["hook_calls"])
    return out


def test_defaults_resume_bit_for_bit_through_the_trainer_and_fabric(ranks):
    results = part(ranks, "resume_defaults")
    for r in results:
        assert r["trainer_int4_99"]["wire"] == "int4" and r["trainer_native_90"]["wire"] == "native"
        for key, run in r.items():
            assert run["steps"] in (30, 32) and run["hook_calls"] > 2 * run["steps"], key  # several buckets
            for p, q in zip(run["full"], run["resumed"]):
                assert torch.equal(p, q), f"{key}: max |diff| {(p - q).abs().max().item():.3g}"
    for key in results[0]:
        for p, q in zip(results[0][key]["resumed"], results[1][key]["resumed"]):
            assert torch.equal(p, q), key  # replicas bit-identical


# ----------------------------------------------------------------------------------------
PARTS = {"registered_name": _registered_name_part, "train": _train_part, "resume": _resume_part,
         "resume_sharded": lambda rank, tmp: _resume_part(rank, tmp, shard_optimizer=True),
         "variants": _variants_part, "fabric": _fabric_part,
         "fabric_sharded": lambda rank, tmp: _fabric_part(rank, tmp, sharded=True), "misuse": _misuse_part,
         "resume_defaults": _resume_defaults_part}


def _all_parts(rank, world, tmp):
    """Every distributed check in one launch: starting 2 processes that import Lightning costs most."""
    out = {}
    for name, fn in PARTS.items():
        path = Path(tmp) / name
        path.mkdir(exist_ok=True)
        try:
            out[name] = fn(rank, str(path))
        except Exception:  # noqa: BLE001 - reported by the tests of that part
            out[name] = {"error": traceback.format_exc()}
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_distributed(_all_parts, str(tmp_path_factory.mktemp("lightning")), timeout=600)


def part(ranks: list[dict], name: str) -> list[dict]:
    for rank, r in enumerate(ranks):
        if "error" in r[name]:
            pytest.fail(f"rank {rank} failed in {name!r}:\n{r[name]['error']}")
    return [r[name] for r in ranks]


# ----------------------------------------------------------------------------------------
def test_registration_and_arguments():
    import lightning_fabric
    import pytorch_lightning

    kw = dict(accelerator="cpu", devices=2, logger=False)
    assert type(L.Trainer(strategy="scape", **kw).strategy) is ScapeStrategy
    assert L.Trainer(strategy="scape_spawn", **kw).strategy._start_method == "spawn"
    for strategy in (L.Trainer(strategy="scape_sharded", **kw).strategy, L.Fabric(strategy="scape_sharded").strategy,
                     pytorch_lightning.Trainer(strategy="scape_sharded", **kw).strategy):
        assert strategy.scape_config.shard_optimizer and strategy._start_method == "popen"
    assert not L.Trainer(strategy="scape", **kw).strategy.scape_config.shard_optimizer
    assert type(L.Fabric(strategy="scape", accelerator="cpu", devices=2).strategy) is ScapeFabricStrategy
    assert type(pytorch_lightning.Trainer(strategy="scape", **kw).strategy) is lightning_scape.standalone.ScapeStrategy
    fabric = lightning_fabric.Fabric(strategy="scape", accelerator="cpu", devices=2)
    assert type(fabric.strategy) is lightning_scape.standalone.ScapeFabricStrategy

    s = ScapeStrategy(sparsity=0.9, warmup_steps=7, find_unused_parameters=True, start_method="spawn")
    assert (s.scape_config.sparsity, s.scape_config.warmup_steps) == (0.9, 7)
    # SCAPE's default gradient_as_bucket_view=True (its optimizer works through the buckets), the user's overrides it
    assert s._ddp_kwargs == {"find_unused_parameters": True, "gradient_as_bucket_view": True}
    assert s._start_method == "spawn"
    assert ScapeStrategy(gradient_as_bucket_view=False)._ddp_kwargs == {"gradient_as_bucket_view": False}
    with pytest.raises(TypeError, match="unknown argument.*sparsty"):
        ScapeStrategy(sparsty=0.9)
    with pytest.raises(TypeError, match="ddp_comm_hook is not supported"):
        ScapeStrategy(ddp_comm_hook=lambda state, bucket: None)
    with pytest.raises(ValueError, match="sparsity must be in"):
        ScapeStrategy(sparsity=1.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lightning_scape.strategy.register()  # re-registering (e.g. a reload) is not an error
