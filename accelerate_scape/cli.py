"""The ``accelerate-scape`` command: ``config``, ``env`` and ``launch``, shaped like ``accelerate``'s.

    accelerate-scape config                       # prompts, writes scape_config.yaml next to Accelerate's config
    accelerate-scape config --sparsity 0.9 --warmup_steps 100   # no prompts: writes these two
    accelerate-scape env                          # resolved settings and where each came from
    accelerate-scape launch --multi_gpu --num_processes 8 train.py --lr 3e-4   # exports the SCAPE settings set
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Callable

import accelerate
from accelerate.commands.launch import launch_command, launch_command_parser
from accelerate.commands.utils import CustomArgumentParser

from accelerate_scape import settings as S
from scape_core import UPDATE_RULES, ScapeConfig, __version__
from scape_core.config import SCORES

QUESTIONS = {
    "sparsity": "Share of dense fp32 bytes NOT sent on a sparse step, in [0, 1) (0.99 sends about 1 byte in 100)",
    "warmup_steps": "Dense warm-up steps before sparse communication starts",
    "mask_delay": "Mask delay: 1 selects each mask a whole step before its use (off the critical path), "
                  "0 the step before (ablation)",
    "mask_refresh": "Optimizer steps between new masks",
    "error_feedback": "Keep unsent gradient in per-rank error-feedback residuals? (yes/no)",
    "score": f"Mask score, one of {', '.join(SCORES)}",
    "update": "Masked update rule, one of {rules}",
    "ramp_steps": "Steps after the warm-up with denser masks (25%, 6.25%, 1.6% density), 0 for none",
    "chunk_size": "Coordinates per mask row: each row sends the same share, picked by one top-k (16 to 32768)",
    "shard_optimizer": "Shard the optimizer state (ZeRO-1: each rank keeps m, sq and windows of 1/W of the "
                       "coordinates; more bytes per step)? (yes/no)",
    "wire": "How a sparse step's values travel: native (the gradients' dtype), bfloat16, int8 or int4",
    "wire_block": "Values per fp32 scale of an int8/int4 wire",
    "skip_streak_warning": "Warn after this many consecutive steps skipped for non-finite gradients (0: never)",
    "kernels": "The passes over every coordinate: eager (torch operators) or compiled (torch.compile'd fused loops)",
    "selection": "How each row's picks are chosen: topk (its k largest scores) or groups (the largest of each of "
                 "k contiguous groups: a reduction)",
    "replica_check_every": "Optimizer steps between checks that every rank holds the same replicated state "
                           "(0: never)",
    "max_window": "Most steps a coordinate waits between exchanges before it is picked first (0: eight mean windows)",
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``accelerate-scape`` console script."""
    parser = CustomArgumentParser("accelerate-scape", allow_abbrev=False,
                                  description="SCAPE sparse gradient communication for Hugging Face Accelerate. "
                                              "Commands: config, env, launch (see accelerate-scape <command> -h).")
    sub = parser.add_subparsers(help="accelerate-scape command helpers")
    _config_parser(sub)
    _env_parser(sub)
    _launch_parser(sub)
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 1
    return args.func(args) or 0


# ----- config -------------------------------------------------------------------------
def _config_parser(sub: Any) -> None:
    p = sub.add_parser("config", help="Write scape_config.yaml (prompts unless setting flags are given)",
                       description="Write scape_config.yaml next to Accelerate's default_config.yaml. Without "
                                   "setting flags it asks for each setting; with flags it writes them, without "
                                   "prompting. Only the settings given (or answered) are written: the others take, "
                                   "in each run, the script's own defaults, else ScapeConfig's.")
    _add_file_argument(p, f"Where to write (default: {S.default_config_file()}; $SCAPE_CONFIG_FILE overrides)")
    _add_setting_arguments(p)
    p.set_defaults(func=_config_command)


def _config_command(args: argparse.Namespace) -> int:
    given = _given_settings(args)
    try:
        target = Path(args.scape_config_file).expanduser() if args.scape_config_file else S.default_config_file()
        existing = S.load_config_file(target) if target.is_file() else {}  # kept unless given again
        chosen = {**existing, **(given if given else _ask_all(existing))}
        config = ScapeConfig(**chosen)
        path = S.write_config_file(config, target, names=chosen)  # only what was chosen, now or before
    except (TypeError, ValueError, OSError) as e:
        return _fail("config", e)
    kept = [n for n in existing if n not in given]
    if given and kept:
        print(f"kept from the file: {', '.join(f'{n}={existing[n]!r}' for n in kept)} (delete the file to start "
              "over)")
    print(f"SCAPE configuration saved at {path}")
    return 0


def _ask_all(current: dict[str, Any]) -> dict[str, Any]:
    """Each setting asked in turn; the answers given (an empty answer keeps the value shown: the file's
    ``current`` one, else the default, which is not written)."""
    values = {}
    for name, default in S.fields().items():
        question = QUESTIONS.get(name, name).format(rules=", ".join(sorted(UPDATE_RULES)))
        value = current.get(name, default)
        shown = ("yes" if value else "no") if isinstance(value, bool) else value
        while True:
            try:
                raw = input(f"{question} [{shown}]: ").strip()
            except EOFError:
                print()
                raise ValueError("input ended before every question was answered; nothing written") from None
            if not raw:
                break
            try:
                values[name] = S.parse_value(name, raw)
                break
            except ValueError as e:
                print(f"  {e}; try again")
    return values


# ----- env ----------------------------------------------------------------------------
def _env_parser(sub: Any) -> None:
    p = sub.add_parser("env", help="Print the resolved SCAPE settings and where each came from",
                       description="Print the resolved SCAPE settings (SCAPE_* environment > scape_config.yaml "
                                   "> defaults) and where each came from.")
    _add_file_argument(p, "Read this file instead of the default one")
    p.set_defaults(func=_env_command)


def _env_command(args: argparse.Namespace) -> int:
    try:
        resolved = S.resolve_settings(config_file=args.scape_config_file)
    except (ValueError, FileNotFoundError) as e:
        return _fail("env", e)
    accelerate_file = S.accelerate_config_dir() / "default_config.yaml"
    found = {True: "found", False: "not found"}
    print(f"- scape-train version: {__version__}")
    print(f"- Accelerate version: {accelerate.__version__}")
    print(f"- Accelerate config file: {accelerate_file} ({found[accelerate_file.is_file()]})")
    print(f"- SCAPE config file: {resolved.file} ({found[resolved.file_found]})")
    print("- SCAPE settings (precedence: script arguments > SCAPE_* environment > file > default):")
    print(resolved.describe())
    return 0


# ----- launch -------------------------------------------------------------------------
def _launch_parser(sub: Any) -> None:
    p = launch_command_parser(_WithHelp(sub, "Run `accelerate launch` with the SCAPE settings exported as SCAPE_*"))
    p.description = ("Exactly `accelerate launch`, with the SCAPE settings the user set (flags below > SCAPE_* "
                     "environment > scape_config.yaml) exported as SCAPE_* to every process; settings left at their "
                     "default are not exported, so a script's own defaults apply. On a machine without GPUs, "
                     "--multi_gpu --num_processes N sets ACCELERATE_USE_CPU=1 (unless set) so that the N CPU "
                     "processes train together. " + (p.description or ""))
    group = p.add_argument_group("SCAPE arguments", "Override the SCAPE settings for this launch.")
    _add_file_argument(group, "Read this SCAPE config file instead of the default one")
    _add_setting_arguments(group)
    p.set_defaults(func=_launch_command)


def _launch_command(args: argparse.Namespace) -> int:
    given = _given_settings(args)
    file = args.scape_config_file
    for name in [*S.fields(), "scape_config_file", "func"]:
        delattr(args, name)  # what remains is exactly `accelerate launch`'s namespace
    try:
        resolved = S.resolve_settings(given, config_file=file, overrides_source="flag")
    except (ValueError, FileNotFoundError) as e:
        return _fail("launch", e)
    # only what the user set: a default left unexported lets the script's own defaults apply
    exported = S.to_environ(resolved.config, resolved.chosen)
    os.environ.update(exported)
    if file is not None:
        os.environ[S.CONFIG_FILE_ENV] = str(resolved.file)
    chosen = "\n".join(line for name, line in zip(resolved.sources, resolved.describe().splitlines())
                        if name in resolved.chosen)
    print(f"accelerate-scape: SCAPE settings exported to every process: {', '.join(exported) or 'none'} (flag > "
          "SCAPE_* environment > scape_config.yaml)" + (f":\n{chosen}" if chosen else "") + "\nThe others are not "
          "exported: the script's own values apply, else ScapeConfig's defaults.", file=sys.stderr)
    note = _cpu_processes(args)
    if note:
        print(f"accelerate-scape: {note}", file=sys.stderr)
    if _runs_python(args):  # each process runs the script under accelerate_scape.watch: it says if SCAPE is off
        module = ["-m"] if args.module else []
        args.training_script_args = [*module, args.training_script, *args.training_script_args]
        args.training_script, args.module = "accelerate_scape.watch", True
    launch_command(args)
    return 0


def _cpu_processes(args: argparse.Namespace) -> str | None:
    """On a machine without GPUs, what it takes for ``--num_processes N > 1`` to start N processes that
    train together; sets ``ACCELERATE_USE_CPU=1`` for a multi-process launch where it is not set (as
    torchrun sets OMP_NUM_THREADS: a default, said). Returns what to tell the user, or ``None``."""
    defaults = _accelerate_defaults(args)
    n = args.num_processes if args.num_processes is not None else getattr(defaults, "num_processes", None)
    if not n or n <= 1 or _has_device():
        return None
    from accelerate.utils import DistributedType

    kind = getattr(defaults, "distributed_type", None)
    if kind == DistributedType.MULTI_CPU or getattr(args, "mpirun_hostfile", None):
        return None  # Accelerate's own multi-CPU launch (mpirun), configured by the user
    if args.cpu or not (args.multi_gpu or kind == DistributedType.MULTI_GPU):
        return (f"Accelerate starts one process here for --num_processes {n} (no --multi_gpu, or --cpu): for {n} "
                f"CPU processes, launch with --multi_gpu --num_processes {n}")
    if os.environ.get("ACCELERATE_USE_CPU", "") != "":
        return None  # the user's choice
    os.environ["ACCELERATE_USE_CPU"] = "1"
    return (f"no GPU on this machine: ACCELERATE_USE_CPU=1 is set for this launch, so the {n} processes train "
            "together on the CPU (gloo); without it each would train alone. Set ACCELERATE_USE_CPU yourself "
            "to decide otherwise")


def _has_device() -> bool:
    """Whether Accelerate finds an accelerator for its processes (CUDA or another it supports)."""
    import torch
    from accelerate import utils

    if torch.cuda.is_available():
        return True
    names = ("is_xpu_available", "is_npu_available", "is_mlu_available", "is_musa_available", "is_hpu_available",
             "is_sdaa_available", "is_neuron_available", "is_torch_xla_available")
    return any(check() for check in (getattr(utils, name, None) for name in names) if check is not None)


def _accelerate_defaults(args: argparse.Namespace) -> Any:
    """Accelerate's config file as `accelerate launch` reads it (``None`` where there is none)."""
    from accelerate.commands.config import default_config_file, load_config_from_file

    if args.config_file is None and not os.path.isfile(default_config_file):
        return None
    return load_config_from_file(args.config_file)


def _runs_python(args: argparse.Namespace) -> bool:
    """Whether the launcher starts ``python [-m] SCRIPT`` (not an executable, a TPU or SageMaker job)."""
    if args.no_python or args.tpu:
        return False
    from accelerate.utils import ComputeEnvironment, DistributedType

    config = _accelerate_defaults(args)
    if config is None:
        return True
    return (config.compute_environment != ComputeEnvironment.AMAZON_SAGEMAKER
            and config.distributed_type != DistributedType.XLA)


class _WithHelp:
    """Accelerate's ``launch_command_parser`` adds its parser without a help line; this gives it one."""

    def __init__(self, sub: Any, help: str) -> None:
        self.sub, self.help = sub, help

    def add_parser(self, name: str, **kwargs: Any) -> argparse.ArgumentParser:
        return self.sub.add_parser(name, help=self.help, **kwargs)


# ----- shared -------------------------------------------------------------------------
def _fail(command: str, error: Exception) -> int:
    """Bad settings: one clear line, no traceback."""
    print(f"accelerate-scape {command}: error: {error}", file=sys.stderr)
    return 2


def _add_file_argument(p: Any, help: str) -> None:
    p.add_argument("--scape_config_file", default=None, metavar="PATH", help=help)


def _add_setting_arguments(p: Any) -> None:
    for name, default in S.fields().items():
        kind = "yes/no" if isinstance(default, bool) else type(default).__name__
        help = QUESTIONS.get(name, name).format(rules=", ".join(sorted(UPDATE_RULES)))
        p.add_argument(f"--{name}", default=None, type=_converter(name), metavar=kind.upper(),
                       help=f"{help} (default {default!r})".replace("%", "%%"))  # argparse formats help with %


def _converter(name: str) -> Callable[[str], Any]:
    def convert(raw: str) -> Any:
        try:
            return S.parse_value(name, raw)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = name  # argparse names the converter in its messages
    return convert


def _given_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {n: getattr(args, n) for n in S.fields() if getattr(args, n) is not None}


if __name__ == "__main__":
    sys.exit(main())
