"""DeepSpeed's Muon optimizer imported without compiling at import: aiayn never builds Muon,
but every ZeRO rank imports it.

DeepSpeed asks whether the optimizer is its Muon (`is_zero_supported_optimizer`, ZeRO-3's
optimizer's constructor, ZeRO-1/2's gradient averaging) by importing `original_muon`, which
decorates its kernels with `torch.compile` as it is imported. Making those compiled functions
imports TorchInductor's machinery: 0.85 s of CPU in every ZeRO rank at every start, after
TorchDynamo itself (2026-11-28, AMD EPYC, 2 cores), for functions only Muon calls. Imported
here first, under DeepSpeed's `compiler.compile` returning a decorator that calls
`torch.compile` at a function's first call instead: a run that does use Muon gets the same
compiled function, made at its first call, which is when torch.compile compiles anyway.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable

import torch

MUON = "deepspeed.runtime.zero.muon.original_muon"


def _compiled_at_first_call(fn: Callable) -> Callable:
    compiled: Callable | None = None

    @functools.wraps(fn)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            compiled = torch.compile(fn)
        return compiled(*args, **kwargs)

    return call


def import_muon_uncompiled() -> None:
    """Import DeepSpeed's Muon module (once per process) with its `torch.compile` decorators
    deferred to each function's first call. Another DeepSpeed, without the module or the
    decorator, is left as it is."""
    if MUON in sys.modules:
        return
    try:
        from deepspeed.runtime import compiler
    except ImportError:
        return
    made = getattr(compiler, "compile", None)
    if made is None:
        return
    compiler.compile = lambda: _compiled_at_first_call
    try:
        importlib.import_module(MUON)
    except ImportError:
        pass  # a DeepSpeed without Muon: nothing imports it
    finally:
        compiler.compile = made
