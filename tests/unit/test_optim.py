"""The optimizer build_optimizer makes: torch's Adam and AdamW, called without the TorchDynamo
wrappers (engine/optim.py: _without_dynamo), in a process that must not import TorchDynamo."""

import subprocess
import sys

CHECK = """
import sys
import torch
from aiayn.config import load_config
from aiayn.engine.optim import build_optimizer

def run(make, steps=4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = make(model)
    for k in range(steps):
        loss = model(torch.randn(8, 6, generator=torch.Generator().manual_seed(k))).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    state = opt.state_dict()
    opt.load_state_dict(state)
    return model, opt, state

ours = {}
for name in ("adam", "adamw"):
    cfg = load_config(None, ["data.train=x", f"optim.name={name}", "optim.weight_decay=0.01"])
    ours[name] = run(lambda m: build_optimizer(m, cfg, torch.device("cpu")))
    assert "torch._dynamo" not in sys.modules, name
    assert torch.is_grad_enabled()
for name, (model, opt, state) in ours.items():
    assert isinstance(opt, getattr(torch.optim, "AdamW" if name == "adamw" else "Adam"))
    stock = getattr(torch.optim, type(opt).__name__)
    kwargs = {k: v for k, v in opt.defaults.items() if k != "decoupled_weight_decay"}  # AdamW's
    theirs, _, stock_state = run(lambda m: stock(m.parameters(), **kwargs))
    for a, b in zip(model.parameters(), theirs.parameters(), strict=True):
        assert torch.equal(a, b), name
    for i, moments in stock_state["state"].items():
        assert all(torch.equal(moments[k], state["state"][i][k]) for k in moments), name
    assert state["param_groups"] == stock_state["param_groups"]
print("ok")
"""


def test_build_optimizers_step_and_save_as_torchs_without_importing_dynamo():
    """Each TorchDynamo wrapper imports it (1.4 s of CPU a process): the optimizer is called
    without them, and its update, moments and state are bitwise torch's own optimizer's. It
    fails where torch's wrappers change shape (build_optimizer then returns torch's class, and
    the import comes back): engine/optim.py's _without_dynamo says what it expects."""
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
