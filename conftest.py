"""Doctests of the packages run in the default suite, on a one-rank gloo process group.

Examples in docstrings may use ``ddp`` (a DistributedDataParallel-wrapped ``nn.Linear(4, 2)``),
``torch``, ``nn`` and ``dist``; the process group exists only while a doctest runs.
"""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
from _pytest.doctest import DoctestItem
from torch import nn


@pytest.fixture(autouse=True)
def _doctest_process_group(request: pytest.FixtureRequest, doctest_namespace: dict):
    if not isinstance(request.node, DoctestItem):
        yield
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.manual_seed(0)
    doctest_namespace.update(torch=torch, nn=nn, dist=dist,
                             ddp=nn.parallel.DistributedDataParallel(nn.Linear(4, 2)))
    try:
        yield
    finally:
        from scape_core import inflight

        inflight.finish_all()
        dist.destroy_process_group()
