"""Makes one gloo group of W processes over a store that counts what gloo asks of it, with the
settings aiayn's set-up gives gloo (distributed/env.py use_scalable_gloo_meshes), then sums a
tensor over the group; prints, as JSON, the store's requests summed over the ranks, the bytes
of the keys gloo read and the sum each rank got, for each W asked.

The ranks are forked from a server that has imported torch (multiprocessing's forkserver): a
plain fork of a process holding a TCPStore server left one rank hanging before its key was
set, in every try here (W = 4 to 48).
Usage: python gloo_mesh.py W [W ...]
"""

import json
import multiprocessing as mp
import sys
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

from aiayn.distributed.env import use_scalable_gloo_meshes

TIMEOUT = timedelta(seconds=60)


class CountingStore(dist.Store):
    """A TCPStore client that counts the requests it forwards (gloo calls it from C++)."""

    def __init__(self, inner: dist.Store):
        super().__init__()
        self.inner, self.calls, self.read_bytes = inner, {}, 0
        self.lock = threading.Lock()

    def _count(self, name: str, read: int = 0) -> None:
        with self.lock:
            self.calls[name] = self.calls.get(name, 0) + 1
            self.read_bytes += read

    def set(self, key, value):
        self._count("set")
        self.inner.set(key, value)

    def get(self, key):
        value = self.inner.get(key)
        self._count("get", len(value))
        return value

    def wait(self, keys, timeout=TIMEOUT):
        self._count("wait")
        self.inner.wait(keys, timeout)

    def add(self, key, amount):
        self._count("add")
        return self.inner.add(key, amount)

    def check(self, keys):
        self._count("check")
        return self.inner.check(keys)

    def has_extended_api(self):
        return self.inner.has_extended_api()

    def multi_get(self, keys):
        values = self.inner.multi_get(keys)
        self._count("multi_get", sum(len(v) for v in values))
        return values

    def multi_set(self, keys, values):
        self._count("multi_set")
        self.inner.multi_set(keys, values)


def rank_main(rank: int, world: int, port: int, results) -> None:
    use_scalable_gloo_meshes()
    store = CountingStore(dist.TCPStore("127.0.0.1", port, world, False, TIMEOUT))
    group = dist.ProcessGroupGloo(dist.PrefixStore("mesh/", store), rank, world, TIMEOUT)
    total = torch.tensor([float(rank)])
    group.allreduce([total]).wait()
    results.put((store.calls, store.read_bytes, total.item()))


def mesh(ctx, world: int) -> dict:
    server = dist.TCPStore("127.0.0.1", 0, world, True, TIMEOUT, wait_for_workers=False)
    results = ctx.Queue()
    ranks = [
        ctx.Process(target=rank_main, args=(r, world, server.port, results)) for r in range(world)
    ]
    for p in ranks:
        p.start()
    got = [results.get(timeout=120) for _ in ranks]
    for p in ranks:
        p.join(timeout=60)
    calls: dict[str, int] = {}
    for rank_calls, _, _ in got:
        for name, n in rank_calls.items():
            calls[name] = calls.get(name, 0) + n
    return {"calls": calls, "read_bytes": sum(g[1] for g in got), "sums": [g[2] for g in got]}


def main(worlds: list[int]) -> None:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    print(json.dumps({w: mesh(ctx, w) for w in worlds}))


if __name__ == "__main__":
    main([int(w) for w in sys.argv[1:]])
