"""Self-check of an install: ``python -m mixedprec.selfcheck`` (``make demo`` runs it).

Runs each operator on small inputs, on the CPU and, when there is a
GPU and the CUDA kernels were built, on CUDA, and compares the results with a
float64 PyTorch reference. Prints a table op x device -> PASS/FAIL with the largest
absolute error, and exits with status 1 when any check fails.
"""

import math
import sys

import torch

import mixedprec
from mixedprec import masters, ops

# Relative tolerance by storage dtype: a few roundings of that dtype.
RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
ATOL = 1e-6


def _item(t) -> float:
    return t.item()  # sync-ok: a self-check reads its results, outside any training step


class Result:
    """The largest error and any failed check of one op on one device."""

    def __init__(self):
        self.max_err = 0.0
        self.failures = []
        self.notes = []

    def close(self, got, want, rtol, what):
        got = got.detach().cpu().double()  # sync-ok: a self-check reads its results
        want = want.detach().cpu().double()  # sync-ok: a self-check reads its results
        if got.shape != want.shape:
            self.failures.append(f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
            return
        if got.numel():
            self.max_err = max(self.max_err, _item((got - want).abs().max()))
        if not torch.allclose(got, want, rtol=rtol, atol=ATOL):
            self.failures.append(f"{what}: not within rtol={rtol:g} of the reference")

    def expect(self, ok, what):
        if not ok:
            self.failures.append(what)


def scalar(value, device, dtype=torch.float32):
    return torch.full((1,), value, dtype=dtype, device=device)


def check_unscale(dev, r):
    chunk = ops.CHUNK_SIZE
    tensors = [
        torch.randn(1000, device=dev) * 1024,
        (torch.randn(chunk + 3, device=dev) * 1024).half(),
        (torch.randn(77, device=dev) * 1024).bfloat16(),
    ]
    inv_scale = scalar(1 / 1000, dev)
    want = [t.double() * inv_scale.double() for t in tensors]
    found_inf = scalar(0.0, dev)
    ops.multi_tensor_unscale_(tensors, found_inf, inv_scale)
    for i, (t, w) in enumerate(zip(tensors, want)):
        r.close(t, w, RTOL[t.dtype], f"tensors[{i}] ({t.dtype})")
    r.expect(_item(found_inf) == 0, "found_inf set with finite inputs")
    tensors[1][-1] = float("inf")
    ops.multi_tensor_unscale_(tensors, found_inf, inv_scale)
    r.expect(_item(found_inf) == 1, "found_inf not set by an inf in the last element")


def check_unscale_to(dev, r):
    src = [(torch.randn(n, device=dev) * 512).half() for n in (ops.CHUNK_SIZE + 1, 50)]
    dst = [torch.empty(s.shape, device=dev) for s in src]
    inv_scale = scalar(1 / 512, dev)
    found_inf = scalar(0.0, dev)
    ops.multi_tensor_unscale_to_(src, dst, found_inf, inv_scale)
    for i, (s, d) in enumerate(zip(src, dst)):
        r.close(d, s.double() / 512, RTOL[torch.float32], f"dst[{i}]")
    r.expect(_item(found_inf) == 0, "found_inf set with finite inputs")
    src[0][0] = float("nan")
    ops.multi_tensor_unscale_to_(src, dst, found_inf, inv_scale)
    r.expect(_item(found_inf) == 1, "found_inf not set by a NaN in the first element")


def check_check_finite(dev, r):
    tensors = [torch.randn(2 * ops.CHUNK_SIZE + 1, device=dev).half(), torch.randn(10, device=dev)]
    before = [t.clone() for t in tensors]
    found_inf = scalar(0.0, dev)
    ops.multi_tensor_check_finite_(tensors, found_inf)
    r.expect(_item(found_inf) == 0, "found_inf set with finite inputs")
    r.expect(all(torch.equal(a, b) for a, b in zip(before, tensors)), "a tensor was written")
    tensors[0][ops.CHUNK_SIZE] = float("-inf")
    ops.multi_tensor_check_finite_(tensors, found_inf)
    r.expect(_item(found_inf) == 1, "found_inf not set by an inf in the middle chunk")


def check_copy(dev, r):
    src = [
        torch.randn(ops.CHUNK_SIZE + 1, device=dev),
        torch.randn(300, device=dev),
        torch.randn(40, device=dev).bfloat16(),
    ]
    dst = [
        torch.empty(ops.CHUNK_SIZE + 1, device=dev, dtype=torch.float16),
        torch.empty(300, device=dev, dtype=torch.bfloat16),
        torch.empty(40, device=dev),
    ]
    ops.multi_tensor_copy_(src, dst)
    for i, (s, d) in enumerate(zip(src, dst)):
        r.close(d, s.double(), RTOL[d.dtype], f"dst[{i}] ({s.dtype} -> {d.dtype})")


def check_l2norm(dev, r):
    tensors = [
        torch.randn(ops.CHUNK_SIZE + 5, device=dev),
        torch.randn(300, device=dev).half(),
        torch.randn(1000, device=dev).bfloat16(),
        torch.empty(0, device=dev),
    ]
    norm, per_tensor = ops.multi_tensor_l2norm(tensors, scalar(0.5, dev), per_tensor=True)
    want_per = torch.stack([torch.linalg.vector_norm(t.double() * 0.5) for t in tensors])
    r.close(per_tensor, want_per, RTOL[torch.float32], "per-tensor norms")
    r.close(norm, torch.linalg.vector_norm(want_per).reshape(1), RTOL[torch.float32], "norm")


def check_sgd(dev, r):
    lr, momentum, weight_decay, loss_scale = 0.1, 0.9, 1e-2, 128.0
    n = [ops.CHUNK_SIZE + 2, 33]
    params = [torch.randn(k, device=dev) for k in n]
    grads = [(torch.randn(k, device=dev) * loss_scale).half() for k in n]
    bufs = [torch.randn(k, device=dev) for k in n]
    model = [torch.empty(k, device=dev, dtype=torch.float16) for k in n]
    want_p, want_b = [], []
    for p, g, b in zip(params, grads, bufs):
        g = g.double() / loss_scale + weight_decay * p.double()
        b = b.double() * momentum + g
        want_b.append(b)
        want_p.append(p.double() - lr * (g + momentum * b))  # nesterov
    ops.fused_sgd_(params, grads, bufs, model, lr=lr, momentum=momentum, dampening=0.0,
                   weight_decay=weight_decay, nesterov=True, inv_scale=scalar(1 / loss_scale, dev),
                   found_inf=scalar(0.0, dev))
    for i in range(len(n)):
        r.close(params[i], want_p[i], RTOL[torch.float32], f"params[{i}]")
        r.close(bufs[i], want_b[i], RTOL[torch.float32], f"momentum_buffers[{i}]")
        r.close(model[i], want_p[i], RTOL[torch.float16], f"model_params[{i}]")
    before = [t.clone() for t in params + bufs + model]
    ops.fused_sgd_(params, grads, bufs, model, lr=lr, momentum=momentum, dampening=0.0,
                   weight_decay=weight_decay, nesterov=True, found_inf=scalar(1.0, dev))
    r.expect(all(torch.equal(a, b) for a, b in zip(before, params + bufs + model)),
             "a step with found_inf set changed a tensor")
    _check_sgd_options(dev, r)
    _check_sgd_stochastic(dev, r)


def _check_sgd_options(dev, r):
    """torch.optim.SGD(maximize=True) with the learning rate read on the device and the
    unscaled gradients written back (unscale_grads)."""
    lr, momentum, loss_scale = 0.05, 0.9, 64.0
    n = [ops.CHUNK_SIZE + 3, 50]
    params = [torch.randn(k, device=dev) for k in n]
    grads = [(torch.randn(k, device=dev) * loss_scale).bfloat16() for k in n]
    bufs = [torch.randn(k, device=dev) for k in n]
    want_g = [(g.float() / loss_scale).bfloat16() for g in grads]
    want_b = [b.double() * momentum - g.double() / loss_scale for b, g in zip(bufs, grads)]
    want_p = [p.double() - lr * b for p, b in zip(params, want_b)]
    ops.fused_sgd_(params, grads, bufs, [], lr=0.0, momentum=momentum,
                   inv_scale=scalar(1 / loss_scale, dev), maximize=True, lr_tensor=scalar(lr, dev),
                   unscale_grads=True)
    for i in range(len(n)):
        r.close(params[i], want_p[i], RTOL[torch.float32], f"maximize: params[{i}]")
        r.close(bufs[i], want_b[i], RTOL[torch.float32], f"maximize: momentum_buffers[{i}]")
        r.expect(torch.equal(grads[i], want_g[i]), f"unscale_grads: grads[{i}]")


def _sgd_stochastic(dev, n, fraction, found_inf=0.0):
    """bf16 params at 1.0 moved by `fraction` of a bf16 unit (2^-7), rounded
    stochastically (master="stochastic"); returns them."""
    params = [torch.ones(k, device=dev, dtype=torch.bfloat16) for k in n]
    grads = [torch.full((k,), -1.0, device=dev, dtype=torch.bfloat16) for k in n]
    salts = ops.rounding_words([(i,) for i in range(len(n))], dev)
    ops.fused_sgd_(params, grads, [], [], lr=fraction * 2.0**-7, found_inf=scalar(found_inf, dev),
                   sr_salts=salts, sr_seed=2024, step=scalar(3.0, dev))
    return params


def _check_sgd_stochastic(dev, r):
    """Stochastic rounding: each value is one of the two bf16 neighbours, their mean is
    the fp32 value within 5 standard errors (unbiased), the same key gives the same bits
    (on CUDA: the CPU's bits), and a skipped step writes nothing."""
    n, fraction = [ops.CHUNK_SIZE + 5, 1000], 0.3
    params = _sgd_stochastic(dev, n, fraction)
    values = torch.cat(params).double()
    unit = 2.0**-7
    r.expect(bool(((values == 1.0) | (values == 1.0 + unit)).all()),  # sync-ok: a self-check
             "stochastic rounding gave a value other than the two bf16 neighbours")
    std_err = unit * math.sqrt(fraction * (1 - fraction) / values.numel())
    r.close(values.mean().reshape(1), torch.full((1,), 1.0 + fraction * unit), 5 * std_err,
            "stochastic rounding's mean (unbiased)")
    again = _sgd_stochastic("cpu", n, fraction)
    r.expect(all(torch.equal(a.cpu(), b) for a, b in zip(params, again)),  # sync-ok: check
             "stochastic rounding's bits differ from the CPU's for the same key")
    skipped = _sgd_stochastic(dev, n, fraction, found_inf=1.0)
    r.expect(all(bool((p == 1.0).all()) for p in skipped),  # sync-ok: a self-check
             "a stochastic step with found_inf set changed a param")


def check_adam(dev, r):
    lr, beta1, beta2, eps, weight_decay, loss_scale = 1e-2, 0.9, 0.999, 1e-8, 1e-2, 1024.0
    n = [ops.CHUNK_SIZE + 9, 100]
    params = [torch.randn(k, device=dev) for k in n]
    exp_avgs = [torch.zeros(k, device=dev) for k in n]
    exp_avg_sqs = [torch.zeros(k, device=dev) for k in n]
    model = [torch.empty(k, device=dev, dtype=torch.bfloat16) for k in n]
    step = scalar(0.0, dev)
    ref = [[p.double(), torch.zeros_like(p, dtype=torch.float64),
            torch.zeros_like(p, dtype=torch.float64)] for p in params]
    for t in range(1, 4):
        grads = [(torch.randn(k, device=dev) * loss_scale).bfloat16() for k in n]
        ops.fused_adam_(params, grads, exp_avgs, exp_avg_sqs, model, step=step, lr=lr, beta1=beta1,
                        beta2=beta2, eps=eps, weight_decay=weight_decay,
                        decoupled_weight_decay=True,
                        inv_scale=scalar(1 / loss_scale, dev), found_inf=scalar(0.0, dev))
        for state, g in zip(ref, grads):  # torch.optim.AdamW in float64
            p, m, v = state
            g = g.double() / loss_scale
            p = p * (1 - lr * weight_decay)
            m = beta1 * m + (1 - beta1) * g
            v = beta2 * v + (1 - beta2) * g * g
            denom = v.sqrt() / math.sqrt(1 - beta2**t) + eps
            state[:] = [p - lr / (1 - beta1**t) * m / denom, m, v]
    r.expect(_item(step) == 3, f"step is {_item(step)} after 3 steps, expected 3")
    for i, (p, m, v) in enumerate(ref):
        r.close(params[i], p, RTOL[torch.float32], f"params[{i}]")
        r.close(exp_avgs[i], m, RTOL[torch.float32], f"exp_avgs[{i}]")
        r.close(exp_avg_sqs[i], v, RTOL[torch.float32], f"exp_avg_sqs[{i}]")
        r.close(model[i], p, RTOL[torch.bfloat16], f"model_params[{i}]")
    before = [t.clone() for t in params + exp_avgs + exp_avg_sqs + model + [step]]
    ops.fused_adam_(params, grads, exp_avgs, exp_avg_sqs, model, step=step, lr=lr,
                    found_inf=scalar(1.0, dev))
    after = params + exp_avgs + exp_avg_sqs + model + [step]
    r.expect(all(torch.equal(a, b) for a, b in zip(before, after)),
             "a step with found_inf set changed a tensor or the step")
    _check_adam_options(dev, r)
    _check_adam_lean(dev, r)


def _check_adam_options(dev, r):
    """torch.optim.Adam(amsgrad=True, maximize=True), one step from state, and the
    unscaled gradients written back (unscale_grads)."""
    lr, beta1, beta2, eps, loss_scale, t = 1e-2, 0.9, 0.99, 1e-8, 256.0, 3
    n = [ops.CHUNK_SIZE + 9, 100]
    params = [torch.randn(k, device=dev) for k in n]
    grads = [(torch.randn(k, device=dev) * loss_scale).half() for k in n]
    exp_avgs = [torch.randn(k, device=dev) * 0.1 for k in n]
    exp_avg_sqs = [torch.rand(k, device=dev) * 0.01 for k in n]
    maxima = [v * 2 * torch.rand(k, device=dev) for v, k in zip(exp_avg_sqs, n)]
    want = []
    for p, g, m, v, vmax in zip(params, grads, exp_avgs, exp_avg_sqs, maxima):
        g = -g.double() / loss_scale
        m = beta1 * m.double() + (1 - beta1) * g
        v = beta2 * v.double() + (1 - beta2) * g * g
        vmax = torch.maximum(vmax.double(), v)
        denom = vmax.sqrt() / math.sqrt(1 - beta2**t) + eps
        want.append((p.double() - lr / (1 - beta1**t) * m / denom, m, v, vmax))
    want_g = [(g.float() / loss_scale).half() for g in grads]
    ops.fused_adam_(params, grads, exp_avgs, exp_avg_sqs, [], step=scalar(t - 1.0, dev), lr=lr,
                    beta1=beta1, beta2=beta2, eps=eps, decoupled_weight_decay=False,
                    inv_scale=scalar(1 / loss_scale, dev), maximize=True, max_exp_avg_sqs=maxima,
                    unscale_grads=True)
    for i, (p, m, v, vmax) in enumerate(want):
        r.close(params[i], p, RTOL[torch.float32], f"amsgrad: params[{i}]")
        r.close(exp_avgs[i], m, RTOL[torch.float32], f"amsgrad: exp_avgs[{i}]")
        r.close(exp_avg_sqs[i], v, RTOL[torch.float32], f"amsgrad: exp_avg_sqs[{i}]")
        r.close(maxima[i], vmax, RTOL[torch.float32], f"amsgrad: max_exp_avg_sqs[{i}]")
        r.expect(torch.equal(grads[i], want_g[i]), f"unscale_grads: grads[{i}]")


def _check_adam_lean(dev, r):
    """Lean precision (docs/lean-precision.md): bf16 params with bf16 Kahan compensations
    and bf16 moments, one step against float64 AdamW from p + comp."""
    lr, beta1, beta2, eps = 1e-3, 0.9, 0.999, 1e-8
    n = [ops.CHUNK_SIZE + 9, 100]
    params = [(torch.randn(k, device=dev) + 1).bfloat16() for k in n]
    comps = [(torch.randn(k, device=dev) * 1e-3).bfloat16() for k in n]
    grads = [torch.randn(k, device=dev).bfloat16() for k in n]
    exp_avgs = [torch.zeros(k, device=dev, dtype=torch.bfloat16) for k in n]
    exp_avg_sqs = [torch.zeros(k, device=dev, dtype=torch.bfloat16) for k in n]
    start = [p.double() + c.double() for p, c in zip(params, comps)]
    ops.fused_adam_(params, grads, exp_avgs, exp_avg_sqs, [], step=scalar(0.0, dev), lr=lr,
                    beta1=beta1, beta2=beta2, eps=eps, kahan_comps=comps)
    for i, (x, g) in enumerate(zip(start, grads)):
        g = g.double()
        m, v = (1 - beta1) * g, (1 - beta2) * g * g
        want = x - lr / (1 - beta1) * m / (v.sqrt() / math.sqrt(1 - beta2) + eps)
        r.close(params[i].double() + comps[i].double(), want, 1e-5, f"kahan params[{i}]")
        r.close(params[i], want, RTOL[torch.bfloat16], f"kahan params[{i}] (bf16)")
        r.close(exp_avgs[i], m, RTOL[torch.bfloat16], f"bf16 exp_avgs[{i}]")
        r.close(exp_avg_sqs[i], v, RTOL[torch.bfloat16], f"bf16 exp_avg_sqs[{i}]")
    # master="remainder": (bf16 param, int16 remainder) pairs step as their fp32 masters,
    # bit for bit, and split back by the tie rule (masters.split_remainder).
    fp32 = [torch.randn(k, device=dev) + 1 for k in n]
    halves = [masters.split_remainder(x) for x in fp32]
    state = [[torch.zeros(k, device=dev) for k in n] for _ in range(2)]
    ops.fused_adam_(fp32, grads, *state, [], step=scalar(0.0, dev), lr=lr, beta1=beta1,
                    beta2=beta2, eps=eps)
    state = [[torch.zeros(k, device=dev) for k in n] for _ in range(2)]
    ops.fused_adam_([h[0] for h in halves], grads, *state, [], step=scalar(0.0, dev), lr=lr,
                    beta1=beta1, beta2=beta2, eps=eps, remainders=[h[1] for h in halves])
    for i, (x, (p, rem)) in enumerate(zip(fp32, halves)):
        want_p, want_rem = masters.split_remainder(x)
        r.expect(torch.equal(p.view(torch.int16), want_p.view(torch.int16)) and
                 torch.equal(rem, want_rem), f"remainder params[{i}]: the fp32 step, split")


def check_lamb(dev, r):
    lr, beta1, beta2, eps, weight_decay, loss_scale = 1e-2, 0.9, 0.999, 1e-6, 1e-2, 1024.0
    n = [ops.CHUNK_SIZE + 9, 100]
    params = [torch.randn(k, device=dev) for k in n]
    exp_avgs = [torch.zeros(k, device=dev) for k in n]
    exp_avg_sqs = [torch.zeros(k, device=dev) for k in n]
    model = [torch.empty(k, device=dev, dtype=torch.float16) for k in n]
    step = scalar(0.0, dev)
    ref = [[p.double(), torch.zeros_like(p, dtype=torch.float64),
            torch.zeros_like(p, dtype=torch.float64)] for p in params]
    for t in range(1, 4):
        grads = [(torch.randn(k, device=dev) * loss_scale).half() for k in n]
        norm = math.sqrt(sum(_item(g.double().square().sum()) for g in grads)) / loss_scale
        ops.fused_lamb_(params, grads, exp_avgs, exp_avg_sqs, model, step=step, lr=lr, beta1=beta1,
                        beta2=beta2, eps=eps, weight_decay=weight_decay,
                        global_grad_norm=scalar(norm, dev), max_grad_norm=norm / 2,
                        inv_scale=scalar(1 / loss_scale, dev), found_inf=scalar(0.0, dev))
        for state, g in zip(ref, grads):  # LAMB in float64, gradients clipped by half
            p, m, v = state
            g = g.double() / loss_scale / 2
            m = beta1 * m + (1 - beta1) * g
            v = beta2 * v + (1 - beta2) * g * g
            u = (m / (1 - beta1**t)) / ((v / (1 - beta2**t)).sqrt() + eps) + weight_decay * p
            state[:] = [p - lr * _item(p.norm()) / _item(u.norm()) * u, m, v]
    r.expect(_item(step) == 3, f"step is {_item(step)} after 3 steps, expected 3")
    for i, (p, m, v) in enumerate(ref):
        r.close(params[i], p, 1e-4, f"params[{i}]")
        r.close(exp_avgs[i], m, 1e-4, f"exp_avgs[{i}]")
        r.close(exp_avg_sqs[i], v, 1e-4, f"exp_avg_sqs[{i}]")
        r.close(model[i], p, RTOL[torch.float16], f"model_params[{i}]")
    before = [t.clone() for t in params + exp_avgs + exp_avg_sqs + model + [step]]
    ops.fused_lamb_(params, grads, exp_avgs, exp_avg_sqs, model, step=step, lr=lr,
                    found_inf=scalar(1.0, dev))
    after = params + exp_avgs + exp_avg_sqs + model + [step]
    r.expect(all(torch.equal(a, b) for a, b in zip(before, after)),
             "a step with found_inf set changed a tensor or the step")


def check_adagrad(dev, r):
    lr, eps, weight_decay, loss_scale = 0.05, 1e-10, 1e-2, 64.0
    n = [ops.CHUNK_SIZE + 5, 21]
    for w_mode in (False, True):
        params = [torch.randn(k, device=dev) for k in n]
        grads = [(torch.randn(k, device=dev) * loss_scale).half() for k in n]
        sums = [torch.rand(k, device=dev) for k in n]
        model = [torch.empty(k, device=dev, dtype=torch.float16) for k in n]
        want_p, want_h = [], []
        for p, g, h in zip(params, grads, sums):  # Apex's Adagrad in float64
            p, g = p.double(), g.double() / loss_scale
            if not w_mode:
                g = g + weight_decay * p
            h = h.double() + g * g
            update = g / (h.sqrt() + eps) + (weight_decay * p if w_mode else 0.0)
            want_p.append(p - lr * update)
            want_h.append(h)
        ops.fused_adagrad_(params, grads, sums, model, lr=lr, eps=eps, weight_decay=weight_decay,
                           decoupled_weight_decay=w_mode, inv_scale=scalar(1 / loss_scale, dev),
                           found_inf=scalar(0.0, dev))
        for i in range(len(n)):
            r.close(params[i], want_p[i], RTOL[torch.float32], f"params[{i}] (w_mode={w_mode})")
            r.close(sums[i], want_h[i], RTOL[torch.float32], f"state_sums[{i}]")
            r.close(model[i], want_p[i], RTOL[torch.float16], f"model_params[{i}]")
    before = [t.clone() for t in params + sums + model]
    ops.fused_adagrad_(params, grads, sums, model, lr=lr, found_inf=scalar(1.0, dev))
    r.expect(all(torch.equal(a, b) for a, b in zip(before, params + sums + model)),
             "a step with found_inf set changed a tensor")


def check_novograd(dev, r):
    lr, beta1, beta2, eps, weight_decay, loss_scale = 1e-2, 0.9, 0.98, 1e-8, 1e-2, 256.0
    n = [ops.CHUNK_SIZE + 7, 45]
    for norm_type in (2, 0):
        params = [torch.randn(k, device=dev) for k in n]
        exp_avgs = [torch.zeros(k, device=dev) for k in n]
        model = [torch.empty(k, device=dev, dtype=torch.bfloat16) for k in n]
        exp_avg_sq = torch.zeros(len(n), device=dev)
        step = scalar(0.0, dev)
        ref = [[p.double(), torch.zeros_like(p, dtype=torch.float64), None] for p in params]
        for t in range(1, 4):
            grads = [(torch.randn(k, device=dev) * loss_scale).bfloat16() for k in n]
            ops.fused_novograd_(params, grads, exp_avgs, model, exp_avg_sq=exp_avg_sq, step=step,
                                lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
                                norm_type=norm_type, inv_scale=scalar(1 / loss_scale, dev),
                                found_inf=scalar(0.0, dev))
            for state, g in zip(ref, grads):  # Apex's NovoGrad in float64
                p, m, v = state
                g = g.double() / loss_scale
                norm = g.norm() if norm_type == 2 else g.abs().max()
                if v is None:
                    v = norm
                elif norm_type == 2:
                    v = (beta2 * v * v + (1 - beta2) * norm * norm).sqrt()
                else:
                    v = beta2 * v + (1 - beta2) * norm
                m = beta1 * m + (1 - beta1) * g
                denom = v / math.sqrt(1 - beta2**t) + eps
                state[:] = [p - lr * (m / (1 - beta1**t) / denom + weight_decay * p), m, v]
        r.expect(_item(step) == 3, f"step is {_item(step)} after 3 steps, expected 3")
        for i, (p, m, v) in enumerate(ref):
            what = f"(norm_type={norm_type})"
            r.close(params[i], p, RTOL[torch.float32], f"params[{i}] {what}")
            r.close(exp_avgs[i], m, RTOL[torch.float32], f"exp_avgs[{i}] {what}")
            r.close(exp_avg_sq[i], v, RTOL[torch.float32], f"exp_avg_sq[{i}] {what}")
            r.close(model[i], p, RTOL[torch.bfloat16], f"model_params[{i}] {what}")
    before = [t.clone() for t in params + exp_avgs + model + [exp_avg_sq, step]]
    ops.fused_novograd_(params, grads, exp_avgs, model, exp_avg_sq=exp_avg_sq, step=step, lr=lr,
                        found_inf=scalar(1.0, dev))
    after = params + exp_avgs + model + [exp_avg_sq, step]
    r.expect(all(torch.equal(a, b) for a, b in zip(before, after)),
             "a step with found_inf set changed a tensor, the moments or the step")


def check_sum(dev, r):
    # The seed case: fp16 accumulation rounds 16380 to 16384; sum_fp32 is exact.
    x = torch.full((4095,), 4.0, dtype=torch.float16, device=dev)
    got = ops.sum_fp32(x)
    r.expect(got.dtype == torch.float32, f"sum_fp32 returned {got.dtype}")
    r.close(got, torch.tensor(16380.0, dtype=torch.float64), 0.0, "4095 x fp16 4.0")
    r.notes.append(f"4095 x fp16 4.0: sum_fp32 {_item(got):g}, torch fp16 sum {_item(x.sum()):g}")
    y = torch.randn(64, 33, 5, device=dev).bfloat16()
    r.close(ops.sum_fp32(y, [0, 2], keepdim=True), y.double().sum([0, 2], keepdim=True),
            RTOL[torch.float32], "bf16 sum over dims [0, 2]")


def check_loss_scale(dev, r):
    args = dict(growth_factor=2.0, backoff_factor=0.5, growth_interval=3, hysteresis=2,
                min_scale=2.0**10, max_scale=2.0**17)
    scale = scalar(2.0**16, dev)
    growth, hyst = scalar(0, dev, torch.int32), scalar(2, dev, torch.int32)
    want = [2.0**16, 0, 2]
    for found in [0, 0, 0, 0, 0, 0, 1, 1, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0]:
        ops.update_loss_scale_(scale, growth, hyst, scalar(float(found), dev), **args)
        s, g, h = want
        if found:  # the docstring of update_loss_scale_, in Python
            h -= 1
            if h <= 0:
                s = max(s * args["backoff_factor"], args["min_scale"])
            g = 0
        else:
            h, g = args["hysteresis"], g + 1
            if g >= args["growth_interval"]:
                s, g = min(s * args["growth_factor"], args["max_scale"]), 0
        want = [s, g, h]
        got = [_item(scale), _item(growth), _item(hyst)]
        r.max_err = max(r.max_err, abs(got[0] - want[0]))
        if got != want:
            r.expect(False, f"after found_inf={found}: (scale, growth, hysteresis) = {got}, "
                            f"expected {want}")
            return


CHECKS = {
    "multi_tensor_unscale_": check_unscale,
    "multi_tensor_unscale_to_": check_unscale_to,
    "multi_tensor_check_finite_": check_check_finite,
    "multi_tensor_copy_": check_copy,
    "multi_tensor_l2norm": check_l2norm,
    "fused_sgd_": check_sgd,
    "fused_adam_": check_adam,
    "fused_lamb_": check_lamb,
    "sum_fp32": check_sum,
    "update_loss_scale_": check_loss_scale,
    "fused_adagrad_": check_adagrad,
    "fused_novograd_": check_novograd,
}


def has_kernels(key):
    return all(torch._C._dispatch_has_kernel_for_dispatch_key(f"mixedprec::{op}", key)
               for op in CHECKS)


def main():
    torch.manual_seed(0)
    cuda_kernels = has_kernels("CUDA")
    print(f"mixedprec {mixedprec.__version__}, torch {torch.__version__}, "
          f"CUDA build: {torch.version.cuda or 'none'}")
    print(f"mixedprec CUDA kernels registered: {'yes' if cuda_kernels else 'no'}")
    devices = ["cpu"]
    if torch.cuda.is_available():
        print(f"GPU: {torch.cuda.get_device_name()}")
        if cuda_kernels:
            devices.append("cuda")
        else:
            print("not checking CUDA: the CUDA kernels were not built")
    else:
        print("GPU: none")
    print()

    width = max(map(len, CHECKS)) + 2
    print("op".ljust(width) + "".join(d.ljust(26) for d in devices))
    failures, notes, failed = [], [], 0
    for op, check in CHECKS.items():
        row = op.ljust(width)
        for dev in devices:
            r = Result()
            try:
                check(dev, r)
            except Exception as e:  # report every op, not just the first that raises
                r.failures.append(f"{type(e).__name__}: {str(e).splitlines()[0]}")
            status = "FAIL" if r.failures else "PASS"
            row += f"{status}  max err {r.max_err:.1e}".ljust(26)
            failed += bool(r.failures)
            failures += [f"{op} on {dev}: {f}" for f in r.failures]
            notes += [f"{op} on {dev}: {n}" for n in r.notes]
        print(row)
    print()
    for line in notes + failures:
        print(line)
    print(f"{'FAIL' if failed else 'PASS'}: {len(CHECKS) * len(devices) - failed} of "
          f"{len(CHECKS) * len(devices)} op x device checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
