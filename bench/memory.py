"""Peak bytes per parameter of a whole training step (issue 32, part 3): weights,
gradients and optimizer state, activations apart, on a GPT-2-style decoder.

Configurations, in this order, each on its own model built from the same seed and fed
the same batches:

1. ``torch-fp32``: ``torch.optim.AdamW`` (its default implementation: for-loop on the
   CPU, foreach on CUDA) on an fp32 model;
2. ``torch-bf16``: ``torch.optim.AdamW`` on a bf16 model (bf16 params and moments);
3. ``fp32-masters``: ``mixedprec.optim.AdamW``, bf16 model, ``master="fp32"`` (fp32
   masters and moments);
4. ``remainder-8bit``: ``master="remainder"``, ``state_dtype=torch.float8_e4m3fn``
   (bf16 params, int16 remainders, 8-bit moments with a scale byte per 32 elements);
5. ``remainder-8bit-in-backward``: the same with ``mixedprec.optim.in_backward(opt)``
   (each bucket steps inside backward and its gradients are freed);

and, for comparison, ``fp32-masters-8bit`` (``master="fp32"`` with the same 8-bit
moments and seed).

Exact: a remainder run (4 and 5) carries a reference in lockstep, ``master="fp32"`` with
the same state dtype and seed over its own copy of the initial parameters, stepped after
each of the run's steps on that step's gradients (copied to the host from the gradient
hook); after every step each ``mixedprec.masters.join_remainder(p, state["remainder"])``
must be bit-identical to the reference's ``state["master_param"]``. The same gradients
are needed: the remainder mode's bf16 parameter rounds an exact tie away from zero, not
to even (docs/lean-precision.md, "Remainders"), so two separate runs feed their forwards
bf16 weights that differ at a few ties, and their gradients, then masters, part after
the first step. The report also counts the bf16 parameters that differ from the
reference's, and those that differ elsewhere than at a tie (must be 0).

Method. Every run takes ``--steps`` training steps (the first creates the optimizer
state); the last one is measured, from the storages (each storage once):

* weights: the parameters' storages (the tied LM head counted once);
* state: every tensor in ``optimizer.state`` and the param groups (0-dim step counts
  included, a step tensor shared by parameters once);
* gradients: the peak of the live ``.grad`` storages during the step, seen by a
  post-accumulate-grad hook on every parameter registered before ``in_backward`` (so it
  runs first and sees the gradient just accumulated and every one not yet freed), and
  at ``step()`` for the ordinary configurations;
* total = weights + gradients + state; per parameter: over the parameter count (tied
  weights once);
* activations (apart): the storages saved for backward during the forward
  (``saved_tensors_hooks``), the parameters' own left out;
* step peak (tracked): the peak of every live storage during the step: those there
  before it (weights, state, the batch) plus those the step's dispatched ops create
  (a ``TorchDispatchMode`` holding weak references; kernels' internal scratch is not
  seen). It includes what the components leave out: activations, temporaries, and
  gradients autograd holds before they reach ``.grad`` (the tied embedding's partial
  gradient from the LM head, held from the start of backward to its end).

On CUDA the same numbers are reported beside ``torch.cuda.max_memory_allocated`` over
the measured step (``reset_peak_memory_stats`` before it): "CUDA peak" is the weights
and state plus what the step allocated above ``memory_allocated()`` at its start (so
that the batch and a remainder run's lockstep reference, also on the device, are left
out), and "activations (CUDA)" that peak less weights + gradients + state.

The in-backward gradient peak cannot be below the largest bucket's gradients; buckets
(``--bucket-cap-mb``) default to one block's bf16 gradients (24 MiB at GPT-2-medium's
size, about torch DDP's 25 MiB), and the tied token embedding, the largest tensor, is
then a bucket of its own that steps last (its gradient is complete only after the
embedding's backward). So the peak is about that embedding's share of the parameters
times 2 bytes: the default model keeps GPT-2-medium's share (14%); ``--preset
gpt2-small`` (31%) or ``gpt2-medium`` takes their real shapes.

    python bench/memory.py                           # default model, ~1 min on 2 cores
    python bench/memory.py --preset gpt2-medium --seq 32 --batch 1   # CPU: ~10 min
    python bench/memory.py --quick                   # smoke run (tiny model)

Outputs ``memory-<device>.{json,md}`` (``memory-<device>-<preset>`` with ``--preset``
gpt2-small or gpt2-medium) in bench/results (or ``--out``; the smoke run in
bench/results/cpu-smoke).
"""

import argparse
import gc
import hashlib
import importlib.util
import sys
import time
import weakref
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _load(name: str):
    module_name = f"mixedprec_bench_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name,
                                                      Path(__file__).with_name(f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


C = _load("common")
C.ensure_importable()

FP8 = torch.float8_e4m3fn
# name -> (label, param dtype, optimizer: "torch" or mixedprec's master mode, state
# dtype, step inside backward)
CONFIGS: Dict[str, tuple] = {
    "torch-fp32": ("torch AdamW, fp32 model", torch.float32, "torch", None, False),
    "torch-bf16": ("torch AdamW, bf16 model", torch.bfloat16, "torch", None, False),
    "fp32-masters": ("mixedprec AdamW, fp32 masters", torch.bfloat16, "fp32",
                     torch.float32, False),
    "remainder-8bit": ("mixedprec AdamW, remainder + 8-bit", torch.bfloat16, "remainder",
                       FP8, False),
    "remainder-8bit-in-backward": ("mixedprec AdamW, remainder + 8-bit, in backward",
                                   torch.bfloat16, "remainder", FP8, True),
}
REFERENCE = "fp32-masters-8bit"
REFERENCE_CONFIG = ("mixedprec AdamW, fp32 masters + 8-bit (comparison)", torch.bfloat16,
                    "fp32", FP8, False)
LEAN = ("remainder-8bit", "remainder-8bit-in-backward")
TARGET_CONFIG = "remainder-8bit-in-backward"
TARGET_BPP = 6.5

# vocab, positions, width, blocks, heads
PRESETS = {
    "default": dict(vocab=4096, ctx=256, d_model=256, layers=8, heads=8),
    "gpt2-small": dict(vocab=50257, ctx=1024, d_model=768, layers=12, heads=12),
    "gpt2-medium": dict(vocab=50257, ctx=1024, d_model=1024, layers=24, heads=16),
    "quick": dict(vocab=512, ctx=32, d_model=64, layers=2, heads=2),
}
RUN = dict(seq=64, batch=2, steps=3, lr=1e-3, seed=0)  # (bf16 matmuls are slow on CPUs)
QUICK_RUN = dict(seq=None, batch=2, steps=3, lr=1e-3, seed=0)  # seq None: the context


# --- the model -------------------------------------------------------------------------

def make_model(vocab: int, ctx: int, d_model: int, layers: int, heads: int) -> nn.Module:
    """bench/train.py's GPT-2-shaped decoder (token and position embeddings, blocks, a
    final LayerNorm, the LM head tied to the token embedding) at these sizes."""
    if d_model % heads:
        raise ValueError(f"d_model {d_model} is not a multiple of heads {heads}")
    return _load("train").CausalLM(vocab=vocab, seq=ctx, layers=layers, d=d_model,
                                   heads=heads)


def block_bucket_mb(model: nn.Module) -> float:
    """One block's gradients in bf16, in MiB: the default bucket of the in-backward run."""
    return sum(p.numel() for p in model.blocks[0].parameters()) * 2 / 2**20


# --- measuring -----------------------------------------------------------------------

def storages_bytes(tensors, seen: Optional[set] = None) -> int:
    seen = set() if seen is None else seen
    return sum(C.storage_bytes(t, seen) for t in tensors)


def state_tensors(opt) -> List[torch.Tensor]:
    """Every tensor of the optimizer's state and of its param groups (not the params)."""
    out = [v for st in opt.state.values() for v in tree_leaves(st)
           if isinstance(v, torch.Tensor)]
    out += [v for group in opt.param_groups for k, g in group.items() if k != "params"
            for v in tree_leaves(g) if isinstance(v, torch.Tensor)]
    return out


class GradPeak:
    """The peak bytes of live ``.grad`` storages, from a post-accumulate-grad hook on
    every parameter (registered before in_backward's, so it runs first and sees the
    gradient just accumulated and every one not yet freed). ``on_grad(index, grad)``, when
    set, is called from the same hook (the lockstep reference's copy of the gradient)."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self.params = list(params)
        self.index = {id(p): i for i, p in enumerate(self.params)}
        self.peak = 0
        self.on = False
        self.on_grad = None
        self.handles = [p.register_post_accumulate_grad_hook(self._hook) for p in self.params]

    def live(self) -> int:
        return storages_bytes(p.grad for p in self.params if p.grad is not None)

    def _hook(self, p) -> None:
        if self.on:
            self.peak = max(self.peak, self.live())
        if self.on_grad is not None:
            self.on_grad(self.index[id(p)], p.grad)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class SavedBytes:
    """saved_tensors_hooks: the bytes of the storages saved for backward, each once, the
    parameters' own left out."""

    def __init__(self, params: Sequence[torch.Tensor]):
        self.seen = {p.untyped_storage().data_ptr() for p in params}
        self.bytes = 0

    def pack(self, t):
        self.bytes += C.storage_bytes(t, self.seen)
        return t

    @staticmethod
    def unpack(t):
        return t


class LiveStorages(TorchDispatchMode):
    """The peak of the bytes of live storages that the dispatched ops create (weak
    references; a storage there before, ``known``, is not counted), and the phase
    (``phase``, set by the caller) it was reached in. Ops run while ``paused`` are not
    counted (the lockstep reference's gradient copies)."""

    def __init__(self, known: Sequence[torch.Tensor]):
        super().__init__()
        self.known = {id(t.untyped_storage()) for t in known}
        self._keep = [t.untyped_storage() for t in known]  # (their ids stay theirs)
        self.refs: Dict[int, Any] = {}
        self.live = 0
        self.peak = 0
        self.phase = ""
        self.peak_phase = ""
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.paused:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.device.type != "meta":
                    self._add(t.untyped_storage())
        return out

    def _add(self, st) -> None:
        key = id(st)
        if key in self.known or key in self.refs or st.nbytes() == 0:
            return
        size = st.nbytes()

        def gone(_, key=key, size=size):
            if self.refs.pop(key, None) is not None:
                self.live -= size

        self.refs[key] = weakref.ref(st, gone)
        self.live += size
        if self.live > self.peak:
            self.peak, self.peak_phase = self.live, self.phase


class Lockstep:
    """The exactness check of a remainder run: a reference optimizer (``master="fp32"``,
    the same state dtype and seed) over its own copy of the initial parameters, stepped
    after each of the run's steps on that step's gradients (copied to the host from the
    gradient hook as each is accumulated, before in_backward frees it), so that both
    optimizers see the same gradients (the two models' bf16 copies part at exact ties,
    docs/lean-precision.md, so their own trajectories would part too). After every step:
    ``join_remainder(p, state["remainder"])`` against the reference's
    ``state["master_param"]``, bit for bit, and the bf16 parameters, which may differ
    only where the master's low half is exactly 0x8000 (a tie)."""

    def __init__(self, params, state_dtype, run):
        from mixedprec.optim import AdamW

        self.params = params
        self.ref = [p.detach().clone().requires_grad_() for p in params]
        seeded = dict(seed=run["seed"]) if state_dtype == FP8 else {}
        self.opt = AdamW(self.ref, lr=run["lr"], master="fp32", state_dtype=state_dtype,
                         **seeded)
        self.grads: Dict[int, torch.Tensor] = {}
        self.tracker: Optional[LiveStorages] = None
        self.steps = 0
        self.differ = 0  # fp32 elements whose bits differ, over all steps
        self.tensors_differ: set = set()
        self.params_differ = 0  # bf16 parameters that differ (at the last step)
        self.params_differ_off_ties = 0  # ... where the master is no tie (over all steps)

    def on_grad(self, index: int, grad: torch.Tensor) -> None:
        if self.tracker is not None:
            self.tracker.paused = True
        try:
            self.grads[index] = grad.detach().to("cpu", copy=True)
        finally:
            if self.tracker is not None:
                self.tracker.paused = False

    def step(self, lean_opt, names) -> None:
        from mixedprec.masters import join_remainder

        for i, q in enumerate(self.ref):
            q.grad = self.grads.pop(i).to(q.device) if i in self.grads else None
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.steps += 1
        self.params_differ = 0
        for name, p, q in zip(names, self.params, self.ref):
            joined = join_remainder(p, lean_opt.state[p]["remainder"])
            master = self.opt.state[q]["master_param"]
            n = _bits_differ(joined, master)
            if n:
                self.differ += n
                self.tensors_differ.add(name)
            off = p.detach().view(torch.int16) != q.detach().view(torch.int16)
            self.params_differ += int(off.sum())
            tie = (master.view(torch.int32) & 0xFFFF) == 0x8000
            self.params_differ_off_ties += int((off & ~tie).sum())

    def report(self) -> Dict[str, Any]:
        return dict(exact=self.steps > 0 and self.differ == 0, steps=self.steps,
                    elements_differ=self.differ, tensors_differ=sorted(self.tensors_differ),
                    bf16_params_differ=self.params_differ,
                    bf16_params_differ_off_ties=self.params_differ_off_ties)


def _digest(tensors) -> str:
    """sha256 of the tensors' bytes, in order (in-backward against step(), bit for bit)."""
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _bits_differ(a: torch.Tensor, b: torch.Tensor) -> int:
    """The number of elements whose fp32 bits differ."""
    return int((a.contiguous().view(torch.int32) != b.contiguous().view(torch.int32)).sum())


def run_config(name: str, spec: tuple, model_cfg: Dict[str, int], run: Dict[str, Any],
               batches, device: torch.device, bucket_cap_mb: Optional[float],
               log) -> Dict[str, Any]:
    """One configuration: ``run["steps"]`` steps, the last measured. Returns its row."""
    from mixedprec.masters import join_remainder
    from mixedprec.optim import AdamW, in_backward

    label, dtype, master, state_dtype, inside = spec
    t0 = time.time()
    torch.manual_seed(run["seed"])
    model = make_model(**model_cfg).to(device=device, dtype=dtype)
    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    numel = sum(p.numel() for p in params)
    if master == "torch":
        opt = torch.optim.AdamW(params, lr=run["lr"])
    else:
        seeded = dict(seed=run["seed"]) if state_dtype == FP8 else {}  # (8-bit rounding)
        opt = AdamW(params, lr=run["lr"], master=master, state_dtype=state_dtype, **seeded)
    grads = GradPeak(params)  # (before in_backward's hooks)
    lockstep = Lockstep(params, state_dtype, run) if master == "remainder" else None
    if lockstep is not None:
        grads.on_grad = lockstep.on_grad
    cap = bucket_cap_mb if bucket_cap_mb is not None else block_bucket_mb(model)
    handle = in_backward(opt, bucket_cap_mb=cap) if inside else None
    losses = []
    r: Dict[str, Any] = dict(label=label, params=numel, tensors=len(params),
                             param_dtype=str(dtype).replace("torch.", ""),
                             optimizer="torch.optim.AdamW" if master == "torch" else
                             "mixedprec.optim.AdamW", master=None if master == "torch"
                             else master, state_dtype=str(state_dtype or dtype).replace(
                                 "torch.", ""), in_backward=inside)
    if inside:
        r["buckets"] = len(handle.buckets)
        r["bucket_cap_mb"] = cap
    cuda = device.type == "cuda"
    for step, (x, y) in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        if step < len(batches) - 1:
            loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
            loss.backward()
            if not inside:
                opt.step()
            losses.append(loss.item())
            del loss
            if lockstep is not None:
                lockstep.step(opt, names)
            continue
        # The measured step.
        gc.collect()
        weights = storages_bytes(params)
        state_before = storages_bytes(state_tensors(opt))
        saved = SavedBytes(params)
        tracker = LiveStorages(params + state_tensors(opt) + [x, y])
        if lockstep is not None:
            lockstep.tracker = tracker
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            cuda_base = torch.cuda.memory_allocated(device)
        grads.peak, grads.on = 0, True
        with tracker:
            tracker.phase = "forward"
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                loss = F.cross_entropy(model(x).float().flatten(0, 1), y.flatten())
            tracker.phase = "backward"
            loss.backward()
            at_step = grads.live()
            tracker.phase = "step"
            if not inside:
                opt.step()
        grads.on = False
        if cuda:
            torch.cuda.synchronize(device)
            r["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
            r["cuda_allocated_before_bytes"] = cuda_base
        losses.append(loss.item())
        del loss
        if lockstep is not None:
            lockstep.tracker = None
            lockstep.step(opt, names)
        state = storages_bytes(state_tensors(opt))
        peak_grads = max(grads.peak, at_step)
        r.update(weights_bytes=weights, grads_bytes=peak_grads, state_bytes=state,
                 state_bytes_before=state_before, grads_after_backward_bytes=at_step,
                 activations_bytes=saved.bytes,
                 tracked_peak_bytes=weights + state_before + tracker.peak,
                 tracked_peak_phase=tracker.peak_phase)
        r["total_bytes"] = weights + peak_grads + state
        if cuda:
            # What the step allocated above what was there at its start, on top of the
            # model's weights and state (the start also holds the batch, and in a remainder
            # run the lockstep reference's copy, which are not the model's).
            r["cuda_peak_bytes"] = weights + state_before + (
                r["cuda_max_allocated_bytes"] - cuda_base)
            r["cuda_activations_bytes"] = r["cuda_peak_bytes"] - r["total_bytes"]
    for key in ("weights", "grads", "state", "total", "activations", "tracked_peak",
                "cuda_peak", "cuda_activations"):
        if f"{key}_bytes" in r:
            r[f"{key}_bpp"] = r[f"{key}_bytes"] / numel
    r["losses"] = losses
    if lockstep is not None:
        r["exact"] = lockstep.report()
        r["fp32_sha256"] = _digest(join_remainder(p, opt.state[p]["remainder"])
                                   for p in params)
    if handle is not None:
        handle.remove()
    grads.remove()
    del model, opt, params, handle, lockstep
    C.free_memory()
    r["wall_s"] = time.time() - t0
    log(f"  {name}: {C.fmt(r['total_bpp'])} B/param (weights {C.fmt(r['weights_bpp'])}, "
        f"grads {C.fmt(r['grads_bpp'])}, state {C.fmt(r['state_bpp'])}), activations "
        f"{C.fmt(r['activations_bpp'])}" + (
            f", exact {'yes' if r['exact']['exact'] else 'no'}" if "exact" in r else "")
        + f", {r['wall_s']:.1f} s")
    return r


# --- report --------------------------------------------------------------------------

def _b(r: Dict[str, Any], key: str) -> str:
    return C.fmt(r.get(f"{key}_bpp"))


def markdown(data: Dict[str, Any]) -> str:
    env, cfg, res = data["env"], data["config"], data["results"]
    cuda = env.get("device_type") == "cuda"
    m = cfg["model"]
    lines = ["# Memory per parameter of a training step (bench/memory.py)", ""]
    lines += C.env_lines(env, data["smoke"])
    lines += [f"- CPU: {env.get('cpu_model')}, {env.get('cpu_count')} cores visible, "
              f"flags {' '.join(env.get('cpu_flags') or [])}; {cfg['threads']} torch threads",
              f"- model ({cfg['preset']}): GPT-2-style, vocab {m['vocab']}, context "
              f"{m['ctx']}, width {m['d_model']}, {m['layers']} blocks, {m['heads']} heads, "
              f"LM head tied; {cfg['params']:,} parameters in {cfg['tensors']} tensors; the "
              f"largest (token embedding) {100 * cfg['largest_share']:.1f}% of them",
              f"- batch {cfg['batch']} x {cfg['seq']} tokens, {cfg['steps']} steps (the last "
              f"measured), AdamW lr {cfg['lr']}, seed {cfg['seed']}; in-backward buckets of "
              f"{C.fmt(cfg['bucket_cap_mb'], 3)} MiB ({cfg.get('buckets')} buckets)", ""]
    header = ["config", "weights", "grads (peak)", "state", "**total**", "activations",
              "step peak (tracked)"]
    if cuda:
        header += ["CUDA peak", "activations (CUDA)"]
    header += ["exact vs fp32 masters"]
    rows = []
    for i, (name, r) in enumerate(res.items()):
        exact = r.get("exact")
        mark = "" if exact is None else (
            "yes" if exact["exact"] else f"no ({exact['elements_differ']:,} elements)")
        label = f"{i + 1}. {r['label']}" if name != REFERENCE else r["label"]
        row = [label, _b(r, "weights"), _b(r, "grads"), _b(r, "state"),
               f"**{_b(r, 'total')}**", _b(r, "activations"),
               f"{_b(r, 'tracked_peak')} ({r.get('tracked_peak_phase')})"]
        if cuda:
            row += [_b(r, "cuda_peak"), _b(r, "cuda_activations")]
        rows.append(row + [mark])
    lines += ["Bytes per parameter:", ""] + C.md_table(header, rows) + [""]
    t = data["target"]
    lines += [f"**Target (issue 32): {t['config']} at <= {TARGET_BPP} B/param of weights + "
              f"grads + state, exact against fp32 masters: {C.fmt(t['total_bpp'])} B/param, "
              f"exact: {'yes' if t['exact'] else 'no'} -> "
              f"{'met' if t['met'] else 'missed'}.**", ""]
    lines += [
        "weights: the parameters' storages; state: every tensor of optimizer.state and the "
        "param groups (step counts included, a shared one once); grads (peak): the most "
        "bytes of live `.grad` tensors during the measured step (a post-accumulate-grad "
        "hook on every parameter, registered before in_backward's, and at step()); total = "
        "weights + grads + state. activations: the storages saved for backward in the "
        "forward (parameters left out). step peak (tracked): the peak of all live storages "
        "over the step (those there before it plus those its ops create; in brackets the "
        "phase it was reached in), which also holds activations, temporaries and gradients "
        "autograd holds before they reach `.grad` (the tied embedding's LM-head part, all "
        "through backward)." + (
            " CUDA peak: weights + state + what the step allocated above "
            "torch.cuda.memory_allocated() at its start (torch.cuda.max_memory_allocated); "
            "activations (CUDA): "
            "that less the total." if cuda else
            " CPU: counted from the storages, not from an allocator; CUDA figures "
            "(max_memory_allocated) at the next GPU run."),
        "",
        "exact: after each of the run's steps, `join_remainder(p, state['remainder'])` of "
        "every parameter bit-identical to the `state['master_param']` of a reference "
        "(master='fp32', the same 8-bit moments and seed) stepped in lockstep on the same "
        "gradients. Two separate runs would part: the remainder's bf16 parameter rounds an "
        "exact tie away from zero, fp32 masters' copy to even, so the forwards differ at a "
        "few weights after the first step. bf16 parameters different from the reference's "
        "at the last step: " + ", ".join(
            f"{res[n]['exact']['bf16_params_differ']} ({n})" for n in LEAN
            if "exact" in res.get(n, {})) + "; elsewhere than at an exact tie: " + ", ".join(
            f"{res[n]['exact']['bf16_params_differ_off_ties']}" for n in LEAN
            if "exact" in res.get(n, {})) + "."]
    same = res.get(TARGET_CONFIG, {}).get("same_as_step")
    if same is not None:
        lines += ["", f"In backward against step() (5 against 4): the same losses and final "
                      f"fp32 masters bit for bit: {'yes' if same else 'no'}."]
    if data.get("note"):
        lines += ["", data["note"]]
    return "\n".join(lines) + "\n"


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: a tiny model, seconds")
    p.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    p.add_argument("--out", help="output directory (default bench/results, "
                                 "bench/results/cpu-smoke with --quick)")
    p.add_argument("--preset", choices=[k for k in PRESETS if k != "quick"],
                   help="model shape (default: 'default'; --quick: a tiny one)")
    for key in ("vocab", "ctx", "d_model", "layers", "heads"):
        p.add_argument(f"--{key.replace('_', '-')}", type=int, help="overrides the preset's")
    p.add_argument("--seq", type=int, help="tokens per sequence (default: the context)")
    p.add_argument("--batch", type=int, help=f"sequences per batch (default {RUN['batch']})")
    p.add_argument("--steps", type=int,
                   help=f"training steps, the last measured (default {RUN['steps']}, >= 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket-cap-mb", type=float,
                   help="in_backward's bucket cap (default: one block's bf16 gradients)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (default 2)")
    p.add_argument("--note", help="a sentence added to the report")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        with C.collecting_only_new_objects():  # a gc.collect() per measured step
            return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args) -> int:
    device = C.pick_device(args.device)
    preset = args.preset or ("quick" if args.quick else "default")
    model_cfg = dict(PRESETS[preset])
    for key in model_cfg:
        if getattr(args, key) is not None:
            model_cfg[key] = getattr(args, key)
    run = dict(QUICK_RUN if args.quick else RUN, seed=args.seed)
    for key in ("seq", "batch", "steps"):
        if getattr(args, key) is not None:
            run[key] = getattr(args, key)
    run["seq"] = run["seq"] or model_cfg["ctx"]
    if run["steps"] < 2:
        raise SystemExit("--steps: at least 2 (the first creates the optimizer state)")
    if run["seq"] > model_cfg["ctx"]:
        raise SystemExit(f"--seq {run['seq']} is longer than the context {model_cfg['ctx']}")
    env = C.environment(device)
    t_start = time.time()
    log = lambda s: print(s, flush=True)  # noqa: E731
    with torch.device("meta"):
        shape = make_model(**model_cfg)
    sizes = [p.numel() for p in shape.parameters()]
    cap = args.bucket_cap_mb if args.bucket_cap_mb is not None else block_bucket_mb(shape)
    del shape
    g = torch.Generator().manual_seed(run["seed"])
    tokens = torch.randint(model_cfg["vocab"], (run["steps"], run["batch"], run["seq"] + 1),
                           generator=g)
    batches = [(t[:, :-1].contiguous().to(device), t[:, 1:].contiguous().to(device))
               for t in tokens]
    log(f"memory: {preset} model, {sum(sizes):,} parameters, {run['steps']} steps of "
        f"{run['batch']}x{run['seq']} tokens, on {env['device']}")
    results: Dict[str, Any] = {}
    for name, spec in list(CONFIGS.items()) + [(REFERENCE, REFERENCE_CONFIG)]:
        results[name] = run_config(name, spec, model_cfg, run, batches, device, cap, log)
    step, inside = results["remainder-8bit"], results[TARGET_CONFIG]
    inside["same_as_step"] = (inside["fp32_sha256"] == step["fp32_sha256"]
                              and inside["losses"] == step["losses"])
    t = results[TARGET_CONFIG]
    target = dict(config=TARGET_CONFIG, bound_bpp=TARGET_BPP, total_bpp=t["total_bpp"],
                  exact=t["exact"]["exact"],
                  met=t["total_bpp"] <= TARGET_BPP and t["exact"]["exact"])
    config = dict(run, preset=preset, model=model_cfg, params=sum(sizes), tensors=len(sizes),
                  largest_share=max(sizes) / sum(sizes), bucket_cap_mb=cap,
                  buckets=t.get("buckets"), threads=torch.get_num_threads(),
                  configs=list(results), reference=REFERENCE)
    data = dict(env=env, smoke=args.quick, config=config, results=results, target=target,
                wall_s=time.time() - t_start)
    if args.note:
        data["note"] = args.note
    out = C.out_dir(args.out, args.quick)
    slug = C.device_slug(env) + ("" if preset in ("default", "quick") else f"-{preset}")
    md = markdown(data)
    C.write_json(out / f"memory-{slug}.json", data)
    (out / f"memory-{slug}.md").write_text(md)
    print(md)
    print(f"wrote {out}/memory-{slug}.{{md,json}}")
    C.copy_out([out / f"memory-{slug}.{e}" for e in ("md", "json")], bool(args.out),
               args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
