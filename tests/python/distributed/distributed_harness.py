"""Runs a function on N local processes, with a deadline and a clean teardown, and
returns what each rank returned.

``run_ranks(fn, world_size, *args, device="cpu")`` calls ``fn(rank, world_size, *args)``
in each process after ``init_process_group``: gloo on the CPU, or NCCL with one GPU per
rank for ``device="cuda"``; inside, :func:`device` gives the rank's device. ``fn`` must
be a top-level function of an importable module (the processes fork from a server). A rank
that raises fails the call with its traceback; a run past ``timeout`` seconds is killed
and raises TimeoutError.
"""

import gc
import os
import tempfile
import time
from typing import Any, Callable, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def device() -> torch.device:
    """This rank's device: its GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def can_run(device_type: str, world_size: int) -> bool:
    """Whether this machine runs ``world_size`` ranks on ``device_type``."""
    if not dist.is_available():
        return False
    if device_type == "cuda":
        return dist.is_nccl_available() and torch.cuda.device_count() >= world_size
    return dist.is_gloo_available()


def _entry(rank: int, fn: Callable, world_size: int, workdir: str, args: tuple,
           device_type: str) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo",
                            init_method=f"file://{workdir}/init", rank=rank,
                            world_size=world_size)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(workdir, f"result{rank}.pt"))
        # Objects holding gloo work (DDP's reducer, FSDP's state) go while the group
        # still exists; then every rank leaves together.
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Interpreter finalisation can abort on gloo threads that leftover objects still
    # reference; failures raised above already reached the parent.
    os._exit(0)


# The ranks fork from a server process that has imported torch and mixedprec once, so
# a call costs no interpreter start or import per rank (spawn costs seconds each). The
# server is started clean, without the parent's threads or CUDA state. The ranks see
# the environment of the server's start (the first call), not a later os.environ:
# hand a rank its settings through fn's arguments.
mp.set_forkserver_preload(["torch", "torch.distributed", "mixedprec"])


def run_ranks(fn: Callable, world_size: int, *args: Any, device: str = "cpu",
              timeout: float = 180) -> List[Any]:
    with tempfile.TemporaryDirectory(prefix="mixedprec-dist-") as workdir:
        context = mp.start_processes(_entry, args=(fn, world_size, workdir, args, device),
                                     nprocs=world_size, join=False, start_method="forkserver")
        deadline = time.monotonic() + timeout
        try:
            while not context.join(timeout=5):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{fn.__name__} on {world_size} ranks ran past "
                                       f"{timeout} s")
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        return [torch.load(os.path.join(workdir, f"result{r}.pt"), weights_only=False,
                           map_location="cpu")
                for r in range(world_size)]
