"""Every op has its kernels, passes torch.library.opcheck on every device, and runs
under torch.compile(fullgraph=True) as in eager mode."""

import os
import re

import pytest
import torch
from helpers import adam_state, assert_bitwise_equal, assert_unchanged, randn, scalar, snapshot

from mixedprec import ops

OP_NAMES = [
    "multi_tensor_unscale_",
    "multi_tensor_unscale_to_",
    "multi_tensor_check_finite_",
    "multi_tensor_copy_",
    "multi_tensor_l2norm",
    "fused_sgd_",
    "fused_adam_",
    "fused_lamb_",
    "sum_fp32",
    "update_loss_scale_",
    "fused_adagrad_",
    "fused_novograd_",
]


def registered_ops():
    return sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("mixedprec::"))


def test_the_contract_ops_are_registered():
    assert set(f"mixedprec::{n}" for n in OP_NAMES) <= set(registered_ops())


def expected_dispatch_keys():
    # CompositeExplicitAutograd: the kernel of calls that hold no tensor (the CPU's
    # registration units give each family's, csrc/ops/unit.h).
    keys = ["CPU", "Meta", "CompositeExplicitAutograd"]
    # The Makefile sets MIXEDPREC_EXPECT_CUDA=1 when it built the CUDA kernels, so
    # that a machine without a GPU still proves they were compiled and linked.
    if os.environ.get("MIXEDPREC_EXPECT_CUDA") == "1" or torch.cuda.is_available():
        keys.append("CUDA")
    return keys


@pytest.mark.parametrize("op", registered_ops())
def test_every_op_has_its_kernels(op):
    missing = [key for key in expected_dispatch_keys()
               if not torch._C._dispatch_has_kernel_for_dispatch_key(op, key)]
    assert not missing, f"{op} has no kernel for {missing}"


# --- opcheck ----------------------------------------------------------------------

def sample_inputs(device):
    """(op name, args, kwargs) samples covering mixed dtypes, masters with a model
    copy, optional arguments absent and given, and edge cases."""
    f32, f16, bf16 = torch.float32, torch.float16, torch.bfloat16
    d = device

    def mixed(seed, shapes=((5,), (3, 4), (2, 3, 2, 2))):
        return [randn(s, (f32, f16, bf16)[i % 3], d, seed + i) for i, s in enumerate(shapes)]

    def fp32(seed, shapes=((5,), (3, 4), (2, 3, 2, 2))):
        return [randn(s, f32, d, seed + i) for i, s in enumerate(shapes)]

    def like(tensors, dtypes):
        return [torch.zeros_like(t, dtype=dtypes[i % len(dtypes)]) for i, t in enumerate(tensors)]

    def flags(found=0.0, inv=0.5):
        return scalar(found, d), scalar(inv, d)

    samples = []
    add = samples.append

    found_inf, inv_scale = flags()
    add(("multi_tensor_unscale_", (mixed(0), found_inf, inv_scale), {}))
    with_inf = mixed(1)
    with_inf[-1].view(-1)[-1] = float("inf")
    add(("multi_tensor_unscale_", (with_inf, *flags()), {}))
    add(("multi_tensor_unscale_", ([], *flags(found=1.0)), {}))

    src = mixed(2)
    add(("multi_tensor_unscale_to_", (src, like(src, [f32]), *flags()), {}))
    add(("multi_tensor_unscale_to_", (src, like(src, [bf16, f32, f16]), *flags(found=1.0)), {}))

    add(("multi_tensor_check_finite_", (mixed(13), scalar(0.0, d)), {}))
    add(("multi_tensor_check_finite_", (with_inf, scalar(0.0, d)), {}))

    add(("multi_tensor_copy_", (fp32(3), like(fp32(3), [f16, bf16, f32])), {}))
    add(("multi_tensor_copy_", (mixed(4), like(mixed(4), [f32])), {}))

    add(("multi_tensor_l2norm", (mixed(5), None, False), {}))
    add(("multi_tensor_l2norm", (mixed(6), scalar(0.25, d), True), {}))
    add(("multi_tensor_l2norm", ([], scalar(0.25, d), True), {}))

    def sgd(params, grads, momentum, model, inv_scale, found_inf, **kw):
        bufs = like(params, [f32]) if momentum else []
        return ("fused_sgd_", (params, grads, bufs, model, 0.1, momentum, 0.0, 1e-2,
                               kw.get("nesterov", False), kw.get("first_run", False),
                               inv_scale, found_inf), {})

    add(sgd(mixed(7), mixed(8), 0.0, [], None, None))
    add(sgd(fp32(9), mixed(10), 0.9, like(fp32(9), [f16, bf16]), *flags(), nesterov=True))
    add(sgd(fp32(11), mixed(12), 0.9, like(fp32(11), [bf16]), *flags(found=1.0),
            first_run=True))
    # Lean state: bf16 momentum buffers (beside fp32 ones); Kahan compensations of bf16
    # params (given as a keyword, and skipped with found_inf).
    name, args, _ = sgd(fp32(60), mixed(61), 0.9, [], *flags())
    add((name, (args[0], args[1], like(args[0], [bf16, f32]), *args[3:]), {}))
    bf16_params = [randn(s, bf16, d, 62 + i) for i, s in enumerate(((5,), (3, 4), (2, 3, 2, 2)))]
    for found in (0.0, 1.0):
        name, args, _ = sgd(bf16_params, mixed(65), 0.9, [], *flags(found=found))
        add((name, (args[0], args[1], like(args[0], [bf16]), *args[3:]),
             {"kahan_comps": [randn(p.shape, bf16, d, 70 + i, scale=1e-3)
                                for i, p in enumerate(bf16_params)]}))

    def adam(params, grads, model, inv_scale, found_inf, decoupled=True, bias_correction=True):
        m, v = adam_state(params, d, seed=99)
        return ("fused_adam_", (params, grads, m, v, model, scalar(3.0, d), 1e-3, 0.9, 0.999,
                                1e-8, 1e-2, decoupled, bias_correction, inv_scale, found_inf), {})

    add(adam(mixed(13), mixed(14), [], None, None, decoupled=False))
    add(adam(fp32(15), mixed(16), like(fp32(15), [f16, bf16]), *flags()))
    add(adam(fp32(17), mixed(18), like(fp32(17), [f16]), *flags(found=1.0),
             bias_correction=False))
    # bf16 moments (with fp32 params, and over fp32 masters), Kahan compensations.
    for params, model in ((fp32(80), []), (fp32(81), like(fp32(81), [bf16]))):
        name, args, _ = adam(params, mixed(82), model, *flags())
        m, v = ([t.to(bf16) for t in ts] for ts in (args[2], args[3]))
        add((name, (args[0], args[1], m, v, *args[4:]), {}))
    for found in (0.0, 1.0):
        name, args, _ = adam(bf16_params, mixed(83), [], *flags(found=found))
        add((name, args, {"kahan_comps": [randn(p.shape, bf16, d, 90 + i, scale=1e-3)
                                            for i, p in enumerate(bf16_params)]}))
    # The precision report's tallies (4 float64 words per param, added to), with bf16
    # params and with fp32 masters.
    for params, model in ((bf16_params, []), (fp32(84), like(fp32(84), [bf16]))):
        name, args, _ = adam(params, mixed(85), model, *flags())
        add((name, args, {"precision_tallies": [torch.full((4,), 2.0, dtype=torch.float64,
                                                           device=d) for _ in params]}))

    # Stochastic rounding of bf16 params: a salt per param, a seed (all 64 bits), the step.
    salts = ops.rounding_words([(i, 8 * i + 3, 0, 0) for i in range(len(bf16_params))], d)
    for found in (0.0, 1.0):
        name, args, _ = sgd(bf16_params, mixed(66), 0.9, [], *flags(found=found))
        add((name, (args[0], args[1], like(args[0], [bf16]), *args[3:]),
             {"sr_salts": salts, "sr_seed": 2**63 - 1, "step": scalar(4.0, d)}))
        name, args, _ = adam(bf16_params, mixed(84), [], *flags(found=found))
        add((name, args, {"sr_salts": salts, "sr_seed": 17}))

    # torch.optim's options: maximize, a device learning rate, amsgrad's maxima (fp32, and
    # bf16 beside Kahan compensations), the unscaled gradients written back (and skipped).
    for found in (0.0, 1.0):
        name, args, _ = sgd(fp32(110), mixed(111), 0.9, like(fp32(110), [f16]),
                            *flags(found=found))
        add((name, args, {"maximize": True, "lr_tensor": scalar(0.05, d),
                          "unscale_grads": True}))
        name, args, _ = adam(fp32(112), mixed(113), like(fp32(112), [bf16]),
                             *flags(found=found))
        add((name, args, {"maximize": True, "unscale_grads": True, "lr_tensor": scalar(1e-3, d),
                          "max_exp_avg_sqs": [v.abs() * 2 for v in args[3]]}))
    name, args, _ = adam(bf16_params, mixed(114), [], *flags())
    m, v = ([t.to(bf16) for t in ts] for ts in (args[2], args[3]))
    add((name, (args[0], args[1], m, v, *args[4:]),
         {"max_exp_avg_sqs": [randn(p.shape, bf16, d, 115 + i).abs()
                                          for i, p in enumerate(bf16_params)],
                      "kahan_comps": [randn(p.shape, bf16, d, 120 + i, scale=1e-3)
                                        for i, p in enumerate(bf16_params)]}))
    name, args, _ = adam(fp32(116), mixed(117), [], None, None)
    add((name, args, {"max_exp_avg_sqs": [v.clone() for v in args[3]], "unscale_grads": True}))

    # master="remainder": an int16 remainder per bf16 param (every value of the range,
    # and skipped with found_inf), with fp32 and bf16 state, amsgrad and the options.
    def remainders(seed):
        gen = torch.Generator().manual_seed(seed)
        return [torch.randint(-2**15, 2**15, p.shape, generator=gen, dtype=torch.int16).to(d)
                for p in bf16_params]

    for found in (0.0, 1.0):
        name, args, _ = sgd(bf16_params, mixed(130), 0.9, [], *flags(found=found))
        add((name, (args[0], args[1], like(args[0], [bf16, f32]), *args[3:]),
             {"remainders": remainders(131), "maximize": True, "unscale_grads": True}))
        name, args, _ = adam(bf16_params, mixed(132), [], *flags(found=found))
        add((name, args, {"remainders": remainders(133)}))
    name, args, _ = adam(bf16_params, mixed(134), [], None, None, decoupled=False)
    m, v = ([t.to(bf16) for t in ts] for ts in (args[2], args[3]))
    add((name, (args[0], args[1], m, v, *args[4:]),
         {"max_exp_avg_sqs": [t.abs() for t in v], "remainders": remainders(135),
          "lr_tensor": scalar(1e-3, d)}))

    def lamb(params, grads, model, inv_scale, found_inf, grad_norm, decoupled=True, nvlamb=False):
        m, v = adam_state(params, d, seed=98)
        return ("fused_lamb_", (params, grads, m, v, model, scalar(3.0, d), 1e-3, 0.9, 0.999,
                                1e-6, 1e-2, decoupled, True, True, nvlamb, grad_norm, 1.0,
                                inv_scale, found_inf), {})

    add(lamb(mixed(24), mixed(25), [], None, None, None, decoupled=False))
    add(lamb(fp32(26), mixed(27), like(fp32(26), [f16, bf16]), *flags(), scalar(4.0, d)))
    add(lamb(fp32(28), mixed(29), like(fp32(28), [bf16]), *flags(found=1.0), scalar(0.5, d),
             nvlamb=True))

    def adagrad(params, grads, model, inv_scale, found_inf, w_mode=False):
        sums = [randn(p.shape, f32, d, 40 + i).square() for i, p in enumerate(params)]
        return ("fused_adagrad_", (params, grads, sums, model, 0.05, 1e-10, 1e-2, w_mode,
                                   inv_scale, found_inf), {})

    add(adagrad(mixed(41), mixed(42), [], None, None))
    add(adagrad(fp32(43), mixed(44), like(fp32(43), [f16, bf16]), *flags(), w_mode=True))
    add(adagrad(fp32(45), mixed(46), like(fp32(45), [bf16]), *flags(found=1.0)))

    def novograd(params, grads, model, inv_scale, found_inf, norm_type=2, step=3.0):
        m = [randn(p.shape, f32, d, 50 + i) for i, p in enumerate(params)]
        v = randn(len(params), f32, d, 49).abs()
        return ("fused_novograd_", (params, grads, m, model, v, scalar(step, d), 1e-2, 0.9, 0.98,
                                    1e-8, 1e-2, True, True, False, norm_type, False, inv_scale,
                                    found_inf), {})

    add(novograd(mixed(51), mixed(52), [], None, None, step=0.0))
    add(novograd(fp32(53), mixed(54), like(fp32(53), [f16, bf16]), *flags(), norm_type=0))
    add(novograd(fp32(55), mixed(56), like(fp32(55), [bf16]), *flags(found=1.0)))

    add(("sum_fp32", (randn((4, 5, 6), f16, d, 19),), {}))
    add(("sum_fp32", (randn((4, 5, 6), bf16, d, 20), [0, -1], True), {}))
    add(("sum_fp32", (randn((4, 10), f32, d, 21)[:, ::2], [1]), {}))
    add(("sum_fp32", (randn((4, 5), f16, d, 22).requires_grad_(), [0]), {"keepdim": False}))
    add(("sum_fp32", (randn((3, 4), torch.float64, d, 23).requires_grad_(),), {"dim": [1]}))

    def loss_scale(found, growth, hysteresis, **kw):
        return ("update_loss_scale_", (scalar(2.0**15, d), scalar(growth, d, torch.int32),
                                       scalar(hysteresis, d, torch.int32), scalar(found, d),
                                       2.0, 0.5, kw.get("interval", 3), kw.get("hyst", 1),
                                       1.0, 2.0**24), {})

    add(loss_scale(0.0, 2, 1))
    add(loss_scale(1.0, 1, 2, hyst=2))
    add(loss_scale(1.0, 0, 1))
    return samples


def test_sample_inputs_cover_every_op():
    """A new op cannot go without opcheck samples."""
    registered = {name.split("::")[1] for name in registered_ops()}
    assert {name for name, _, _ in sample_inputs("cpu")} == registered


@pytest.mark.parametrize("op_name", OP_NAMES)
def test_opcheck(device, op_name):
    op = getattr(torch.ops.mixedprec, op_name).default
    for name, args, kwargs in sample_inputs(device):
        if name == op_name:
            torch.library.opcheck(op, args, kwargs)


# --- torch.compile ----------------------------------------------------------------

def training_step(grads, found_inf, inv_scale, params, exp_avgs, exp_avg_sqs, step, x):
    ops.multi_tensor_unscale_(grads, found_inf, inv_scale)
    norm, per_tensor = ops.multi_tensor_l2norm(grads, None, per_tensor=True)
    ops.fused_adam_(params, grads, exp_avgs, exp_avg_sqs, [], step=step, lr=1e-2, weight_decay=1e-2,
                    found_inf=found_inf)
    return norm, per_tensor, ops.sum_fp32(x, [1]) * 2


def test_compile_fullgraph_matches_eager(device):
    def inputs():
        params = [randn(s, torch.float32, device, i) for i, s in enumerate([(5,), (3, 4)])]
        grads = [randn(p.shape, dt, device, 10 + i)
                 for i, (p, dt) in enumerate(zip(params, [torch.float16, torch.bfloat16]))]
        m, v = adam_state(params, device, seed=20)
        return dict(grads=grads, found_inf=scalar(0.0, device), inv_scale=scalar(0.25, device),
                    params=params, exp_avgs=m, exp_avg_sqs=v, step=scalar(0.0, device),
                    x=randn((6, 7), torch.float16, device, 30))

    eager_args, compiled_args = inputs(), inputs()
    torch._dynamo.reset()
    # aot_eager: functionalization and the fake kernels as inductor sees them, without
    # inductor's minute-long C++ build on a two-core CI machine.
    compiled = torch.compile(training_step, fullgraph=True, backend="aot_eager")

    eager_out = training_step(**eager_args)
    compiled_out = compiled(**compiled_args)

    for e, c in zip(eager_out, compiled_out):
        torch.testing.assert_close(c, e, rtol=1e-6, atol=0)
    for key in eager_args:
        for e, c in zip(*(a if isinstance(a, list) else [a]
                          for a in (eager_args[key], compiled_args[key]))):
            assert_bitwise_equal(c, e, msg=f"{key} after the compiled step")
    assert compiled_args["step"].item() == 1.0


# --- calls without any tensor ---------------------------------------------------------

def test_calls_without_tensors_are_no_ops():
    """Empty lists and no optional tensor: the dispatcher has no tensor to pick a
    kernel by, and the ops must still work (no-ops) through torch.ops directly."""
    torch.ops.mixedprec.multi_tensor_copy_.default([], [])
    for momentum in (0.0, 0.9):
        torch.ops.mixedprec.fused_sgd_.default([], [], [], [], 0.1, momentum, 0.0, 0.0, False,
                                               False, None, None)
    for per_tensor in (False, True):
        norm, per = torch.ops.mixedprec.multi_tensor_l2norm.default([], None, per_tensor)
        assert_bitwise_equal(norm, torch.zeros(1))
        assert_bitwise_equal(per, torch.empty(0))


def test_calls_without_tensors_are_still_validated():
    with pytest.raises(ValueError, match="lr"):
        torch.ops.mixedprec.fused_sgd_.default([], [], [], [], -1.0, 0.0, 0.0, 0.0, False,
                                               False, None, None)


# --- meta tensors ----------------------------------------------------------------------

def meta_cases():
    """(op name, args builder, argument moved to meta, list index or None)."""
    from test_errors import OPS
    cases = [
        ("multi_tensor_unscale_", "found_inf", None),
        ("multi_tensor_unscale_", "tensors", 1),
        ("multi_tensor_unscale_", "inv_scale", None),
        ("multi_tensor_unscale_to_", "dst", 2),
        ("multi_tensor_unscale_to_", "src", 0),
        ("multi_tensor_check_finite_", "found_inf", None),
        ("multi_tensor_check_finite_", "tensors", 2),
        ("multi_tensor_copy_", "src", 1),
        ("multi_tensor_copy_", "dst", 0),
        ("multi_tensor_l2norm", "inv_scale", None),
        ("multi_tensor_l2norm", "tensors", 1),
        ("fused_sgd_", "found_inf", None),
        ("fused_sgd_", "inv_scale", None),
        ("fused_sgd_", "momentum_buffers", 1),
        ("fused_sgd_", "grads", 0),
        ("fused_adam_", "step", None),
        ("fused_adam_", "found_inf", None),
        ("fused_adam_", "exp_avg_sqs", 2),
        ("fused_adam_", "model_params", 0),
        ("update_loss_scale_", "found_inf", None),
        ("update_loss_scale_", "growth_tracker", None),
        ("fused_adagrad_", "state_sums", 1),
        ("fused_adagrad_", "found_inf", None),
        ("fused_novograd_", "exp_avg_sq", None),
        ("fused_novograd_", "exp_avgs", 1),
    ]
    return [pytest.param(op, OPS[op], name, index, id=f"{op}-{name}") for op, name, index in cases]


@pytest.mark.parametrize("op_name, op_and_args, name, index", meta_cases())
def test_meta_mixed_with_real_tensors_is_rejected(device, op_name, op_and_args, name, index):
    """A meta tensor among real ones would send the call to the fake kernel, a silent
    no-op: it must raise, naming the meta argument, and write nothing."""
    op, build = op_and_args
    args = build(device)
    before = snapshot(args)
    container, key = (args, name) if index is None else (args[name], index)
    real = container[key]
    container[key] = real.to("meta")
    meta_name = name if index is None else f"{name}[{index}]"
    with pytest.raises(RuntimeError, match=re.escape(f"{meta_name} is on meta")):
        op(**args)
    container[key] = real
    assert_unchanged(args, before)


def map_tensors(args, fn):
    """args with fn applied to every tensor, in lists too."""
    def one(v):
        return fn(v) if isinstance(v, torch.Tensor) else v
    return {k: [one(x) for x in v] if isinstance(v, list) else one(v) for k, v in args.items()}


@pytest.mark.parametrize("op_name", OP_NAMES)
def test_all_meta_calls_infer_shapes(op_name):
    from test_errors import OPS
    op, build = OPS[op_name]
    args = map_tensors(build("cpu"), lambda t: t.to("meta"))
    out = op(**args)
    if op_name == "multi_tensor_l2norm":
        assert [o.device.type for o in out] == ["meta", "meta"]
        assert out[0].shape == (1,) and out[1].shape == (3,)
    elif op_name == "sum_fp32":
        assert out.device.type == "meta" and out.dtype == torch.float32


@pytest.mark.parametrize("op_name", OP_NAMES)
def test_fake_tensor_mode_calls(device, op_name):
    """FakeTensors report their fake device, not meta: no error."""
    from test_errors import OPS
    from torch._subclasses.fake_tensor import FakeTensorMode
    op, build = OPS[op_name]
    args = build(device)
    with FakeTensorMode() as mode:
        op(**map_tensors(args, mode.from_tensor))
