"""Ray and torch.distributed set-up for a run, on one machine or across a Ray cluster.

    start_ray("")            a Ray of this machine's own for the run (the default)
    start_ray("auto")        join the cluster `ray start` made (or RAY_ADDRESS names)
    start_ray("HOST:PORT")   join the cluster whose head is there

Rendezvous of a group of trainer ranks, wherever Ray placed them:

    driver:   master = rendezvous()            a Ray queue, handed to every rank
    rank 0:   TCPStore on its own node's IP, free port ──put──> master (once per other rank)
    rank k:   master.get() ──> HOST:PORT ──> TCPStore client
    all:      init_process_group(gloo on CPU, nccl on GPU, store=...)
"""

import os
from collections.abc import Iterator
from contextlib import contextmanager

import psutil
import ray
import torch.distributed as dist
from ray.util.queue import Queue

from instar.processes import on_sigterm


def start_ray(address: str) -> str:
    """Start or join Ray (see above); returns where the engines' and ranks' logs are."""
    env = {"env_vars": {"VLLM_LOGGING_LEVEL": "WARNING"}}
    if address:
        ray.init(address=address, log_to_driver=False, runtime_env=env)
        return "logs/ of the Ray session directory on each node (default /tmp/ray/session_latest)"
    # Ray runs its workers at nice 15 by default; here they are the job (engines, ranks)
    os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             runtime_env=env)
    return "/tmp/ray/session_latest/logs"


@contextmanager
def ray_for(address: str) -> Iterator[None]:
    """Ray for one command: started (or joined) here and shut down when the command ends, or,
    when the caller already has Ray up (a notebook, the tests), that one, left running."""
    if ray.is_initialized():
        yield
        return
    print(f"engine and trainer logs: {start_ray(address)}", flush=True)
    on_sigterm()  # (ray.init put in its own)
    try:
        yield
    finally:
        ray.shutdown()


def rendezvous() -> Queue:
    """Where rank 0 of a new group of ranks posts its store's address for the others."""
    return Queue(actor_options={"num_cpus": 0})


def init_process_group(rank: int, world: int, master: Queue, device: str) -> None:
    """Join the group (every rank calls this, inside its Ray actor): rank 0 serves the store
    on the IP Ray knows its node by, which the other ranks reach wherever they run."""
    host = ray.util.get_node_ip_address()
    nic = next((name for name, addrs in psutil.net_if_addrs().items()
                if any(a.address == host for a in addrs)), None)
    if nic:  # else gloo takes the host name's address, which may be a loopback one
        os.environ.setdefault("GLOO_SOCKET_IFNAME", nic)
    if rank == 0:
        store = dist.TCPStore(host, 0, world, is_master=True, wait_for_workers=False)
        for _ in range(world - 1):
            master.put(f"{host}:{store.port}")
    else:
        address, port = master.get().rsplit(":", 1)
        store = dist.TCPStore(address, int(port), world, is_master=False)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=rank,
                            world_size=world)
