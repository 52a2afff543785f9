"""The compiled passes write the buffers they mutate in place: inductor's generated code allocates
no temporary the size of one of them (a traffic count at the graph's boundary cannot see one).

Two such temporaries were found by reading the generated code: a decay and an indexed add into the
same parameter in one graph, and a bucket zeroed and written at the entries in one graph, each
computed into a whole-size buffer copied back at the end (8 B/param each). The residual's add
takes each parameter's view of the residual as an input of its own graph.
"""

import re

import pytest
import torch
from torch._inductor.utils import run_and_get_code

from scape_core.exchange import finish_pass, residual_pass
from scape_core.kernels import Kernels
from scape_core.layout import FlatLayout
from scape_core.optimizer import sparse_step_compiled
from scape_core.update_rules import UPDATE_RULES

ALLOCATION = re.compile(r"empty_strided_\w+\(\((\d+), \)")


def temporaries(code: list[str]) -> set[int]:
    """The sizes of the 1-D buffers the generated code allocates."""
    return {int(n) for source in code for n in ALLOCATION.findall(source)}


def setup(rows: int = 6, chunk: int = 64, k: int = 5) -> dict:
    """Two parameters (2 and 4 rows of the layout) with gradients, the state's buffers, a mask's entries."""
    torch.manual_seed(0)
    params = [torch.randn(2 * chunk), torch.randn(4 * chunk)]
    grads = [torch.randn_like(p) for p in params]
    cols = torch.rand(rows, chunk).topk(k, dim=1).indices
    entries = (torch.arange(rows)[:, None] * chunk + cols).view(-1)
    split = 2 * k  # the first two rows' entries belong to the first parameter
    pieces = ((0, 0, split), (1, split, entries.numel()))
    starts = (0, 2 * chunk)  # each parameter's first flat index
    state = {name: torch.rand(rows, chunk) for name in ("m", "sq", "windows")}
    layout = FlatLayout({"a": params[0], "b": params[1]}, chunk=chunk)  # rows 0-1 and 2-5
    return dict(params=params, grads=grads, entries=entries, pieces=pieces, starts=starts, layout=layout, **state)


@pytest.mark.parametrize("decay", [0.9, None])
def test_the_compiled_sparse_step_updates_parameters_and_state_in_place(decay):
    s = setup()
    kernels = Kernels("compiled")
    factors = [None if decay is None else torch.tensor(decay)] * 2
    scale = [torch.tensor(-0.1)] * 2
    before = [p.clone() for p in s["params"]]
    _, code = run_and_get_code(
        sparse_step_compiled, kernels, UPDATE_RULES["linear"], s["params"], s["grads"], s["m"], {"sq": s["sq"]},
        s["windows"], s["entries"], torch.tensor(True), 7, factors, scale, s["layout"], s["pieces"], beta1=0.9,
        beta2=0.95, eps=1e-8)
    mutated = {p.numel() for p in s["params"]} | {s["m"].numel()}
    assert code and not temporaries(code) & mutated, temporaries(code)
    assert all(not torch.equal(p, b) for p, b in zip(s["params"], before))  # it did update them


def test_the_compiled_finish_writes_the_buckets_and_the_residual_in_place():
    s = setup()
    kernels = Kernels("compiled")
    buffers = [torch.zeros_like(g) for g in s["grads"]]  # zeroed by the hook, outside the graph
    residual = torch.randn(s["m"].shape)
    entries = s["entries"]
    reduced = torch.randn(entries.numel())
    row_shift = torch.tensor([0, 0] + [-2 * 64] * 4)  # each parameter its own region, from its offset 0
    spans = s["pieces"]  # each parameter its own region
    mean, code = run_and_get_code(kernels.get("finish", finish_pass), buffers, residual, entries, reduced, None,
                                  torch.tensor(True), row_shift, spans, 64)
    mutated = {b.numel() for b in buffers} | {residual.numel()}
    assert code and not temporaries(code) & mutated, temporaries(code)
    assert torch.equal(residual.view(-1)[entries], torch.zeros(entries.numel()))  # what was sent left it
    at = [buffers[i][entries[lo:hi] - s["starts"][i]] for i, lo, hi in s["pieces"]]
    assert torch.equal(torch.cat(at), mean) and torch.equal(mean, reduced)  # the mean at the entries


def test_the_compiled_residual_add_writes_each_view_in_place_and_drops_a_step_that_did_not_go_through():
    s = setup()
    kernels = Kernels("compiled")
    residual = torch.randn(s["m"].shape)
    flat = residual.view(-1)
    views = [flat[:128], flat[128:384]]  # the two parameters' rows of the residual
    before = [v.clone() for v in views]
    poisoned = [g.clone() for g in s["grads"]]
    poisoned[1][3] = float("nan")  # a step that is not finite: no residual may move
    _, code = run_and_get_code(kernels.get("residual", residual_pass), views, poisoned, torch.tensor(False))
    assert code and not temporaries(code) & ({v.numel() for v in views} | {residual.numel()}), temporaries(code)
    assert all(torch.equal(v, b) for v, b in zip(views, before))
    kernels.get("residual", residual_pass)(views, s["grads"], torch.tensor(True))  # the same graph: went through
    assert all(torch.equal(v, b + g) for v, b, g in zip(views, before, s["grads"]))
