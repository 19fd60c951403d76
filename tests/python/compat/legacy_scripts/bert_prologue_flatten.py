"""The prologue of an NVIDIA-BERT-like pretraining script: `import apex_C, amp_C` at
top level, Apex's DistributedDataParallel as DDP, and apex_C.flatten / unflatten to
all-reduce the gradients in one flat buffer (one gloo process here). Run as
`python -m mixedprec.apex <this file> <scratch dir>`."""

import os
import sys

import amp_C
import apex_C
import torch
import torch.distributed as dist
from apex.multi_tensor_apply import multi_tensor_applier
from apex.parallel import DistributedDataParallel as DDP


def main(scratch):
    # On the CPU on every machine, GPU or not: the DDP part is a one-process gloo group
    # (gloo: torch's CPU backend; no NCCL) reducing CPU gradients. amp_C on CUDA is run
    # by the other scripts.
    device = torch.device("cpu")
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(scratch, 'init')}",
                            rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = DDP(torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(),
                                        torch.nn.Linear(5, 2)),
                    message_size=250000000, gradient_predivide_factor=1.0)
        model(torch.randn(4, 6)).square().sum().backward()
        grads = [p.grad for p in model.parameters()]
        expected = [g.clone() for g in grads]

        flat = apex_C.flatten(grads)
        assert flat.numel() == sum(g.numel() for g in grads)
        dist.all_reduce(flat)
        flat.div_(dist.get_world_size())
        for grad, synced in zip(grads, apex_C.unflatten(flat, grads)):
            grad.copy_(synced)
        for grad, before in zip(grads, expected):
            assert torch.equal(grad, before)

        overflow = torch.zeros(1, dtype=torch.int)
        norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, overflow, [grads], False)
        assert torch.allclose(norm, torch.linalg.vector_norm(flat)), (norm, flat.norm())
        print("BERT-PROLOGUE-OK", device, float(norm))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
