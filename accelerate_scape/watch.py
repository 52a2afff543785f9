"""What ``accelerate-scape launch`` runs in every process: the user's script, watched for SCAPE.

The launcher exports ``SCAPE_*`` settings, but only code that uses SCAPE reads them: a script
that calls ``accelerator.prepare`` (or builds a plain ``transformers.Trainer``) trains stock
DDP. So the launcher starts ``python -m accelerate_scape.watch [-m] SCRIPT ARGS...``, which
runs the script as ``python [-m] SCRIPT ARGS...`` would, after registering a global optimizer
step pre-hook: at the first optimizer step of the process it checks that the optimizer is
SCAPE's, says so on rank 0 if not (advising ``ScapePlugin().prepare`` only where no plugin
prepared the optimizer), and removes itself (no cost at later steps).

Example:
    python -m accelerate_scape.watch train.py --lr 3e-4        # what each launched process runs
"""

from __future__ import annotations

import os
import runpy
import sys
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

NOT_ACTIVE = "accelerate-scape: SCAPE is not active in this script"


def check_first_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Step pre-hook of every optimizer: at the first step, say on rank 0 whether SCAPE trains."""
    _hooks.pop().remove()
    from scape_core import AdamS, ScapeAdamS

    world = int(os.environ.get("WORLD_SIZE", "1"))
    # an AdamS on one process is SCAPE's inactive mode (the adapters said so already)
    active = isinstance(optimizer, ScapeAdamS) or (world == 1 and isinstance(optimizer, AdamS))
    if active or os.environ.get("RANK", "0") != "0":
        return
    if isinstance(optimizer, AdamS) and "accelerate_scape.plugin" in sys.modules:
        return  # ScapePlugin prepared it but its Accelerator ran alone: the plugin said why (plugin.ALONE)
    print(f"{NOT_ACTIVE}: its first optimizer step is a {type(optimizer).__module__}.{type(optimizer).__name__} "
          f"on {world} process(es), so gradients travel without SCAPE and the SCAPE_* settings are unused. "
          "Use accelerate_scape.ScapePlugin().prepare(accelerator, ...) instead of accelerator.prepare(...), "
          "or accelerate_scape.trainer.ScapeTrainer instead of transformers.Trainer.", file=sys.stderr, flush=True)


_hooks: list[Any] = []


def main(argv: list[str]) -> None:
    """Run ``argv`` (``[-m] SCRIPT ARGS...``) as ``__main__``, as the Python command line would."""
    module = argv[:1] == ["-m"]
    target, *args = argv[1:] if module else argv
    sys.argv = [target, *args]
    _hooks.append(register_optimizer_step_pre_hook(check_first_step))
    if module:
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.path[0] = os.path.dirname(os.path.abspath(target))  # as `python SCRIPT` puts the script's folder first
        runpy.run_path(target, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
