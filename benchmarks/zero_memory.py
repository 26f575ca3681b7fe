"""Per-rank bytes of parameters, gradients and optimizer states under ZeRO 0-3 and FSDP2,
measured, next to the ZeRO paper's formula (Rajbhandari et al. 2020, §5).

    torchrun --nproc_per_node=2 benchmarks/zero_memory.py [--preset small] [--vocab 8000]
    torchrun --nproc_per_node=4 benchmarks/zero_memory.py --preset transformer_base --engines fsdp

Each engine (DDP, DeepSpeed ZeRO 0-3: aiayn's engines, as `distributed.backend` builds them,
and FSDP2) trains the same model for two steps, then holds a backward pass's gradients and
counts, on every rank, the bytes of every distinct tensor storage it holds, by role:

- parameters: the module's parameters (their ZeRO-3 partitions in stage 3);
- gradients: the parameters' .grad and DeepSpeed's gradient partitions and buckets;
- optimizer states: Adam's exp_avg and exp_avg_sq, and DeepSpeed's fp32 master partitions.

The formula, for fp32 training with Adam (Psi parameters, N data-parallel ranks): parameters
4 Psi, gradients 4 Psi, optimizer states 8 Psi (two moments) plus, for stages 1-3, the fp32
master copy DeepSpeed keeps of its partition (4 Psi / N; it is the paper's K = 12 with fp32
weights). Stage 1 divides the optimizer states by N, stage 2 also the gradients, stage 3
also the parameters.

FSDP2 (distributed.backend=fsdp) keeps no master copy in fp32: its rows of the weights are
what Adam steps, so every role is divided by N (4 + 4 + 8 Psi / N); its local shards are
counted (`to_local()`), padding included.

ZeRO-3 keeps parameters smaller than `stage3_param_persistence_threshold` whole on every rank
(a latency trade); this benchmark sets it to 0 so the measurement shows the partitioning
itself, and says so in its table.

A second table gives each engine's time per step (forward, backward, step; the slowest rank's
mean over --steps steps after the measured ones) and the process's peak resident memory after
it: the engines run one after another in one process, so that peak is cumulative; give one
engine (--engines) for its own.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from aiayn.config import load_config
from aiayn.distributed.env import setup
from aiayn.engine import build_engine
from aiayn.model import build_model, count_parameters

STAGES = ("ddp", 0, 1, 2, 3, "fsdp")  # 0-3: DeepSpeed's ZeRO stages


def storages(tensors) -> dict[int, int]:
    """{storage address: bytes} of the distinct storages behind `tensors`."""
    out = {}
    for t in tensors:
        if isinstance(t, DTensor):  # FSDP2's: the rank's shard is what it holds
            t = t.to_local()
        if isinstance(t, torch.Tensor) and t.numel() > 0:
            s = t.untyped_storage()
            out[s.data_ptr()] = s.nbytes()
    return out


def tensors_in(obj, depth: int = 3):
    """Tensors held by `obj` in attributes, lists, tuples and dicts, a few levels deep."""
    if isinstance(obj, torch.Tensor):
        yield obj
        if obj.grad is not None:
            yield obj.grad
        return
    if depth == 0:
        return
    if isinstance(obj, dict):
        items = obj.values()
    elif isinstance(obj, list | tuple):
        items = obj
    else:
        return
    for item in items:
        yield from tensors_in(item, depth - 1)


def measure(engine, stage: int) -> dict[str, int]:
    module, opt = engine.module, engine.optimizer
    params = [p.ds_tensor if stage == 3 else p for p in module.parameters()]
    base = getattr(opt, "optimizer", opt)  # DeepSpeed wraps a torch optimizer
    moments = [t for state in base.state.values() for t in state.values()]
    master_names = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
    masters = [t for name in master_names for t in tensors_in(getattr(opt, name, []))]
    # A master partition's .grad is its gradient partition: count it as a gradient.
    master_tensors = [m for m in masters if m is not getattr(m, "grad", None)]
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    grads += [m.grad for m in master_tensors if m.grad is not None]
    for name, value in vars(opt).items():
        if "grad" in name.lower() and "norm" not in name.lower():
            grads += list(tensors_in(value))
    p_st = storages(params)
    o_st = {k: v for k, v in storages(moments + master_tensors).items() if k not in p_st}
    g_st = {k: v for k, v in storages(grads).items() if k not in p_st and k not in o_st}
    # A cross-check that nothing big escaped the roles above: every tensor the process holds.
    with warnings.catch_warnings():  # touching every object wakes deprecation warnings
        warnings.simplefilter("ignore")
        everything = storages(o for o in gc.get_objects() if isinstance(o, torch.Tensor))
    counted = p_st.keys() | o_st.keys() | g_st.keys()
    return {
        "parameters": sum(p_st.values()),
        "gradients": sum(g_st.values()),
        "optimizer": sum(o_st.values()),
        "other": sum(v for k, v in everything.items() if k not in counted),
    }


def formula(psi: int, n: int, stage) -> dict[str, float]:
    b = 4  # fp32
    if stage == "fsdp":
        return {"parameters": b * psi / n, "gradients": b * psi / n, "optimizer": 2 * b * psi / n}
    if stage == "ddp":
        stage = 0
    return {
        "parameters": b * psi / (n if stage >= 3 else 1),
        "gradients": b * psi / (n if stage >= 2 else 1),
        "optimizer": 2 * b * psi / (n if stage >= 1 else 1) + (b * psi / n if stage >= 1 else 0),
    }


def run_stage(stage: int, args, env) -> dict[str, int]:
    extra = {"zero_optimization": {"stage3_param_persistence_threshold": 0}} if stage == 3 else {}
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
        json.dump(extra, fh)
    overrides = [
        "data.train=unused",
        f"model.preset={args.preset}",
        "model.dropout=0",
        *(
            [f"distributed.backend={stage}"]
            if stage in ("ddp", "fsdp")
            else [
                "distributed.backend=deepspeed",
                f"distributed.zero_stage={stage}",
                f"distributed.deepspeed_config={fh.name}",
            ]
        ),
    ]
    cfg = load_config(None, overrides)
    torch.manual_seed(0)
    model = build_model(cfg.model, args.vocab, 0)
    psi = count_parameters(model)
    engine = build_engine(model, cfg, env, rebuild=lambda: build_model(cfg.model, args.vocab, 0))
    g = torch.Generator().manual_seed(env.rank)

    def backward(engine):
        src = torch.randint(4, args.vocab, (args.rows, args.width), generator=g)
        tgt = torch.randint(4, args.vocab, (args.rows, args.width), generator=g)
        logits = engine.model(src, tgt)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten())
        engine.backward(loss)

    for _ in range(2):
        backward(engine)
        engine.step()
    backward(engine)  # gradients of the next step, held
    gc.collect()
    measured = measure(engine, stage)
    engine.step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps):
        backward(engine)
        engine.step()
    measured["step_s"] = (time.perf_counter() - start) / max(args.steps, 1)
    measured["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    os.unlink(fh.name)
    del engine, model
    gc.collect()
    return psi, measured


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--rows", type=int, default=16, help="sentences a micro-batch")
    parser.add_argument("--width", type=int, default=24, help="tokens a sentence")
    parser.add_argument("--steps", type=int, default=5, help="steps timed per engine")
    parser.add_argument("--engines", nargs="+", default=[str(s) for s in STAGES])
    args = parser.parse_args()
    env = setup("cpu")
    rows = []
    for stage in [int(e) if e.isdigit() else e for e in args.engines]:
        psi, measured = run_stage(stage, args, env)
        per_rank = env.gather(measured)
        expected = formula(psi, env.world_size, stage)
        rows.append((stage, psi, per_rank, expected))
    if env.rank == 0:
        n = env.world_size
        what = f"{args.preset} preset, vocab {args.vocab}, {n} ranks, fp32"
        print(f"\nZeRO and FSDP2 per-rank memory, {what}")
        print(f"Psi = {rows[0][1]:,} parameters; MiB per rank (rank 0; ranks agree within 1%)\n")
        print("| stage | what | measured MiB | formula MiB | difference |")
        print("| --- | --- | ---: | ---: | ---: |")
        others = []
        worst = 0.0
        for stage, _, per_rank, expected in rows:
            total_m = total_f = 0.0
            for what in ("parameters", "gradients", "optimizer"):
                m, f = per_rank[0][what], expected[what]
                total_m, total_f = total_m + m, total_f + f
                diff = (m - f) / f * 100
                worst = max(worst, abs(diff))
                print(f"| {stage} | {what} | {m / 2**20:.2f} | {f / 2**20:.2f} | {diff:+.1f}% |")
            diff = (total_m - total_f) / total_f * 100
            print(
                f"| {stage} | **total** | {total_m / 2**20:.2f} | {total_f / 2**20:.2f} | "
                f"{diff:+.1f}% |"
            )
            others.append(f"stage {stage}: {per_rank[0]['other'] / 2**20:.2f} MiB")
        print(f"\nlargest difference from the formula: {worst:.1f}% (goal: within 10%)")
        print("other tensors held by rank 0 (inputs, position tables, buffers):", "; ".join(others))
        print(
            "(DeepSpeed allocates its communication buckets at reduce_bucket_size elements, "
            "5e8 = 1907 MiB in fp32 by default, for stages 1 and 3: set "
            "zero_optimization.reduce_bucket_size in a configs/deepspeed/*.json file to "
            "bound it)"
        )
        for stage, _, per_rank, _ in rows:
            totals = [sum(r[k] for k in ("parameters", "gradients", "optimizer")) for r in per_rank]
            if max(totals) > 1.01 * min(totals):
                print(f"note: stage {stage} ranks differ:", per_rank)
        print(f"\nTime per step ({args.rows} x {args.width} tokens a rank, {args.steps} steps)\n")
        print("| engine | s per step (slowest rank) | peak RSS MiB (largest rank, cumulative) |")
        print("| --- | ---: | ---: |")
        for stage, _, per_rank, _ in rows:
            step_s = max(r["step_s"] for r in per_rank)
            peak = max(r["peak_rss"] for r in per_rank) / 2**20
            print(f"| {stage} | {step_s:.3f} | {peak:.0f} |")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
