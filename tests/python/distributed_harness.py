"""Runs a function on N local processes with gloo (CPU), with a deadline and a clean
teardown, and returns what each rank returned.

``run_ranks(fn, world_size, *args)`` calls ``fn(rank, world_size, *args)`` in each
process after ``init_process_group``; ``fn`` must be a top-level function of an
importable module (the processes are spawned). A rank that raises fails the call with
its traceback; a run past ``timeout`` seconds is killed and raises TimeoutError.
"""

import gc
import os
import tempfile
import time
from typing import Any, Callable, List

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn: Callable, world_size: int, workdir: str, args: tuple) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{workdir}/init", rank=rank,
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


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 180) -> List[Any]:
    with tempfile.TemporaryDirectory(prefix="mixedprec-dist-") as workdir:
        context = mp.start_processes(_entry, args=(fn, world_size, workdir, args),
                                     nprocs=world_size, join=False, start_method="spawn")
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
        return [torch.load(os.path.join(workdir, f"result{r}.pt"), weights_only=False)
                for r in range(world_size)]
