"""A small GPT-style language model trained with FSDP2 and mixedprec, under torchrun.

One process per GPU (NCCL), or per CPU slot (gloo) without GPUs. The text is the
Python standard library's own source, read from disk as bytes (no download). Three
mixed-precision recipes (see docs/distributed.md):

  bf16          fp32 sharded params (the masters), bf16 compute, fp32 gradient
                reduction; mixedprec.FusedAdam
  fp16          the same with fp16 compute and mixedprec.GradScaler
  bf16-masters  bf16 sharded params, fp32 masters inside FusedAdam (master_weights=True)
  bf16-lean     bf16 sharded params and no fp32 copy: mixedprec.optim.AdamW with
                master="kahan" (a bf16 compensation) or "stochastic" (--lean), bf16
                moments (--state-dtype); 4-6 bytes of state per parameter instead of 12

Checkpoints are torch.distributed.checkpoint (DCP) directories: model, optimizer
(masters, moments, step) and the loss scaler, sharded; ``--resume`` continues from the
latest one, on any number of processes.

  torchrun --nproc_per_node=2 examples/fsdp/train.py --precision bf16 --steps 200
"""

import argparse
import gc
import math
import os
import sysconfig
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn import functional as F

import mixedprec


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--precision", choices=["bf16", "fp16", "bf16-masters", "bf16-lean"],
                   default="bf16")
    p.add_argument("--lean", choices=["kahan", "stochastic"], default="kahan",
                   help="bf16-lean: how the bf16 params keep what rounding drops")
    p.add_argument("--state-dtype", choices=["bf16", "fp32"], default="bf16",
                   help="bf16-lean: the moments' dtype")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=8, help="sequences per process and step")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"))
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                           v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, seq: int, dim: int, layers: int, heads: int):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def corpus() -> torch.Tensor:
    """The standard library's Python sources as one tensor of bytes (tokens 0..255)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    data = b"".join(path.read_bytes() for path in sorted(root.glob("*.py")))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batch(data, step, rank, args, device):
    """Rank ``rank``'s sequences of ``step``: a function of (seed, step, rank) alone, so
    a resumed run sees what an uninterrupted one would have."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
    starts = torch.randint(0, data.numel() - args.seq - 1, (args.batch,), generator=g)
    rows = torch.stack([data[s:s + args.seq + 1] for s in starts.tolist()])
    return rows[:, :-1].to(device), rows[:, 1:].to(device)


def build(args, device):
    torch.manual_seed(args.seed)
    model = GPT(256, args.seq, args.dim, args.layers, args.heads).to(device)
    if args.precision in ("bf16-masters", "bf16-lean"):
        model = model.to(torch.bfloat16)
        policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    else:
        compute = torch.bfloat16 if args.precision == "bf16" else torch.float16
        policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    if args.precision == "bf16-lean":
        opt = mixedprec.optim.AdamW(
            model.parameters(), lr=args.lr, weight_decay=0.1, master=args.lean,
            state_dtype=torch.bfloat16 if args.state_dtype == "bf16" else torch.float32,
            seed=args.seed if args.lean == "stochastic" else None)
    else:
        opt = mixedprec.FusedAdam(model.parameters(), lr=args.lr, weight_decay=0.1,
                                  master_weights=args.precision == "bf16-masters")
    scaler = mixedprec.GradScaler(device.type, enabled=args.precision == "fp16")
    return model, opt, scaler


def save(args, step, model, opt, scaler):
    model_sd, optim_sd = get_state_dict(model, opt)
    path = args.checkpoint_dir / f"step_{step}"
    dcp.save({"model": model_sd, "optim": optim_sd, "scaler": scaler.state_dict(),
              "step": step}, checkpoint_id=str(path))
    if dist.get_rank() == 0:
        (args.checkpoint_dir / "latest").write_text(path.name)


def load(args, model, opt, scaler) -> int:
    """Loads the latest checkpoint, resharded to this run; returns its step."""
    path = args.checkpoint_dir / (args.checkpoint_dir / "latest").read_text().strip()
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd, "scaler": scaler.state_dict(), "step": 0}
    if scaler.is_enabled():
        scaler.scale(torch.ones((), device=next(model.parameters()).device))  # make its tensors
        state["scaler"] = scaler.state_dict()
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if scaler.is_enabled():
        scaler.load_state_dict(state["scaler"])
    return int(state["step"])


def main():
    args = parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else \
        torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    data = corpus()
    model, opt, scaler = build(args, device)
    start = load(args, model, opt, scaler) if args.resume else 0
    if rank == 0:
        print(f"{args.precision}: {sum(p.numel() for p in model.parameters()):,} params on "
              f"{world} {'GPUs' if cuda else 'processes'}, {data.numel():,} bytes of text, "
              f"from step {start}", flush=True)
        args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    progress = None
    if rank == 0:
        from tqdm import tqdm
        progress = tqdm(total=args.steps, initial=start, unit="step", dynamic_ncols=True)
    loss_sum = torch.zeros((), device=device)
    for step in range(start, args.steps):
        x, y = batch(data, step, rank, args, device)
        loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        loss_sum += loss.detach()
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            dist.all_reduce(loss_sum)
            mean = loss_sum.item() / world / ((step - start) % args.save_every + 1)
            loss_sum.zero_()
            if progress is not None:
                progress.write(f"step {step + 1} loss {mean:.6f} ({mean / math.log(2):.3f} "
                               "bits/byte)")
            save(args, step + 1, model, opt, scaler)
        if progress is not None:
            progress.update(1)
    if progress is not None:
        progress.close()
    # The model and optimizer (and through them the process groups) go first: a gloo
    # group destroyed later, at exit, can deadlock or abort (seen with torch 2.11).
    del model, opt
    gc.collect()
    dist.barrier()  # leave together: a rank exiting early can abort gloo in its peer
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
