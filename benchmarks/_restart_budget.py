"""The restart's budget at many ranks, extrapolated from start-up phases measured at a few
small W (benchmarks/scale.py --budget). Arithmetic only, no I/O and no torch, so that
tests/unit/test_restart_budget.py checks it on made-up inputs.

A phase is one of three kinds, as the code makes it (scale.py says which, and why, per phase):
- constant: every rank does the same work whatever W (the interpreter, imports, a step);
- share: a rank's part of some bytes (or pairs) of the whole job, 1/W of them, at stated
  throughputs (sha256 measured on this CPU, the filesystem's read per client assumed);
- grows: work on one host that every rank asks for (the c10d store on rank 0's host).
The measured seconds at W = 1, 2, 4 are classified too, as a check on that reading of the code:
on a shared CPU they are first divided by how much slower a constant phase (the imports; under
scale.py's probe, process start, which holds them) ran at each W, since W processes on 2 cores
slow each other down.
"""

from __future__ import annotations

from dataclasses import dataclass

CONSTANT, SHARE, GROWS = "constant", "share (1/W)", "grows with W"

# Below this many seconds at every W a phase is noise on a shared machine: called constant.
NOISE_S = 0.1


def classify(seconds: dict[int, float], slowdown: dict[int, float] | None = None) -> str:
    """What the measured seconds of one phase at several W say: falling like 1/W (share),
    rising (grows), or neither (constant). `slowdown[W]`: how much slower a constant phase ran
    at W than at the smallest W (the machine's contention), divided out first."""
    ws = sorted(seconds)
    if max(seconds.values()) < NOISE_S:
        return CONSTANT
    norm = {w: seconds[w] / (slowdown or {}).get(w, 1.0) for w in ws}
    lo, hi = ws[0], ws[-1]
    ratio = norm[hi] / max(norm[lo], 1e-9)
    # 1/W from lo to hi would be lo/hi (0.25 from 1 to 4); halfway to it in log terms or below
    # counts as falling, twice as high or more as growing.
    if ratio <= (lo / hi) ** 0.5:
        return SHARE
    if ratio >= 2.0 and norm[hi] - norm[lo] >= NOISE_S:
        return GROWS
    return CONSTANT


@dataclass(frozen=True)
class PhaseModel:
    """How one phase scales, read in the code, and what it costs at the target.

    constant: the measured seconds (smallest W) + `extra_s`.
    share: the measured seconds less what the rank's measured units (measured_units / the
      measured W) cost at `local_s_per_unit` (the part of the rate the measurement paid too:
      hashing from the page cache), plus target_units / W at `s_per_unit`; with `s_per_unit`
      None, both rates are the measured seconds per measured unit of the rank (a phase whose
      every second is per unit). Plus `extra_s`.
    grows: the measured seconds + `requests` at `s_per_request` (requests that one host serves
      for the whole job: a count that grows with W) + `extra_s`.
    """

    kind: str
    why: str
    target_units: float = 0.0
    measured_units: float = 0.0
    s_per_unit: float | None = None
    local_s_per_unit: float = 0.0
    requests: float = 0.0
    s_per_request: float = 0.0
    extra_s: float = 0.0

    def at(self, measured_s: float, world: int, measured_world: int = 1) -> float:
        """Seconds at `world` ranks from `measured_s`, this phase's seconds at `measured_world`
        ranks (the smallest W measured)."""
        if self.kind == CONSTANT:
            return measured_s + self.extra_s
        if self.kind == SHARE:
            mine = self.measured_units / measured_world
            if self.s_per_unit is None:
                rate = measured_s / mine if mine else 0.0
                fixed = 0.0
            else:
                rate = self.s_per_unit
                fixed = max(measured_s - mine * self.local_s_per_unit, 0.0)
            return fixed + self.target_units / world * rate + self.extra_s
        if self.kind == GROWS:
            return measured_s + self.requests * self.s_per_request + self.extra_s
        raise ValueError(f"unknown kind {self.kind!r}: one of {CONSTANT}, {SHARE}, {GROWS}")


@dataclass(frozen=True)
class BudgetRow:
    phase: str
    measured: dict[int, float]
    seen: str  # what the measured seconds say (classify)
    kind: str  # what the code does (PhaseModel.kind): the extrapolation's
    seconds: float
    why: str


def budget(
    measured: dict[str, dict[int, float]],
    models: dict[str, PhaseModel],
    world: int,
    constant_phase: str = "imports",
) -> tuple[list[BudgetRow], float]:
    """Each phase's row at `world` ranks and their total. `measured[phase][W]`: seconds at each
    measured W (the slowest rank's); `models[phase]`: how it scales. The contention is read from
    `constant_phase`, which the code makes constant."""
    ref = measured.get(constant_phase, {})
    base = min(ref) if ref else None
    slowdown = {w: s / ref[base] for w, s in ref.items()} if ref and ref[base] > 0 else None
    rows = []
    for phase, model in models.items():
        seconds = measured[phase]
        at = model.at(seconds[min(seconds)], world, min(seconds))
        rows.append(
            BudgetRow(phase, seconds, classify(seconds, slowdown), model.kind, at, model.why)
        )
    return rows, sum(r.seconds for r in rows)


@dataclass(frozen=True)
class Target:
    """The job extrapolated to, the sizes measured at the small W, and the throughputs. Those
    marked assumed are not measured anywhere here (scale.py's arguments)."""

    world: int
    ckpt_bytes: float  # the whole checkpoint (every rank's partitions together)
    cache_bytes: float  # the whole token cache
    pairs: float  # the training pairs (the epoch's plan)
    measured_ckpt_bytes: float
    measured_cache_bytes: float
    measured_pairs: float
    sha256_gbps: float  # measured: hashlib, one core
    fs_gbps: float  # assumed: one client's read from the shared filesystem
    store_requests_per_s: float  # measured: rank 0's c10d store (one libuv loop), single keys
    store_multi_gets_per_s: float  # measured: the same store's reads of GLOO_BATCH keys at once
    nccl_init_s: float  # assumed: NCCL's communicator of `world` ranks
    model_init_s: float  # assumed: transformer_big's parameters initialised on each rank
    first_step_s: float  # assumed: a GPU's first step (CUDA context, cuBLAS, first collectives)
    launcher_s: float = 0.0  # assumed: launch to the workers' creation (the launchers' rendezvous)
    gpus_per_node: int = 8
    # gloo groups of every rank made at a restart on GPUs (distributed/env.py): host numbers'
    # and the checkpoint writers'.
    gloo_groups: int = 2


# Keys a gloo rank reads from the store in one request under aiayn's settings
# (GLOO_ENABLE_STORE_V2_API=1, distributed/env.py; gloo/transport/tcp/context.cc's batch).
GLOO_BATCH = 128


def gloo_store_requests(world: int, groups: int) -> tuple[int, int]:
    """(single-key requests, multi-key reads) that `groups` gloo groups of `world` ranks ask of
    the store's host under aiayn's settings: each rank sets its key, then reads all W keys
    GLOO_BATCH at a time; a key is the rank's address alone, the same size at any W."""
    return groups * world, groups * world * -(-world // GLOO_BATCH)


def zero3_models(t: Target) -> dict[str, PhaseModel]:
    """The start-up line's phases, and how aiayn's code makes each scale under ZeRO-3 (a
    restart: the tokenizer, the cache and the checkpoint exist)."""
    hash_s, read_s = 1 / (t.sha256_gbps * 1e9), 1 / (t.fs_gbps * 1e9)
    w = t.world
    # Store requests for the whole job: torch's store-based barrier (2 adds a rank, the last
    # one's set) and NCCL's unique id (one get a rank), then the gloo groups aiayn makes on NCCL
    # (host numbers', the checkpoint writers'): each rank sets its key and reads every rank's,
    # 128 to a request (gloo's batched reads and keys of one address, distributed/env.py
    # GLOO_MESH_SETTINGS; without them each key read is a wait and a get, 2W(W - 1) requests a
    # group, and each key lists W pair numbers).
    sets, multi_gets = gloo_store_requests(w, t.gloo_groups)
    requests = 3 * w + sets
    multi_s = multi_gets / t.store_multi_gets_per_s
    return {
        # Before the start-up line begins (it counts from the process's creation): not measured.
        "launcher": PhaseModel(
            GROWS,
            f"assumed {t.launcher_s:g} s: the launchers (one a node, {w // t.gpus_per_node}) meet "
            "in torchrun's c10d rendezvous and start their workers; outside the start-up line",
            extra_s=t.launcher_s,
        ),
        "process start": PhaseModel(CONSTANT, "the interpreter, in each process at once"),
        "imports": PhaseModel(
            CONSTANT,
            "torch, DeepSpeed, aiayn: assumed from node-local disk or the image; from a network "
            "filesystem every rank's thousands of stats and opens hit one metadata server",
        ),
        "process group": PhaseModel(
            GROWS,
            f"c10d's TCPStore on rank 0's host serves {requests:,.0f} requests (barrier and NCCL "
            f"id: 3 a rank; {t.gloo_groups} gloo groups' keys: 1 a rank and group) at "
            f"{t.store_requests_per_s:,.0f}/s and {multi_gets:,.0f} reads of {GLOO_BATCH} keys "
            f"(each rank reads every key of each gloo group) at {t.store_multi_gets_per_s:,.0f}/s "
            f"({multi_s:.2f} s), + NCCL's init assumed {t.nccl_init_s:g} s",
            requests=requests,
            s_per_request=1 / t.store_requests_per_s,
            extra_s=multi_s + t.nccl_init_s,
        ),
        "tokenizer/data": PhaseModel(
            SHARE,
            f"each rank verifies 1/W of the {t.cache_bytes / 1e9:.2f} GB cache: sha256 at "
            f"{t.sha256_gbps:.2f} GB/s (measured) + read at {t.fs_gbps:g} GB/s (assumed)",
            target_units=t.cache_bytes,
            measured_units=t.measured_cache_bytes,
            s_per_unit=hash_s + read_s,
            local_s_per_unit=hash_s,
        ),
        "model build": PhaseModel(
            CONSTANT,
            "each rank builds the whole model, DeepSpeed partitions it: measured + "
            f"{t.model_init_s:g} s assumed for transformer_big's 213M parameters",
            extra_s=t.model_init_s,
        ),
        "checkpoint verify": PhaseModel(
            SHARE,
            f"each rank hashes 1/W of the {t.ckpt_bytes / 1e9:.2f} GB checkpoint (its own "
            "partitions, its byte ranges), read from the filesystem; rank 0's listing of 2W + 7 "
            "files grows with W but is milliseconds",
            target_units=t.ckpt_bytes,
            measured_units=t.measured_ckpt_bytes,
            s_per_unit=hash_s + read_s,
            local_s_per_unit=hash_s,
        ),
        "checkpoint load": PhaseModel(
            SHARE,
            "each rank reads its partitions (1/W) at the assumed filesystem read; the measured "
            "load's deserialising kept as is",
            target_units=t.ckpt_bytes,
            measured_units=t.measured_ckpt_bytes,
            s_per_unit=read_s,
        ),
        "memory probe": PhaseModel(CONSTANT, "off under ZeRO-3 (train/memory_probe.py)"),
        "data position": PhaseModel(
            SHARE,
            "the epoch's plan, each rank its part (issue 54.6), at the measured seconds per pair",
            target_units=t.pairs,
            measured_units=t.measured_pairs,
        ),
        "first step": PhaseModel(
            CONSTANT,
            f"measured (CPU) + {t.first_step_s:g} s assumed on a GPU: CUDA context, cuBLAS, "
            "ZeRO-3's first all-gathers",
            extra_s=t.first_step_s,
        ),
        "other": PhaseModel(CONSTANT, "logging, TensorBoard, the config saved"),
    }
