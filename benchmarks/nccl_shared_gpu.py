"""Does NCCL let two ranks of one process group share a GPU? (benchmarks/gpu_session.sh nccl)

The trainer refuses more ranks per node than visible GPUs (distributed/env.py pick_device)
before NCCL is reached; this asks NCCL itself, with two processes on cuda:0 and one
all_reduce, and prints what it said."""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def work(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", rank=rank, world_size=2, device_id=device)
    x = torch.ones(4, device=device) * (rank + 1)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    print(f"rank {rank}: all_reduce on a shared GPU gave {x.tolist()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    try:
        mp.spawn(work, args=(port,), nprocs=2, join=True)
        print("NCCL: two ranks on one GPU worked")
    except Exception as exc:  # what NCCL said is the finding
        print("NCCL: two ranks on one GPU failed:", str(exc).strip()[-1500:])
