"""The process environment: rank, world size, device, process group. One owner for all of it.

torchrun, `accelerate launch` and srun-started torchrun all set RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT; one process without them is world size 1 and needs no group.
"""

from __future__ import annotations

import functools
import os
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

from aiayn.config import DistributedConfig
from aiayn.errors import AiaynError, ConfigError
from aiayn.runtime import io_counts
from aiayn.runtime.torch_settings import use_expandable_segments

T = TypeVar("T")


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    device: torch.device  # this node's GPU LOCAL_RANK, or the CPU

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (a no-op on one process). One collective for the list,
        over host memory (host_group): it neither copies to the GPU nor waits for the work
        queued there, so a sum of host numbers is no host sync."""
        return self._reduce(values, dist.ReduceOp.SUM)

    def max(self, values: list[float]) -> list[float]:
        """Element-wise maximum over ranks, as `sum`."""
        return self._reduce(values, dist.ReduceOp.MAX)

    def _reduce(self, values: list[float], op) -> list[float]:
        if not self.distributed:
            return values
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, op=op, group=self.host_group)
        return t.tolist()

    @functools.cached_property
    def host_group(self) -> dist.ProcessGroup | None:
        """The group that reduces host numbers: the default group on gloo; on NCCL a gloo group
        of the same ranks, made on first use (every rank reaches it: it is a collective)."""
        if dist.get_backend() == "gloo":
            return None
        return dist.new_group(backend="gloo")

    def sum_later(self, values: list[float]) -> Callable[[], list[float]]:
        """DistEnv.sum started now, without waiting: the returned call waits for the sums."""
        if not self.distributed:
            return lambda: values
        t = torch.tensor(values, dtype=torch.float64)
        work = dist.all_reduce(t, group=self.host_group, async_op=True)

        def result() -> list[float]:
            work.wait()
            return t.tolist()

        return result

    @property
    def local_world_size(self) -> int:
        """The ranks on this node (torchrun's LOCAL_WORLD_SIZE; all of them without it)."""
        return int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size))

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", self.rank))

    @functools.cached_property
    def node_group(self) -> dist.ProcessGroup | None:
        """A gloo group of this node's ranks, made on first use (a collective: every rank of
        every node reaches it). torchrun numbers a node's ranks together: node n holds ranks
        n * L ... n * L + L - 1, for L ranks on every node."""
        local = self.local_world_size
        if self.world_size % local or self.rank != (self.rank // local) * local + self.local_rank:
            raise ConfigError(
                f"rank {self.rank}: LOCAL_RANK={self.local_rank}, LOCAL_WORLD_SIZE={local} of "
                f"WORLD_SIZE={self.world_size} is not torchrun's numbering of equal nodes, which "
                "data.cache_scope=node needs: start every node with the same --nproc_per_node"
            )
        group, _ = dist.new_subgroups(group_size=local, backend="gloo")
        return group

    def node_gather(self, obj) -> list:
        """Every rank's `obj` of this node, in local rank order, on this node's ranks."""
        return (
            self._gather(obj, self.local_world_size, self.node_group) if self.distributed else [obj]
        )

    def gather(self, obj) -> list:
        """Every rank's `obj`, in rank order, on every rank."""
        return self._gather(obj, self.world_size, None) if self.distributed else [obj]

    def gather_to_main(self, obj) -> list | None:
        """Every rank's `obj`, in rank order, on rank 0 (None elsewhere): what rank 0 alone
        needs of every rank costs the others one send."""
        if not self.distributed:
            return [obj]
        return self._gather_to_main(obj, self.host_group)

    def _gather_to_main(self, obj, group: dist.ProcessGroup | None) -> list | None:
        out = [None] * self.world_size if self.is_main else None
        dist.gather_object(obj, out, dst=0, group=group)
        if out is not None:
            _count_received(out, self.rank)
        return out

    @functools.cached_property
    def save_group(self) -> dist.ProcessGroup:
        """A gloo group of every rank for the checkpoint writer threads (an async save's
        ranks agree on their writes in the background, beside the loop's own collectives),
        made on first use: a collective that every rank's main thread reaches."""
        return dist.new_group(backend="gloo")

    def save_gather(self, obj) -> list | None:
        """Every rank's `obj` on rank 0 (None elsewhere), over save_group: safe from a writer
        thread."""
        return self._gather_to_main(obj, self.save_group) if self.distributed else [obj]

    def _gather(self, obj, size: int, group: dist.ProcessGroup | None) -> list:
        out = [None] * size
        dist.all_gather_object(out, obj, group=group)
        _count_received(out, self.rank if group is None else dist.get_rank(group))
        return out

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank: what one rank decided, for all (host memory)."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.host_group)
        return box[0]

    def decide(self, choose: Callable[[], T]) -> T:
        """Rank 0's `choose()` on every rank: one rank reads and decides, for all. If it raised
        an aiayn or OS error, every rank raises that error, instead of the others waiting for
        rank 0 at the next collective."""
        if not self.distributed:
            return choose()
        outcome = None
        if self.is_main:
            try:
                outcome = (choose(), None)
            except (AiaynError, OSError) as exc:
                outcome = (None, exc)
        result, error = self.broadcast(outcome)
        if error is not None:
            raise error
        return result

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def _count_received(objs: list, own: int) -> None:
    """Count what a gather brought from the other ranks (runtime/io_counts.py): the bytes
    their objects pickle to, as gather_object sends them."""
    received = sum(len(pickle.dumps(o)) for i, o in enumerate(objs) if i != own)
    io_counts.count("gathered_bytes", received)


def pick_device(choice: str, local_rank: int = 0, setting: str = "train.device") -> torch.device:
    """auto: CUDA when present (GPU LOCAL_RANK of those this process sees), else CPU.
    `setting`: what the user set `choice` with, for the error's message."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise ConfigError(f"{setting}=cuda but no CUDA device is visible; use {setting}=cpu")
        count = torch.cuda.device_count()
        if local_rank >= count:  # two ranks on one GPU: each gets half of it, or runs out
            raise ConfigError(
                f"LOCAL_RANK={local_rank} but this process sees {count} CUDA device(s): start "
                f"at most {count} processes per node (torchrun --nproc_per_node={count}), or "
                "make more GPUs visible (CUDA_VISIBLE_DEVICES, the scheduler's GPU request)"
            )
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def setup(
    device_choice: str, timeout_minutes: float = DistributedConfig.setup_timeout_minutes
) -> DistEnv:
    """Join the process group the launcher describes: NCCL on GPUs, gloo on CPUs.

    `timeout_minutes` bounds each collective during set-up (distributed.setup_timeout_minutes);
    use_timeout() shortens it once set-up is done.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(device_choice, local_rank)
    if device.type == "cuda":
        use_expandable_segments()  # before the first CUDA allocation
        torch.cuda.set_device(device)
    if world_size > 1 and not dist.is_initialized():
        if "MASTER_ADDR" not in os.environ:
            raise ConfigError(
                f"WORLD_SIZE={world_size} but MASTER_ADDR is not set: start the processes with "
                "torchrun or accelerate launch (see launch/)"
            )
        # A gloo group connects each rank to every other when it is made: W - 1 sockets per
        # group and rank. Not lazily (TORCH_GLOO_LAZY_INIT): a pair would then meet through
        # the launcher's store at its first exchange, and workers whose launcher died could
        # no longer save (tests/distributed/test_run_dir_lock.py failed so).
        raise_open_file_limit(world_size)
        use_scalable_gloo_meshes()
        timeout = timedelta(minutes=timeout_minutes)
        store = _attempt_store(rank, world_size, timeout)
        # NCCL on GPUs; device_id binds the communicator to this rank's GPU now, not at a
        # first collective that guesses the device.
        backend, bind = ("nccl", {"device_id": device}) if device.type == "cuda" else ("gloo", {})
        dist.init_process_group(
            backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **bind
        )
    return DistEnv(rank, world_size, device)


# gloo's settings that make its full mesh's rendezvous linear in W on the store's host (torch
# 2.13's gloo, gloo/transport/tcp/context.cc). By default each rank reads every rank's key one
# request at a time (a wait and a get: 2W(W - 1) requests a group on one host, 2.1 million at
# 1,024 ranks) and each key lists one pair number for every rank (8W bytes: 8.6 GB through the
# store in all). With these, a rank reads the keys 128 to a request (W * ceil(W / 128) requests
# a group) and a key is its host and address only, the same size at any W. Set only where the
# user has not: they are gloo's, named "experimental" there; the suite runs every multi-process
# test under them (tests/distributed/test_gloo_mesh.py counts the requests).
GLOO_MESH_SETTINGS = {"GLOO_ENABLE_STORE_V2_API": "1", "GLOO_ENABLE_RANK_AS_SEQUENCE_NUMBER": "1"}


def use_scalable_gloo_meshes() -> None:
    """Before the first gloo group: gloo reads its settings from the environment whenever it
    makes a group."""
    for name, value in GLOO_MESH_SETTINGS.items():
        os.environ.setdefault(name, value)


# Sockets a rank may hold: a full mesh for each gloo group (the default or host numbers', the
# node's, the checkpoint writers'), and room for the rest (NCCL, the cache's maps, checkpoints).
GLOO_GROUPS, OTHER_FILES = 3, 1024


def raise_open_file_limit(world_size: int) -> int:
    """Raise this process's open-file limit (RLIMIT_NOFILE) to what `world_size` ranks' gloo
    groups may need, as far as the hard limit allows, and return it; a hard limit below the
    need is a ConfigError that says how to raise it (the usual soft limit, 1,024, fails with
    "Too many open files" deep inside gloo at a few hundred ranks)."""
    import resource

    need = GLOO_GROUPS * world_size + OTHER_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    unlimited = resource.RLIM_INFINITY
    if soft == unlimited or soft >= need:
        return soft
    if hard != unlimited and hard < need:
        raise ConfigError(
            f"{world_size} ranks may need {need:,} open files each (sockets to every other rank "
            f"in {GLOO_GROUPS} gloo groups), but this process may open at most {hard:,} (the "
            f"hard limit; soft {soft:,}): raise it where the job starts (`ulimit -n {need}` in "
            "the job script, a higher `nofile` in /etc/security/limits.conf, or Slurm's "
            "PropagateResourceLimits from a shell that has it)"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
    return need


def _attempt_store(rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """The launcher's store (env://). Where the workers share the agent's store (torchrun's
    static rendezvous; its c10d one unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which
    aiayn.distributed.run sets), the keys of the group before an in-job restart are still
    there: a rank that read a dead peer's address failed to connect ("Gloo connectFullMesh
    failed ... Connection refused") in one restart of three here. Each start's keys are kept
    apart by torchrun's restart count, the same on every rank of a static group."""
    from torch.distributed.rendezvous import rendezvous

    store, _, _ = next(rendezvous("env://", rank, world_size, timeout=timeout))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return store  # made for this start
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"aiayn/start_{attempt}/", store)


def use_timeout(minutes: float, env: DistEnv | None = None) -> None:
    """From now on a collective that waits longer than `minutes` fails (on every backend the
    default group uses, and on `env`'s groups of host numbers and of save writers): after a
    rank dies, the others stop instead of waiting out the set-up timeout. torchtitan shortens
    its timeout after set-up the same way."""
    if not dist.is_initialized():
        return
    timeout = timedelta(minutes=minutes)
    dist.distributed_c10d._set_pg_timeout(timeout)
    if env is not None and env.distributed and env.host_group is not None:
        dist.distributed_c10d._set_pg_timeout(timeout, env.host_group)
    if env is not None and env.distributed:
        # Made here, where every rank is: an async save's writer thread waits in it for the
        # others' writes, and a process whose peer died must not wait gloo's 30 minutes at exit.
        dist.distributed_c10d._set_pg_timeout(timeout, env.save_group)


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def join_single_process_group(env: DistEnv) -> None:
    """A process group of this one process, for an engine that needs one (DeepSpeed, FSDP2)
    even then; with two or more processes, setup() made it.

    Its store lives in this process (a HashStore): under a launcher (torchrun, accelerate
    launch or srun with one process) a tcp:// or env:// store would be a client of the
    launcher's agent store (TORCHELASTIC_USE_AGENT_STORE), and a tcp:// address on a port of
    our own is one nobody serves, so the run waited there without a word until the store's
    timeout (seen on a GPU with torchrun --nproc_per_node=1).
    """
    if dist.is_initialized():
        return
    for name, value in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)):
        os.environ.setdefault(name, str(value))  # DeepSpeed's sanity check reads them
    backend = "nccl" if env.device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
