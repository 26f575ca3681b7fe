"""DeepSpeed's Muon module imported with its torch.compile decorators deferred to each function's
first call (engine/deepspeed_muon.py), in a process of its own: the import is once per process."""

import subprocess
import sys

CHECK = """
import sys
import torch

compiled = []
def compile(fn, **kwargs):  # torch.compile, recorded
    compiled.append(fn.__name__)
    return fn
torch.compile = compile

from aiayn.engine import deepspeed_muon
from deepspeed.runtime import compiler

before = compiler.compile
deepspeed_muon.import_muon_uncompiled()
from deepspeed.runtime.zero.muon import original_muon
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam  # as ZeRO's check does
assert compiled == [], compiled  # nothing compiled at import
assert compiler.compile is before and compiler.compile() is compile  # DeepSpeed's, restored

g = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
first = original_muon.zeropower_via_newtonschulz5(g, 3)
again = original_muon.zeropower_via_newtonschulz5(g, 3)
assert compiled == ["zeropower_via_newtonschulz5"], compiled  # at the first call, once
assert torch.equal(first, again) and first.shape == g.shape
deepspeed_muon.import_muon_uncompiled()  # imported: nothing more to do
print("ok")
"""


def test_muon_is_imported_with_its_kernels_compiled_at_their_first_call():
    """Compiling at import costs every ZeRO rank 0.85 s of CPU at each start: torch.compile is
    not called while the module is imported, but when a compiled function is first called, and
    once. It fails where DeepSpeed's module or its `compiler.compile` changes shape: the
    decorators then compile at import again."""
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "ok", out.stderr[-3000:]
