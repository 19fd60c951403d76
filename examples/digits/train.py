"""Mixed precision side by side on scikit-learn's digits (the main job of ``make demo``).

Trains one small CNN on the 8x8 digits images (1797 samples, shipped inside
scikit-learn: nothing is downloaded) seven times from the same initial weights and in
the same batch order: in fp32 (``O0``) and through :mod:`mixedprec.amp` at ``O1``
(autocast) and ``O2`` (half model, fp32 master weights, batchnorm in fp32), each in
fp16 and in bf16, and twice with the whole model in bf16 through
:mod:`mixedprec.optim` (``bf16-none``: no masters; ``bf16-remainder``: an int16
remainder per weight that makes its fp32 master exact), whose precision report says how
many updates bf16 lost, per layer. Then it

* prints a table of test accuracy, loss, loss scale, skipped steps and time;
* writes ``OUT/results.json`` (every number, with the per-step histories),
  ``OUT/loss_curves.png`` (training loss, test accuracy and loss-scale history) and
  ``OUT/table.txt``;
* exits with status 1 when a run's test accuracy is more than ``--tolerance``
  points below fp32's, or a loss is not finite.

Usage::

    PYTHONPATH=. python examples/digits/train.py               # out: build/digits/
    PYTHONPATH=. python examples/digits/train.py --epochs 2 --runs fp32,O2-bf16

Runs on the GPU when there is one (``--device cpu`` to force the CPU). fp16 matmuls
and convolutions are slow on CPUs (no fp16 kernels), which is why the model is tiny.
"""

import argparse
import json
import logging
import math
import os
import platform
import sys
import time
from typing import Any, Dict, List

import torch
from torch import nn
from torch.nn import functional as F

try:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
except ImportError as err:  # pragma: no cover - depends on the environment
    sys.exit(f"examples/digits needs scikit-learn ({err}); make demo installs it into .venv")

import mixedprec
from mixedprec import amp

# name -> (opt level, cast_model_type). At O1 the weights stay fp32 and
# cast_model_type picks the autocast dtype (None: fp16); at O2 it is the model's dtype.
RUNS = {
    "fp32": ("O0", None),
    "O1-fp16": ("O1", None),
    "O1-bf16": ("O1", torch.bfloat16),
    "O2-fp16": ("O2", None),
    "O2-bf16": ("O2", torch.bfloat16),
}
# The runs of a bf16 model through mixedprec.optim (no amp), by their master mode.
LEAN_RUNS = {"bf16-none": "none", "bf16-remainder": "remainder"}
RUNS.update({name: (master, torch.bfloat16) for name, master in LEAN_RUNS.items()})
DTYPE_NAMES = {"fp32": "float32", "O1-fp16": "float16", "O1-bf16": "bfloat16",
               "O2-fp16": "float16", "O2-bf16": "bfloat16", "bf16-none": "bfloat16",
               "bf16-remainder": "bfloat16"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="build/digits", help="output directory (default: %(default)s)")
    p.add_argument("--epochs", type=int, default=12, help="epochs per run (default: %(default)s)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--optimizer", choices=("fused-sgd", "fused-adam", "sgd"), default="fused-sgd",
                   help="mixedprec.FusedSGD / FusedAdam (fp32 masters in the optimizer, no "
                        "host sync) or torch.optim.SGD (amp keeps the masters)")
    p.add_argument("--runs", default=",".join(RUNS),
                   help="comma-separated subset of: " + ", ".join(RUNS))
    p.add_argument("--tolerance", type=float, default=3.0,
                   help="largest allowed drop of test accuracy below fp32's, in points")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads (default: %(default)s; more only slow a model this small "
                        "down, and a lot on a busy machine; 0: torch's default)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG (no matplotlib needed)")
    args = p.parse_args(argv)
    args.runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = [r for r in args.runs if r not in RUNS]
    if unknown or not args.runs:
        p.error(f"--runs: unknown run(s) {unknown}; choose from {', '.join(RUNS)}")
    if args.epochs < 1:
        p.error("--epochs must be >= 1")
    return args


class DigitsNet(nn.Sequential):
    """Two 3x3 convolutions with batchnorm (which O2 keeps in fp32) and a linear head:
    3866 parameters: a few milliseconds a step on a CPU in fp32 or bf16, a few tens
    in fp16 (CPUs have no fast fp16 kernels)."""

    def __init__(self):
        super().__init__(
            nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
            nn.MaxPool2d(2),                                     # 8 x 4 x 4
            nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
            nn.Flatten(),
            nn.Linear(16 * 4 * 4, 10),
        )


def load_data(seed: int, device: torch.device):
    """Stratified 80/20 split, standardised with the training set's statistics."""
    digits = load_digits()
    x = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0  # N,1,8,8
    y = torch.tensor(digits.target, dtype=torch.int64)
    idx_train, idx_test = train_test_split(
        list(range(len(y))), test_size=0.2, random_state=seed, stratify=digits.target)
    x_train, x_test = x[idx_train], x[idx_test]
    mean, std = x_train.mean(), x_train.std()
    x_train, x_test = (x_train - mean) / std, (x_test - mean) / std
    return (x_train.to(device), y[idx_train].to(device),
            x_test.to(device), y[idx_test].to(device))


def make_optimizer(name: str, params, lr: float, master=None) -> torch.optim.Optimizer:
    if master is not None:  # a lean run: mixedprec.optim with the precision report
        if name == "fused-adam":
            return mixedprec.optim.AdamW(params, lr=lr / 25, weight_decay=5e-4, master=master,
                                         precision_report=True)
        return mixedprec.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=5e-4,
                                   master=master, precision_report=True)
    if name == "fused-sgd":
        return mixedprec.FusedSGD(params, lr=lr, momentum=0.9, weight_decay=5e-4)
    if name == "fused-adam":
        return mixedprec.FusedAdam(params, lr=lr / 25, weight_decay=5e-4)
    return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=5e-4)


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 512):
    model.eval()
    loss_sum = torch.zeros((), device=x.device)
    correct = torch.zeros((), device=x.device, dtype=torch.int64)
    dtype = next(model.parameters()).dtype
    for i in range(0, len(y), batch_size):
        out = model(x[i:i + batch_size].to(dtype)).float()
        loss_sum += F.cross_entropy(out, y[i:i + batch_size], reduction="sum")
        correct += (out.argmax(1) == y[i:i + batch_size]).sum()
    model.train()
    return loss_sum.item() / len(y), 100.0 * correct.item() / len(y)


def train_one(name: str, args: argparse.Namespace, data, device: torch.device) -> Dict[str, Any]:
    opt_level, cast_model_type = RUNS[name]
    lean = name in LEAN_RUNS
    x_train, y_train, x_test, y_test = data
    torch.manual_seed(args.seed)  # the same initial weights for every run
    model = DigitsNet().to(device)
    if lean:  # the whole model in bf16, mixedprec.optim without amp (no loss scale)
        model = model.to(torch.bfloat16)
        optimizer = make_optimizer(args.optimizer, model.parameters(), args.lr, opt_level)
    else:
        optimizer = make_optimizer(args.optimizer, model.parameters(), args.lr)
        # overflow_report=True: overflows are counted per layer on the device
        # (amp.overflow_report reads them, below, once a run), and summarised in one log
        # line at exit.
        model, optimizer = amp.initialize(model, optimizer, opt_level=opt_level,
                                          cast_model_type=cast_model_type, verbosity=1,
                                          overflow_report=True)

    step_loss: List[float] = []
    loss_scale: List[float] = []  # after each step
    initial_scale = 1.0 if lean else amp.state_dict()["loss_scaler0"]["loss_scale"]
    epoch_train_loss, epoch_test_loss, epoch_test_acc = [], [], []
    train_time = 0.0
    n = len(y_train)
    for epoch in range(args.epochs):
        order = torch.randperm(n, generator=torch.Generator().manual_seed(args.seed + epoch))
        order = order.to(device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        losses = []
        for i in range(0, n, args.batch_size):
            batch = order[i:i + args.batch_size]
            out = model(x_train[batch].to(cast_model_type) if lean else x_train[batch])
            # At O1 the logits come out of autocast in fp16/bf16; the loss is taken in
            # fp32 (as Apex's O1, which patched cross_entropy to fp32, did).
            loss = F.cross_entropy(out.float(), y_train[batch])
            optimizer.zero_grad()
            if lean:
                loss.backward()
                optimizer.step()
                loss_scale.append(1.0)
            else:
                with amp.scale_loss(loss, optimizer) as scaled_loss:
                    scaled_loss.backward()
                optimizer.step()
                # The history reads the scale on the host every step (amp.state_dict
                # synchronises); a real loop would read it every few hundred steps.
                loss_scale.append(amp.state_dict()["loss_scaler0"]["loss_scale"])
            losses.append(loss.detach())
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        train_time += time.perf_counter() - start
        losses = torch.stack(losses).float().tolist()
        step_loss += losses
        epoch_train_loss.append(sum(losses) / len(losses))
        test_loss, test_acc = evaluate(model, x_test, y_test)
        epoch_test_loss.append(test_loss)
        epoch_test_acc.append(test_acc)

    # Skipped steps and the layers whose gradients overflowed, counted on the device
    # (amp's runs); the updates bf16 lost, per layer (the lean runs' precision report).
    report = {"skipped": 0, "overflows": {}} if lean else amp.overflow_report(scale=False)
    skipped = report["skipped"]
    steps = len(step_loss)
    precision = None
    if lean:
        precision = {"summary": optimizer.precision_report.summary(model),
                     "layers": optimizer.precision_report.report(model)}
    return {
        "name": name,
        "opt_level": opt_level,
        "dtype": DTYPE_NAMES[name],
        "test_accuracy": epoch_test_acc[-1],
        "test_loss": epoch_test_loss[-1],
        "train_loss": epoch_train_loss[-1],
        "loss_scale_initial": initial_scale,
        "loss_scale_final": loss_scale[-1],
        "skipped_steps": skipped,
        "overflows": report["overflows"],  # {parameter name: steps it overflowed}
        "precision": precision,  # the lean runs' precision report, else None
        "steps": steps,
        "train_time_s": train_time,
        "ms_per_step": 1000.0 * train_time / steps,
        "history": {
            "step_loss": step_loss,
            "loss_scale": loss_scale,
            "epoch_train_loss": epoch_train_loss,
            "epoch_test_loss": epoch_test_loss,
            "epoch_test_accuracy": epoch_test_acc,
        },
    }


def check(results: List[Dict[str, Any]], tolerance: float) -> List[str]:
    """What fails the job: non-finite losses, accuracy far below fp32's."""
    failures = []
    for r in results:
        if not all(math.isfinite(v) for v in r["history"]["step_loss"] + [r["test_loss"]]):
            failures.append(f"{r['name']}: a loss is not finite")
    ref = next((r for r in results if r["name"] == "fp32"), None)
    if ref is not None:
        for r in results:
            drop = ref["test_accuracy"] - r["test_accuracy"]
            if drop > tolerance:
                failures.append(f"{r['name']}: test accuracy {r['test_accuracy']:.2f}% is "
                                f"{drop:.2f} points below fp32's {ref['test_accuracy']:.2f}% "
                                f"(tolerance {tolerance:g})")
    return failures


def table(results: List[Dict[str, Any]]) -> str:
    ref = next((r for r in results if r["name"] == "fp32"), None)
    head = ("run", "opt", "dtype", "test acc %", "vs fp32", "test loss", "train loss",
            "loss scale", "skipped", "ms/step", "time s")
    rows = []
    for r in results:
        delta = "" if ref is None else f"{r['test_accuracy'] - ref['test_accuracy']:+.2f}"
        rows.append((r["name"], r["opt_level"], r["dtype"], f"{r['test_accuracy']:.2f}", delta,
                     f"{r['test_loss']:.4f}", f"{r['train_loss']:.4f}",
                     f"{r['loss_scale_final']:g}", f"{r['skipped_steps']}/{r['steps']}",
                     f"{r['ms_per_step']:.1f}", f"{r['train_time_s']:.1f}"))
    widths = [max(len(str(c)) for c in col) for col in zip(head, *rows)]
    fmt = lambda row: "  ".join(str(c).rjust(w) if i >= 3 else str(c).ljust(w)  # noqa: E731
                                for i, (c, w) in enumerate(zip(row, widths)))
    lines = [fmt(head), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows]
    return "\n".join(lines)


def plot(results: List[Dict[str, Any]], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    fig, (ax_loss, ax_acc, ax_scale) = plt.subplots(1, 3, figsize=(16, 4.5))
    styles = ["-", "--", "-.", ":", (0, (5, 1))]
    for k, r in enumerate(results):
        h = r["history"]
        style = dict(label=r["name"], linestyle=styles[k % len(styles)])
        window = min(10, len(h["step_loss"]))
        smooth = np.convolve(h["step_loss"], np.ones(window) / window, mode="valid")
        ax_loss.plot(range(window, len(h["step_loss"]) + 1), smooth, **style)
        epochs = range(1, len(h["epoch_test_accuracy"]) + 1)
        ax_acc.plot(epochs, h["epoch_test_accuracy"], marker="o", markersize=3, **style)
        scale = [r["loss_scale_initial"]] + h["loss_scale"]  # step 0: before training
        ax_scale.step(range(len(scale)), scale, where="post", linewidth=1.5 + 0.5 * k, **style)
    ax_loss.set(title="training loss (10-step mean)", xlabel="step", ylabel="cross entropy",
                yscale="log")
    ax_acc.set(title="test accuracy", xlabel="epoch", ylabel="%")
    ax_acc.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax_scale.set(title="loss scale", xlabel="step", ylabel="scale (log2 axis)")
    ax_scale.set_yscale("log", base=2)
    for ax in (ax_loss, ax_acc, ax_scale):
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    # amp reports skipped steps through logging (logger "mixedprec.amp").
    logging.basicConfig(format="  %(name)s: %(message)s", level=logging.WARNING)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = False
        torch.backends.cudnn.deterministic = True
    os.makedirs(args.out, exist_ok=True)

    data = load_data(args.seed, device)
    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        where = platform.processor() or platform.machine() or "cpu"
    print(f"digits: {len(data[1])} train / {len(data[3])} test images, {args.epochs} epochs, "
          f"batch {args.batch_size}, {args.optimizer}, on {device} ({where})", flush=True)

    results = []
    for name in args.runs:
        r = train_one(name, args, data, device)
        top = ", ".join(f"{k} {v}" for k, v in list(r["overflows"].items())[:3]) or "none"
        print(f"  {name:8s} test acc {r['test_accuracy']:6.2f}%  loss {r['test_loss']:.4f}  "
              f"scale {r['loss_scale_final']:g}  skipped {r['skipped_steps']}/{r['steps']} "
              f"(overflows: {top})  {r['train_time_s']:.1f}s", flush=True)
        if r["precision"] is not None:
            print(f"  {'':8s} {r['precision']['summary']}", flush=True)
        results.append(r)

    failures = check(results, args.tolerance)
    text = table(results)
    print("\n" + text + "\n")
    with open(os.path.join(args.out, "table.txt"), "w") as f:
        f.write(text + "\n")
    meta = {
        "config": {k: getattr(args, k) for k in ("epochs", "batch_size", "lr", "optimizer",
                                                  "seed", "tolerance", "runs")},
        "device": str(device), "device_name": where,
        "torch": torch.__version__, "mixedprec": mixedprec.__version__,
        "check": {"passed": not failures, "failures": failures},
        "runs": results,
    }
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(meta, f, indent=1)
    written = ["table.txt", "results.json"]
    if not args.no_plot:
        plot(results, os.path.join(args.out, "loss_curves.png"),
             f"digits CNN, {args.optimizer}, {device}")
        written.append("loss_curves.png")
    print(f"wrote {', '.join(os.path.join(args.out, w) for w in written)}")

    if failures:
        print("FAIL:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    print(f"PASS: every run within {args.tolerance:g} points of fp32's test accuracy"
          if any(r["name"] == "fp32" for r in results) else "PASS: all losses finite")
    return 0


if __name__ == "__main__":
    sys.exit(main())
