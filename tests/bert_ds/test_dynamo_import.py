"""TorchDynamo is imported by the first compilation, not by an optimizer's first method call
(``bert_ds.base.dynamo``), and a compiled region still runs those methods eagerly."""

import subprocess
import sys

import pytest

from tests.conftest import REPO, cli_env

pytestmark = pytest.mark.lowest  # what it relies on is torch's: the lowest supported torch too

SCRIPT = r'''
import sys, torch
from bert_ds.base import dynamo
from bert_ds.optim.lamb import Lamb

deferred = dynamo.import_dynamo_when_compiling()
if "plant" in sys.argv:  # as torch's mark would be without the deferral
    deferred = []
    for name in dynamo.OPTIMIZER_METHODS:
        delattr(getattr(torch.optim.Optimizer, name).__wrapped__, dynamo.CACHE_ATTRIBUTE)
weight = torch.nn.Parameter(torch.ones(4))
optimizer = Lamb([{"params": [weight], "weight_decay": 0.01}], lr=0.1, kernels="torch")
weight.grad = torch.ones(4)
optimizer.step()
optimizer.zero_grad()
optimizer.load_state_dict(optimizer.state_dict())
print("deferred", ",".join(deferred))
print("imported before compiling", "torch._dynamo" in sys.modules)

def step_and_clear(x):
    y = (x * 2).sum()
    optimizer.zero_grad()  # a method torch runs eagerly inside a compiled region: a graph break
    return y + 1

from torch._dynamo.testing import CompileCounter
counter = CompileCounter()
compiled = torch.compile(step_and_clear, backend=counter)
assert compiled(torch.ones(3)).item() == 7.0
zero_grad = torch.optim.Optimizer.zero_grad.__wrapped__
print("graphs", counter.frame_count)
print("torch's disable installed", getattr(getattr(zero_grad, dynamo.CACHE_ATTRIBUTE), "_torchdynamo_disable", False))
'''


def _run(*args: str) -> dict[str, str]:
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, cwd=REPO,
                          env=cli_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(line.rsplit(" ", 1) for line in proc.stdout.splitlines())


def test_an_optimizer_imports_no_dynamo_and_a_compiled_region_still_runs_its_methods_eagerly():
    seen = _run()
    assert seen["deferred"] == "add_param_group,zero_grad,state_dict,load_state_dict"
    assert seen["imported before compiling"] == "False"
    # zero_grad split the region in two graphs (it ran eagerly), and carries torch's own disable now
    assert seen["graphs"] == "2" and seen["torch's disable installed"] == "True"


def test_without_the_deferral_an_optimizer_imports_dynamo():
    """The check above can fail: torch's mark alone imports TorchDynamo at the first method call."""
    assert _run("plant")["imported before compiling"] == "True"
