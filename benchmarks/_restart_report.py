"""The restart's tables for benchmarks/scale.py: its start-up split by phase per W, and its
budget at many ranks (the arithmetic is _restart_budget.py's), with the throughputs measured
on this machine that the budget uses (sha256, the c10d store) and the sizes it scales from.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from pathlib import Path

from _common import markdown_table
from _restart_budget import GLOO_BATCH, Target, budget, gloo_store_requests, zero3_models

ROOT = Path(__file__).resolve().parents[1]


def phase_table(restart: dict[int, dict]) -> str:
    """Per W, rank 0's split and the slowest rank's (by total), a column per phase."""
    phases = [k for k in restart[min(restart)]["splits"][0] if k != "total"]
    rows = []
    for world, got in sorted(restart.items()):
        splits = got["splits"]
        slowest = max(range(len(splits)), key=lambda r: splits[r]["total"])
        for rank in dict.fromkeys([0, slowest]):
            label = "0" if rank == 0 else f"{rank} (slowest)"
            if rank == 0 and slowest == 0 and world > 1:
                label = "0 (slowest)"
            cells = [f"{splits[rank][k]:.2f}" for k in [*phases, "total"]]
            rows.append([str(world), label, *cells])
    return markdown_table(["W", "rank", *phases, "total"], rows)


def cache_size(root: Path) -> tuple[int, int]:
    """A token cache's bytes (its manifest's files) and its pairs."""
    manifest = json.loads((root / "manifest.json").read_text())
    return sum(f["bytes"] for f in manifest["files"].values()), manifest["counts"]["examples"]


def pair_cache(own: Path, given: str | None = None) -> dict:
    """Bytes per training pair of a real corpus's token cache where one is at hand (`given`, or
    Multi30k's from `launch/multi30k.py`: runs/*/data_cache/train), else of this benchmark's
    numbers (short lines of digits: fewer tokens a pair than real sentences)."""
    if given:
        size, pairs = cache_size(Path(given))
        return {"from": given, "bytes": size, "pairs": pairs}
    for root in sorted(ROOT.glob("runs/*/data_cache/train")):
        manifest = root / "manifest.json"
        if manifest.is_file() and "multi30k" in manifest.read_text():
            size, pairs = cache_size(root)
            return {"from": str(root.relative_to(ROOT)), "bytes": size, "pairs": pairs}
    size, pairs = cache_size(own)
    return {
        "from": "the numbers corpus (no Multi30k cache in runs/)",
        "bytes": size,
        "pairs": pairs,
    }


def sha256_gbps(mib: int = 64, repeats: int = 3) -> float:
    """hashlib's sha256 on one core, GB/s: the best of `repeats` over `mib` MiB."""
    data = os.urandom(mib << 20)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        hashlib.sha256(data).digest()
        best = min(best, time.perf_counter() - started)
    return len(data) / best / 1e9


def store_gets_per_s(n: int = 5000) -> float:
    """Key reads a second from torch's c10d TCPStore (libuv) on this host: one client's
    sequential gets over loopback, the client on the same cores as the server."""
    return _store_reads_per_s(n, keys=1, value_bytes=64)


def store_multi_gets_per_s(n: int = 500, keys: int = 128, value_bytes: int = 160) -> float:
    """Reads of `keys` keys in one request (multi_get) a second from the same store: what a gloo
    rank asks under aiayn's settings (_restart_budget.GLOO_BATCH keys of a rank's address, 154
    bytes here with the host's name: tests/distributed/test_gloo_mesh.py)."""
    return _store_reads_per_s(n, keys, value_bytes)


def _store_reads_per_s(n: int, keys: int, value_bytes: int) -> float:
    """Requests a second reading `keys` keys of `value_bytes` each (a get for one, a multi_get
    for more) from a TCPStore made here, one client over loopback."""
    from datetime import timedelta

    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60), wait_for_workers=False)
    names = [str(k) for k in range(keys)]
    for name in names:
        store.set(name, b"x" * value_bytes)
    read = (lambda: store.get(names[0])) if keys == 1 else (lambda: store.multi_get(names))
    started = time.perf_counter()
    for _ in range(n):
        read()
    return n / (time.perf_counter() - started)


def budget_arguments(p: argparse.ArgumentParser) -> None:
    """--budget and the extrapolation's target and assumptions (each printed with the table)."""
    p.add_argument("--budget", action="store_true", help="extrapolate the restart (below)")
    p.add_argument("--budget-from", metavar="RESTART_JSON", help="only the budget, from a run's")
    p.add_argument("--budget-world", type=int, default=1024)
    p.add_argument("--budget-params", type=float, default=213e6, help="transformer_big's")
    p.add_argument(
        "--budget-bytes-per-param",
        type=float,
        default=16,
        help="ZeRO-3 with Adam: 4 (fp32 weights) + 8 (Adam's moments) + 4 (fp32 master)",
    )
    p.add_argument("--budget-pairs", type=float, default=4.5e6, help="WMT14 en-de's")
    p.add_argument(
        "--pair-cache",
        metavar="CACHE_DIR",
        help="a real corpus's token cache (RUN/data_cache/train) for the bytes a pair "
        "(default: Multi30k's in runs/ if there, else the numbers corpus's)",
    )
    p.add_argument("--fs-gbps", type=float, default=1.0, help="assumed: one client's read, GB/s")
    p.add_argument(
        "--store-gets-per-s", type=float, help="assumed store rate (default: measured here)"
    )
    p.add_argument(
        "--store-multi-gets-per-s",
        type=float,
        help="assumed rate of 128-key reads (default: measured here)",
    )
    p.add_argument("--nccl-init-s", type=float, default=10.0, help="assumed at 1,024 ranks")
    p.add_argument("--model-init-s", type=float, default=3.0, help="assumed: 213M parameters")
    p.add_argument("--first-step-s", type=float, default=3.0, help="assumed: on a GPU")
    p.add_argument(
        "--launcher-s", type=float, default=5.0, help="assumed: launch to the workers' creation"
    )
    p.add_argument("--goal-s", type=float, default=60.0)


def print_budget(measured: dict, args) -> None:
    """The restart at --budget-world ranks (benchmarks/_restart_budget.py), phase by phase."""
    restart = {int(w): got for w, got in measured["restart"].items()}
    phases = [k for k in restart[min(restart)]["splits"][0] if k != "total"]
    # Each phase's slowest rank at each W: the phases end at collectives, so the slowest sets it.
    seconds = {
        k: {w: max(s[k] for s in got["splits"]) for w, got in restart.items()} for k in phases
    }
    cache = measured["pair_cache"]
    per_pair = cache["bytes"] / cache["pairs"]
    store = args.store_gets_per_s or measured["store_gets_per_s"]
    # restart.json from before the gloo settings has no batched rate: measured now.
    multi = args.store_multi_gets_per_s or measured.get("store_multi_gets_per_s")
    multi = multi or store_multi_gets_per_s()
    target = Target(
        world=args.budget_world,
        ckpt_bytes=args.budget_params * args.budget_bytes_per_param,
        cache_bytes=per_pair * args.budget_pairs,
        pairs=args.budget_pairs,
        measured_ckpt_bytes=measured["ckpt_bytes"],
        measured_cache_bytes=measured["cache_bytes"],
        measured_pairs=measured["pairs"],
        sha256_gbps=measured["sha256_gbps"],
        fs_gbps=args.fs_gbps,
        store_requests_per_s=store,
        store_multi_gets_per_s=multi,
        nccl_init_s=args.nccl_init_s,
        model_init_s=args.model_init_s,
        first_step_s=args.first_step_s,
        launcher_s=args.launcher_s,
    )
    seconds["launcher"] = {w: 0.0 for w in restart}  # before the start-up line: not measured
    # Under the probe, torch and aiayn are imported before aiayn's main: "process start" holds
    # the imports, so it is the constant phase that shows the machine's contention.
    models = zero3_models(target)
    rows, total = budget(seconds, models, args.budget_world, constant_phase="process start")
    ws = sorted(restart)
    print(
        f"\nThe restart at W = {args.budget_world:,}: transformer_big under ZeRO-3 "
        f"({args.budget_params / 1e6:.0f}M parameters x {args.budget_bytes_per_param:g} bytes = "
        f"{target.ckpt_bytes / 1e9:.2f} GB of checkpoint), a token cache of "
        f"{args.budget_pairs / 1e6:g}M pairs at {per_pair:.1f} bytes a pair (measured on "
        f"{cache['from']}: {cache['bytes']:,} bytes, {cache['pairs']:,} pairs) = "
        f"{target.cache_bytes / 1e9:.2f} GB. Measured here: sha256 {target.sha256_gbps:.2f} GB/s "
        f"(hashlib, 64 MiB, one core), the c10d store {store:,.0f} gets/s and {multi:,.0f} reads "
        f"of {GLOO_BATCH} keys/s (one client, loopback). Assumed: the filesystem's read "
        f"{args.fs_gbps:g} GB/s per client, NCCL's "
        f"init {args.nccl_init_s:g} s, transformer_big's initialisation {args.model_init_s:g} s, "
        f"the launchers' rendezvous {args.launcher_s:g} s, "
        f"a GPU's first step {args.first_step_s:g} s, software on node-local disk. Measured "
        "seconds: the slowest rank's per phase; 'measured trend' classifies them after dividing "
        "by the slowdown of process start (which holds the imports under the probe) at each W: "
        "the machine's contention\n"
    )
    header = [
        "phase",
        *(f"W={w} s" for w in ws),
        "measured trend",
        "scaling (code)",
        f"at {args.budget_world:,} s",
        "how",
    ]
    table = [
        [
            r.phase,
            *(f"{r.measured[w]:.2f}" for w in ws),
            r.seen,
            r.kind,
            f"{r.seconds:.2f}",
            r.why,
        ]
        for r in rows
    ]
    verdict = "met" if total < args.goal_s else "missed"
    table.append(["**total**", *("" for _ in ws), "", "", f"**{total:.1f}**", ""])
    print(markdown_table(header, table))
    sets, multi_gets = gloo_store_requests(args.budget_world, target.gloo_groups)
    mesh = sets / store + multi_gets / multi
    print(
        f"\nGoal: under {args.goal_s:g} s from launch to first step: {verdict} ({total:.1f} s); "
        f"of it the {target.gloo_groups} gloo groups' rendezvous on the store, {mesh:.2f} s."
    )
