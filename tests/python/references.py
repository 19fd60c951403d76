"""Plain float64 PyTorch (and, for the loss scale, Python with fp32 rounding) references of the
mixedprec operators, written from their contract rather than from the kernels."""

import math

import numpy as np
import torch


def has_non_finite(tensors):
    return any(not torch.isfinite(t).all().item() for t in tensors)


def ref_unscale(tensors, inv_scale):
    """Values of multi_tensor_unscale_ / multi_tensor_unscale_to_ (float64) and
    whether found_inf must be set."""
    return [t.double() * inv_scale for t in tensors], has_non_finite(tensors)


def ref_copy(src):
    return [t.double() for t in src]


def ref_l2norm(tensors, inv_scale=None, per_tensor=False):
    scale = 1.0 if inv_scale is None else inv_scale
    squares = [((t.double() * scale) ** 2).sum() for t in tensors]
    total = torch.stack(squares).sum() if squares else torch.zeros((), dtype=torch.float64)
    per = torch.stack(squares).sqrt() if per_tensor and squares else torch.zeros(0)
    return total.sqrt().reshape(1), per.double()


def ref_sgd(params, grads, momentum_buffers, lr, momentum=0.0, dampening=0.0,
            weight_decay=0.0, nesterov=False, first_run=False, inv_scale=None,
            wd_after_momentum=False, maximize=False):
    """One torch.optim.SGD step in float64: (new params, new momentum buffers). With
    wd_after_momentum (Apex's option) the weight decay joins after the momentum;
    maximize negates the (unscaled) gradient first."""
    scale = 1.0 if inv_scale is None else inv_scale
    new_params, new_buffers = [], []
    for i, (p, g) in enumerate(zip(params, grads)):
        p, g = p.double(), g.double() * scale
        if maximize:
            g = -g
        if weight_decay != 0 and not wd_after_momentum:
            g = g + weight_decay * p
        if momentum != 0:
            if first_run:
                buf = g.clone()
            else:
                buf = momentum * momentum_buffers[i].double() + (1 - dampening) * g
            new_buffers.append(buf)
            g = g + momentum * buf if nesterov else buf
        if weight_decay != 0 and wd_after_momentum:
            g = g + weight_decay * p
        new_params.append(p - lr * g)
    return new_params, new_buffers


def ref_adam(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1=0.9, beta2=0.999,
             eps=1e-8, weight_decay=0.0, decoupled_weight_decay=True, bias_correction=True,
             inv_scale=None,
             maximize=False, max_exp_avg_sqs=None):
    """One torch.optim.Adam (decoupled_weight_decay=False) / AdamW (True) step in float64
    from the step count `step` before the call: (params, exp_avgs, exp_avg_sqs, step).
    With bf16 moments the update uses these unrounded values; the optimizer then stores
    round_bf16 of them. maximize negates the (unscaled) gradient first. With
    max_exp_avg_sqs (amsgrad) the new maxima, max(max_exp_avg_sq, exp_avg_sq) (NaN
    where either is), take exp_avg_sq's place in the denominator and are returned
    fifth: (params, exp_avgs, exp_avg_sqs, step, max_exp_avg_sqs)."""
    scale = 1.0 if inv_scale is None else inv_scale
    step = step + 1
    bc1 = 1 - beta1**step if bias_correction else 1.0
    bc2 = 1 - beta2**step if bias_correction else 1.0
    amsgrad = max_exp_avg_sqs is not None
    out_p, out_m, out_v, out_max = [], [], [], []
    for i, (p, g, m, v) in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs)):
        p, g, m, v = p.double(), g.double() * scale, m.double(), v.double()
        if maximize:
            g = -g
        if weight_decay != 0:
            if decoupled_weight_decay:
                p = p * (1 - lr * weight_decay)
            else:
                g = g + weight_decay * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        v_denom = v
        if amsgrad:
            v_denom = torch.maximum(max_exp_avg_sqs[i].double(), v)
            out_max.append(v_denom)
        p = p - (lr / bc1) * m / (v_denom.sqrt() / math.sqrt(bc2) + eps)
        out_p.append(p)
        out_m.append(m)
        out_v.append(v)
    if amsgrad:
        return out_p, out_m, out_v, step, out_max
    return out_p, out_m, out_v, step


def ref_unscaled_grads(grads, inv_scale):
    """What unscale_grads=True leaves in the grads, as torch's GradScaler.unscale_ does:
    each element times inv_scale in float32, stored in the grad's dtype."""
    return [(g.float() * inv_scale).to(g.dtype) for g in grads]


def round_bf16(t):
    """`t` rounded to bfloat16 (to nearest even), as float64."""
    return t.to(torch.bfloat16).double()


def ref_lean_update(params, new_params, compensations=None):
    """What the lean master modes store after an update to the float64 values
    `new_params` of bf16 `params`: master="none" rounds them to nearest (compensations
    None); master="kahan" stores p = bf16(new) and comp = bf16(new - p).
    Returns (params, compensations) as float64 (compensations None for "none")."""
    out_p = [round_bf16(new) for new in new_params]
    if compensations is None:
        return out_p, None
    return out_p, [round_bf16(new - p) for new, p in zip(new_params, out_p)]


def ref_kahan_start(params, compensations):
    """The value a Kahan update starts from: p + comp in float64."""
    return [p.double() + c.double() for p, c in zip(params, compensations)]


def ref_lamb(params, grads, exp_avgs, exp_avg_sqs, step, lr, beta1=0.9, beta2=0.999,
             eps=1e-6, weight_decay=0.01, decoupled_weight_decay=True, bias_correction=True,
             grad_averaging=True, use_nvlamb=False, global_grad_norm=None, max_grad_norm=1.0,
             inv_scale=None):
    """One LAMB step (Apex's multi_tensor_lamb) in float64 from the step count `step`
    before the call: (params, exp_avgs, exp_avg_sqs, step). `global_grad_norm` is the
    norm of the unscaled gradients (None: no clipping)."""
    scale = 1.0 if inv_scale is None else inv_scale
    clip = 1.0
    if global_grad_norm is not None and global_grad_norm > max_grad_norm:
        clip = global_grad_norm / max_grad_norm
    step = step + 1
    bc1 = 1 - beta1**step if bias_correction else 1.0
    bc2 = 1 - beta2**step if bias_correction else 1.0
    out_p, out_m, out_v = [], [], []
    for p, g, m, v in zip(params, grads, exp_avgs, exp_avg_sqs):
        p, g, m, v = p.double(), g.double() * scale / clip, m.double(), v.double()
        if not decoupled_weight_decay:
            g = g + weight_decay * p
        m = beta1 * m + ((1 - beta1) if grad_averaging else 1.0) * g
        v = beta2 * v + (1 - beta2) * g * g
        update = (m / bc1) / ((v / bc2).sqrt() + eps)
        if decoupled_weight_decay:
            update = update + weight_decay * p
        ratio = lr
        p_norm, u_norm = p.norm().item(), update.norm().item()
        if (use_nvlamb or weight_decay != 0) and p_norm != 0 and u_norm != 0:
            ratio = lr * p_norm / u_norm
        out_p.append(p - ratio * update)
        out_m.append(m)
        out_v.append(v)
    return out_p, out_m, out_v, step


def ref_global_norm(grads, inv_scale=None):
    """The float64 L2 norm of all gradients together, unscaled, as a float."""
    return ref_l2norm(grads, inv_scale)[0].item()


def ref_adagrad(params, grads, state_sums, lr, eps=1e-10, weight_decay=0.0,
                decoupled_weight_decay=False, inv_scale=None):
    """One Adagrad step in float64 (Apex's FusedAdagrad; torch.optim.Adagrad with no
    lr_decay when decoupled_weight_decay is False): (params, state_sums)."""
    scale = 1.0 if inv_scale is None else inv_scale
    out_p, out_h = [], []
    for p, g, h in zip(params, grads, state_sums):
        p, g, h = p.double(), g.double() * scale, h.double()
        if weight_decay != 0 and not decoupled_weight_decay:
            g = g + weight_decay * p
        h = h + g * g
        update = g / (h.sqrt() + eps)
        if weight_decay != 0 and decoupled_weight_decay:
            update = update + weight_decay * p
        out_p.append(p - lr * update)
        out_h.append(h)
    return out_p, out_h


def ref_novograd(params, grads, exp_avgs, exp_avg_sq, step, lr, beta1=0.9, beta2=0.999,
                 eps=1e-8, weight_decay=0.0, bias_correction=True, grad_averaging=True,
                 reg_inside_moment=False, norm_type=2, init_zero=False, inv_scale=None):
    """One NovoGrad step (Apex's FusedNovoGrad) in float64 from the step count `step`
    before the call and the per-tensor second moments `exp_avg_sq` (a vector):
    (params, exp_avgs, exp_avg_sq, step)."""
    scale = 1.0 if inv_scale is None else inv_scale
    grads = [g.double() * scale for g in grads]
    v = exp_avg_sq.double()
    if norm_type == 2:
        norms = torch.stack([g.pow(2).sum().sqrt() for g in grads])
        new_v = (beta2 * v**2 + (1 - beta2) * norms**2).sqrt()
    else:
        norms = torch.stack([g.abs().max() if g.numel() else g.new_zeros(()) for g in grads])
        new_v = beta2 * v + (1 - beta2) * norms
    if step == 0 and not init_zero:
        new_v = norms
    step = step + 1
    bc1 = 1 - beta1**step if bias_correction else 1.0
    bc2 = math.sqrt(1 - beta2**step) if bias_correction else 1.0
    w = 1 - beta1 if grad_averaging else 1.0
    out_p, out_m = [], []
    for i, (p, g, m) in enumerate(zip(params, grads, exp_avgs)):
        p, m = p.double(), m.double()
        denom = new_v[i] / bc2 + eps
        if reg_inside_moment:
            m = beta1 * m + w * (g / denom + weight_decay * p)
            p = p - lr * m / bc1
        else:
            m = beta1 * m + w * g
            p = p - lr * (m / bc1 / denom + weight_decay * p)
        out_p.append(p)
        out_m.append(m)
    return out_p, out_m, new_v, step


def ref_sum_fp32(x, dim=None, keepdim=False):
    return x.double().sum(dim=dim, keepdim=keepdim)


def ref_update_loss_scale(state, found_inf, growth_factor=2.0, backoff_factor=0.5,
                          growth_interval=2000, hysteresis=1, min_scale=0.0,
                          max_scale=float("inf")):
    """One update of (scale, growth_tracker, hysteresis_tracker): the scale is a
    float32, each product is formed in double and rounded once (as torch's
    _amp_update_scale_ does)."""
    f32 = np.float32
    scale, growth_tracker, hysteresis_tracker = state
    with np.errstate(over="ignore"):
        if found_inf != 0:
            hysteresis_tracker -= 1
            if hysteresis_tracker <= 0:
                scale = f32(max(float(f32(scale)) * backoff_factor, min_scale))
            growth_tracker = 0
        else:
            hysteresis_tracker = hysteresis
            growth_tracker += 1
            if growth_tracker >= growth_interval:
                grown = f32(min(float(f32(scale)) * growth_factor, max_scale))
                if np.isfinite(grown):
                    scale = grown
                growth_tracker = 0
    return float(f32(scale)), growth_tracker, hysteresis_tracker


# Philox4x32-10 (Salmon et al. 2011), written from the paper's definition, as
# csrc/philox.h keys it for stochastic rounding: key = the 64-bit seed (low word
# first), counter = (block low word, block high word, salt, step), block = index // 8;
# element index takes 16-bit half index % 8 of the block's 128 output bits.
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)
_MASK32 = 0xFFFFFFFF


def philox4x32_10(counter, key):
    """The four 32-bit output words of Philox4x32-10 for four counter words and two
    key words (Python ints)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(10):
        if r > 0:
            k0 = (k0 + _PHILOX_W[0]) & _MASK32
            k1 = (k1 + _PHILOX_W[1]) & _MASK32
        p0 = _PHILOX_M[0] * c0
        p1 = _PHILOX_M[1] * c2
        c0, c1, c2, c3 = ((p1 >> 32) ^ c1 ^ k0, p1 & _MASK32, (p0 >> 32) ^ c3 ^ k1,
                          p0 & _MASK32)
    return c0, c1, c2, c3


def ref_rounding_bits(seed, salt, step, numel):
    """The 16 random bits stochastic rounding adds to each of elements 0..numel-1 of a
    tensor (an int64 tensor): element i takes half h = i % 8 of the output of Philox
    for block i // 8, (word h // 2 >> 16 * (h % 2)) & 0xffff."""
    key = (seed & _MASK32, (seed >> 32) & _MASK32)
    blocks = {}
    bits = []
    for i in range(numel):
        b, h = i >> 3, i & 7
        if b not in blocks:
            blocks[b] = philox4x32_10((b & _MASK32, b >> 32, salt, step), key)
        bits.append((blocks[b][h >> 1] >> (16 * (h & 1))) & 0xFFFF)
    return torch.tensor(bits, dtype=torch.int64)


def ref_round_bf16_stochastic(x, bits):
    """fp32 tensor x rounded to bf16 stochastically with `bits` (int64, per element):
    the bits added to the low half of x's bits, which are then cut off; inf and NaN
    rounded to nearest. Returned as float32 (exactly the bf16 values)."""
    x = x.float().contiguous()
    u = x.view(torch.int32).to(torch.int64) & _MASK32
    rounded = ((u + bits) & 0xFFFF0000).to(torch.int32).view(torch.float32)  # wraps as C++
    return torch.where(torch.isfinite(x), rounded, x.bfloat16().float())


# --- 8-bit moments (state_dtype=torch.float8_e4m3fn) -----------------------------------

_E4M3_MAX = 448.0
_BLOCK = 32


def ref_dequantize8(codes, scales):
    """float64 values of 8-bit state: decode(code) * 2^e per block of 32 consecutive
    elements of the flat tensor, e the scale byte (float8_e8m0fnu) minus 127."""
    e = scales.view(torch.uint8).to(torch.float64).reshape(-1, 1) - 127
    values = codes.to(torch.float64).reshape(-1, _BLOCK) * torch.exp2(e)
    return values.reshape(codes.shape)


def ref_e4m3_stochastic(y, r):
    """e4m3 codes (float8_e4m3fn) of float32 ``y`` (|y| <= 448) rounded stochastically
    with ``r`` (int64, 0..65535 per element): up (away from zero) to the next e4m3
    value when the dropped fraction of a code step plus (r + 1/2) / 2^16 reaches 1;
    below 2^-6 (steps of 2^-9) the float32 sum y * 512 + (r + 1/2) / 2^16 is
    truncated, as the kernels compute it."""
    y = y.float().contiguous()
    a = y.abs()
    bits = a.view(torch.int32).to(torch.int64)
    normal = ((bits + (r << 4) + 0x8) >> 20) - 960
    sub = (a * 512 + (r.float() + 0.5) * (1.0 / 65536)).to(torch.int64)
    code = torch.where(a < 2.0 ** -6, sub, normal).clamp(max=0x7E)
    code = torch.where(torch.isnan(a), torch.full_like(code, 0x7F), code)
    code = code | torch.where(y.view(torch.int32) < 0, 0x80, 0)
    return code.to(torch.uint8).view(torch.float8_e4m3fn)


def ref_quantize8(values, random=None):
    """(e4m3 codes, e8m0 scales of shape (rows, row / 32)) of float64 ``values`` as the
    op stores them: each value rounded to float32 first; per block of 32 the absmax A
    of those, the scale exponent the smallest e with A * 2^-e <= 448 (0 when A == 0),
    in [-127, 127]; the codes torch's cast (nearest even) of value * 2^-e (exact in
    float32), or with ``random`` (int64, 0..65535 per element) ref_e4m3_stochastic's."""
    v32 = values.to(torch.float32).reshape(-1, _BLOCK)
    absmax = v32.abs().amax(1).double()
    e = torch.ceil(torch.log2(absmax / _E4M3_MAX))  # (fixed up below: log2 rounds)
    e = torch.where(absmax > _E4M3_MAX * torch.exp2(e), e + 1, e)
    e = torch.where(absmax <= _E4M3_MAX * torch.exp2(e - 1), e - 1, e)
    e = torch.where(absmax > 0, e, torch.zeros_like(e)).clamp(-127, 127)
    y = v32 * torch.exp2(-e).float().reshape(-1, 1)
    codes = y.to(torch.float8_e4m3fn) if random is None else ref_e4m3_stochastic(
        y, random.reshape(y.shape))
    scales = (e + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    return codes.reshape(values.shape), scales.reshape(values.shape[0], -1)


def ref_adam8(params, grads, exp_avgs, exp_avg_scales, roots, root_scales, step, lr,
              random=None, **kwargs):
    """One Adam/AdamW step (``ref_adam``'s keywords) with 8-bit moments: the moments
    dequantized (the second as the square of its stored root), updated in float64, the
    parameter updated from the unquantized new moments (denominator
    sqrt(v) / sqrt(bc2) + eps), then the first moment and sqrt(v) requantized
    (``ref_quantize8``; with ``random``, one int64 tensor of 16 bits per element for
    each param, stochastically: the first moment with them, the root with their two
    bytes swapped). Returns (params float64, exp_avgs, exp_avg_scales, roots, root_scales,
    step)."""
    m = [ref_dequantize8(c, s) for c, s in zip(exp_avgs, exp_avg_scales)]
    v = [ref_dequantize8(c, s) ** 2 for c, s in zip(roots, root_scales)]
    new_p, new_m, new_v, step = ref_adam(params, grads, m, v, step, lr, **kwargs)
    low = [None] * len(new_m) if random is None else list(random)
    high = [None] * len(new_m) if random is None else [
        ((r << 8) | (r >> 8)) & 0xFFFF for r in random]
    q_m = [ref_quantize8(x, r) for x, r in zip(new_m, low)]
    q_r = [ref_quantize8(x.sqrt(), r) for x, r in zip(new_v, high)]
    return (new_p, [c for c, _ in q_m], [s for _, s in q_m], [c for c, _ in q_r],
            [s for _, s in q_r], step)


def ref_sgd8(params, grads, buffers, buffer_scales, lr, random=None, **kwargs):
    """One SGD step (``ref_sgd``'s keywords) with 8-bit momentum buffers: dequantized,
    updated in float64, the parameter updated from the unquantized new buffer, which is
    then requantized (stochastically with ``random``'s 16 bits per element, as
    ``ref_adam8``). Returns (params float64, buffer codes, buffer scales)."""
    old = [ref_dequantize8(c, s) for c, s in zip(buffers, buffer_scales)]
    new_p, new_b = ref_sgd(params, grads, old, lr, **kwargs)
    q = [ref_quantize8(b, r)
         for b, r in zip(new_b, random or [None] * len(new_b))]
    return new_p, [c for c, _ in q], [s for _, s in q]
