"""The classic Apex fp16 recipe on mixedprec: ``network_to_half`` + ``FP16_Optimizer``.

What Apex users did before ``amp`` (and what many scripts still do)::

    model = network_to_half(model)            # not model.half(): batchnorm stays fp32
    torch.backends.cudnn.benchmark = True     # the model's shapes are static
    optimizer = FP16_Optimizer(SGD(model.parameters(), lr, momentum=0.9),
                               static_loss_scale=256)   # or dynamic_loss_scale=True
    ...
    optimizer.zero_grad()
    loss = criterion(model(input).float(), target)
    optimizer.backward(loss)                  # instead of loss.backward()
    optimizer.step()                          # steps fp32 masters, copies them into the model

The only change from an Apex script is the import (``apex.fp16_utils`` ->
``mixedprec.fp16_utils``; or run the Apex script itself with ``python -m
mixedprec.apex``). Here a small CNN learns synthetic 16x16 images (noisy copies of
one random pattern per class), on the GPU when there is one, else on the CPU. Exits
with status 1 unless the loss falls.

    PYTHONPATH=. python examples/fp16_optimizer/train.py                     # static 256
    PYTHONPATH=. python examples/fp16_optimizer/train.py --dynamic-loss-scale
    PYTHONPATH=. python examples/fp16_optimizer/train.py --bf16 --steps 100
"""

import argparse
import math
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from mixedprec.fp16_utils import FP16_Optimizer, network_to_half


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--static-loss-scale", type=float, default=256.0,
                   help="the loss scale unless --dynamic-loss-scale (default: %(default)s)")
    p.add_argument("--dynamic-loss-scale", action="store_true",
                   help="a DynamicLossScaler: halves on overflow (the step is skipped), "
                        "doubles after --scale-window clean steps")
    p.add_argument("--init-scale", type=float, default=2.0**16,
                   help="first dynamic loss scale (default: 2**16; DynamicLossScaler's own "
                        "default is 2**32, which costs ~16 skipped steps at the start)")
    p.add_argument("--scale-window", type=int, default=1000)
    p.add_argument("--bf16", action="store_true", help="bfloat16 instead of float16")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--print-freq", type=int, default=10)
    p.add_argument("--save", default=None, metavar="PATH",
                   help="save model and optimizer state (fp32 masters, loss scaler) here, "
                        "reload them and check the reload")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def make_model(num_classes=10):
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.BatchNorm2d(16), nn.ReLU(),   # 8x8
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.BatchNorm2d(32), nn.ReLU(),  # 4x4
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
        nn.Linear(32, num_classes),
    )


def synthetic_batches(batch_size, device, seed, num_classes=10, noise=1.5):
    """Endless batches: each image is its class's fixed random pattern plus noise."""
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(num_classes, 3, 16, 16, generator=g)
    while True:
        target = torch.randint(0, num_classes, (batch_size,), generator=g)
        images = patterns[target] + noise * torch.randn(batch_size, 3, 16, 16, generator=g)
        yield images.to(device), target.to(device)


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = torch.bfloat16 if args.bf16 else torch.float16
    torch.manual_seed(args.seed)
    if device.type == "cpu":
        torch.set_num_threads(1)  # a model this small only slows down with more threads

    model = network_to_half(make_model(), dtype=dtype).to(device)
    torch.backends.cudnn.benchmark = True

    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=1e-4)
    optimizer = FP16_Optimizer(
        optimizer,
        static_loss_scale=args.static_loss_scale,
        dynamic_loss_scale=args.dynamic_loss_scale,
        dynamic_loss_args={"init_scale": args.init_scale, "scale_window": args.scale_window},
        verbose=False,
    )
    scaling = (f"dynamic loss scale from {args.init_scale:g}" if args.dynamic_loss_scale
               else f"static loss scale {args.static_loss_scale:g}")
    print(f"fp16_optimizer: {str(dtype).replace('torch.', '')} model with fp32 masters, "
          f"{scaling}, batch {args.batch_size}, on {device}", flush=True)

    batches = synthetic_batches(args.batch_size, device, args.seed)
    losses = []
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        images, target = next(batches)
        optimizer.zero_grad()
        output = model(images)                    # tofp16 casts the input
        loss = F.cross_entropy(output.float(), target)
        optimizer.backward(loss)
        optimizer.step()
        losses.append(loss.detach())
        if step % args.print_freq == 0 or step == args.steps:
            if device.type == "cuda":
                torch.cuda.synchronize()
            elapsed = time.perf_counter() - start
            # Reading the loss scale synchronises with the device: only when printing.
            print(f"step {step:4d}  loss {loss.item():.4f}  loss scale "
                  f"{optimizer.loss_scale:g}  {step * args.batch_size / elapsed:.0f} images/s",
                  flush=True)

    losses = torch.stack(losses).float().cpu()
    k = max(1, min(10, len(losses) // 3))
    first, last = losses[:k].mean().item(), losses[-k:].mean().item()
    print(f"mean loss of the first {k} steps {first:.4f}, of the last {k} {last:.4f}")

    if args.save:
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, args.save)
        checkpoint = torch.load(args.save, map_location=device, weights_only=True)
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        print(f"saved to and reloaded from {args.save} (loss scale {optimizer.loss_scale:g})")

    if not (math.isfinite(last) and last < first):
        print("FAIL: the loss did not fall", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
