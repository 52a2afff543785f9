"""The model SCAPE serves: the DDP module under its wrappers, and its trainable parameters by name.

One place unwraps ``torch.compile`` (``_orig_mod``) and names parameters without the
wrappers' prefixes (DDP's ``module.``, torch.compile's ``_orig_mod.``, Fabric's
``_forward_module.``), for the state, the diagnostics and the adapters alike.
"""

from __future__ import annotations

from torch import Tensor, nn

_WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_forward_module.")


def unwrap_compiled(model: nn.Module) -> nn.Module:
    """The module inside every ``torch.compile`` wrapper of ``model`` (``model`` itself if none).

    Example:
        >>> net = torch.nn.Linear(2, 2)
        >>> unwrap_compiled(net) is net
        True
        >>> unwrap_compiled(torch.compile(net)) is net   # doctest: +SKIP
        True
    """
    while isinstance(getattr(model, "_orig_mod", None), nn.Module):
        model = model._orig_mod
    return model


def parameter_names(model: nn.Module) -> dict[str, Tensor]:
    """Trainable parameters by name, with DDP / torch.compile / Fabric wrapper prefixes removed.

    Example:
        >>> list(parameter_names(nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))))
        ['weight', 'bias']
    """
    named = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        while name.startswith(_WRAPPER_PREFIXES):
            name = name.split(".", 1)[1]
        named[name] = p
    return named


def check_ddp_model(model: nn.Module) -> nn.parallel.DistributedDataParallel:
    """The DDP module of ``model`` (optionally under torch.compile); refuses models SCAPE cannot serve.

    SCAPE replaces DDP's gradient all-reduce, so it needs DDP itself and dense gradients.
    """
    inner = unwrap_compiled(model)
    if not isinstance(inner, nn.parallel.DistributedDataParallel):
        raise TypeError(
            f"ScapeState needs the DistributedDataParallel-wrapped model, got {type(inner).__name__} "
            "(FSDP and DeepSpeed shard gradients themselves; for FSDP2, SCAPE across the replicate dimension is "
            "scape_core.scape_fsdp(model, mesh) on a 2-D (replicate, shard) mesh; FSDP1 and DeepSpeed are not "
            "supported)"
        )
    for name, module in inner.module.named_modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
            raise TypeError(f"{name or 'the model'} is an embedding with sparse=True; SCAPE needs dense "
                            "gradients: build it with sparse=False")
    for name, p in parameter_names(model).items():
        if not p.is_contiguous():
            raise ValueError(f"parameter {name!r} is not contiguous (e.g. channels_last): SCAPE keeps flat "
                             "views of every parameter; make it contiguous before wrapping the model in DDP")
    return inner
