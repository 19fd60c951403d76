"""Bad arguments: the exception type, a message that names the argument, and no
tensor written. Each case starts from a valid call (test_valid_calls) and breaks
one thing."""

import inspect
import re
import warnings
from dataclasses import dataclass
from typing import Callable

import pytest
import torch
from helpers import assert_unchanged, randn, scalar, snapshot

from mixedprec import ops

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


# --- valid calls --------------------------------------------------------------------

def unscale_args(d):
    return dict(tensors=[randn(4, F32, d, 0), randn((3, 4), F16, d, 1), randn(5, BF16, d, 2)],
                found_inf=scalar(0.0, d), inv_scale=scalar(0.5, d))


def unscale_to_args(d):
    src = [randn(4, F32, d, 0), randn((3, 4), F16, d, 1), randn((2, 3, 2, 2), BF16, d, 2)]
    dst = [torch.zeros_like(src[0], dtype=F16), torch.zeros_like(src[1], dtype=F32),
           torch.zeros_like(src[2], dtype=F32)]
    return dict(src=src, dst=dst, found_inf=scalar(0.0, d), inv_scale=scalar(0.5, d))


def copy_args(d):
    args = unscale_to_args(d)
    return dict(src=args["src"], dst=args["dst"])


def l2norm_args(d):
    return dict(tensors=unscale_args(d)["tensors"], inv_scale=scalar(0.5, d), per_tensor=True)


def optimizer_lists(d):
    params = [randn(4, F32, d, 0), randn((3, 4), F32, d, 1), randn(5, F32, d, 2)]
    grads = [randn(4, F16, d, 3), randn((3, 4), BF16, d, 4), randn(5, F32, d, 5)]
    model = [params[0].to(F16), params[1].to(BF16), params[2].clone()]
    return params, grads, model


def sgd_args(d):
    params, grads, model = optimizer_lists(d)
    return dict(params=params, grads=grads,
                momentum_buffers=[torch.zeros_like(p) for p in params], model_params=model,
                lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False,
                first_run=False, inv_scale=scalar(0.5, d), found_inf=scalar(0.0, d))


def adam_args(d):
    params, grads, model = optimizer_lists(d)
    return dict(params=params, grads=grads, exp_avgs=[torch.zeros_like(p) for p in params],
                exp_avg_sqs=[torch.zeros_like(p) for p in params], model_params=model,
                step=scalar(0.0, d), lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                weight_decay=0.0, decoupled_weight_decay=True, bias_correction=True,
                inv_scale=scalar(0.5, d),
                found_inf=scalar(0.0, d))


def kahan_lists(d):
    """bf16 params updated directly, each with a bf16 Kahan compensation."""
    params = [randn(4, BF16, d, 0), randn((3, 4), BF16, d, 1), randn(5, BF16, d, 2)]
    grads = [randn(4, F16, d, 3), randn((3, 4), BF16, d, 4), randn(5, F32, d, 5)]
    return params, grads, [torch.zeros_like(p) for p in params]


def sgd_kahan_args(d):
    args = sgd_args(d)
    params, grads, comps = kahan_lists(d)
    args.update(params=params, grads=grads, model_params=[], kahan_comps=comps,
                momentum_buffers=[torch.zeros_like(p) for p in params])  # bf16 momentum
    return args


def adam_kahan_args(d):
    args = adam_args(d)
    params, grads, comps = kahan_lists(d)
    args.update(params=params, grads=grads, model_params=[], kahan_comps=comps,
                exp_avgs=[torch.zeros_like(p) for p in params],  # bf16 moments
                exp_avg_sqs=[torch.zeros_like(p) for p in params])
    return args


def stochastic_lists(d):
    """bf16 params updated directly, rounded stochastically: a salt each, a seed."""
    params, grads, _ = kahan_lists(d)
    return params, grads, ops.rounding_words([(i,) for i in range(len(params))], d)


def sgd_stochastic_args(d):
    args = sgd_args(d)
    params, grads, salts = stochastic_lists(d)
    args.update(params=params, grads=grads, model_params=[], sr_salts=salts, sr_seed=123,
                step=scalar(1.0, d), momentum_buffers=[torch.zeros_like(p) for p in params])
    return args


def adam_stochastic_args(d):
    args = adam_args(d)
    params, grads, salts = stochastic_lists(d)
    args.update(params=params, grads=grads, model_params=[], sr_salts=salts, sr_seed=2**63 - 1,
                exp_avgs=[torch.zeros_like(p) for p in params],
                exp_avg_sqs=[torch.zeros_like(p) for p in params])
    return args


def sgd_options_args(d):
    """torch.optim's options: maximize, the learning rate on the device, the unscaled
    gradients written back (grads then written)."""
    args = sgd_args(d)
    args.update(maximize=True, lr_tensor=scalar(0.1, d), unscale_grads=True)
    return args


def adam_options_args(d):
    """amsgrad (max_exp_avg_sqs), maximize, the learning rate on the device, the unscaled
    gradients written back (grads then written)."""
    args = adam_args(d)
    args.update(maximize=True, max_exp_avg_sqs=[torch.zeros_like(p) for p in args["params"]],
                lr_tensor=scalar(1e-3, d), unscale_grads=True)
    return args


def adam_kahan_amsgrad_args(d):
    """amsgrad in a lean mode: bf16 maxima beside bf16 moments and compensations."""
    args = adam_kahan_args(d)
    args.update(max_exp_avg_sqs=[torch.zeros_like(p) for p in args["params"]],
                unscale_grads=True)
    return args


def lamb_args(d):
    args = adam_args(d)
    args.update(eps=1e-6, weight_decay=1e-2, grad_averaging=True, use_nvlamb=False,
                global_grad_norm=scalar(2.0, d), max_grad_norm=1.0)
    return args


def adagrad_args(d):
    params, grads, model = optimizer_lists(d)
    return dict(params=params, grads=grads, state_sums=[torch.zeros_like(p) for p in params],
                model_params=model, lr=1e-2, eps=1e-10, weight_decay=0.0,
                decoupled_weight_decay=False,
                inv_scale=scalar(0.5, d), found_inf=scalar(0.0, d))


def novograd_args(d):
    params, grads, model = optimizer_lists(d)
    return dict(params=params, grads=grads, exp_avgs=[torch.zeros_like(p) for p in params],
                model_params=model, exp_avg_sq=torch.zeros(len(params), device=d),
                step=scalar(0.0, d), lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                weight_decay=0.0, bias_correction=True, grad_averaging=True,
                reg_inside_moment=False, norm_type=2, init_zero=False, inv_scale=scalar(0.5, d),
                found_inf=scalar(0.0, d))


def sum_args(d):
    return {"self": randn((3, 4), F16, d, 0), "dim": [1], "keepdim": False}


def loss_scale_args(d):
    return dict(scale=scalar(1024.0, d), growth_tracker=scalar(0, d, torch.int32),
                hysteresis_tracker=scalar(1, d, torch.int32), found_inf=scalar(0.0, d),
                growth_factor=2.0, backoff_factor=0.5, growth_interval=100, hysteresis=1,
                min_scale=1.0, max_scale=2.0**24)


def check_finite_args(d):
    args = unscale_args(d)
    return dict(tensors=args["tensors"], found_inf=args["found_inf"])


OPS = {
    "multi_tensor_unscale_": (ops.multi_tensor_unscale_, unscale_args),
    "multi_tensor_check_finite_": (ops.multi_tensor_check_finite_, check_finite_args),
    "multi_tensor_unscale_to_": (ops.multi_tensor_unscale_to_, unscale_to_args),
    "multi_tensor_copy_": (ops.multi_tensor_copy_, copy_args),
    "multi_tensor_l2norm": (ops.multi_tensor_l2norm, l2norm_args),
    "fused_sgd_": (ops.fused_sgd_, sgd_args),
    "fused_adam_": (ops.fused_adam_, adam_args),
    "fused_sgd_-kahan": (ops.fused_sgd_, sgd_kahan_args),
    "fused_adam_-kahan": (ops.fused_adam_, adam_kahan_args),
    "fused_sgd_-stochastic": (ops.fused_sgd_, sgd_stochastic_args),
    "fused_adam_-stochastic": (ops.fused_adam_, adam_stochastic_args),
    "fused_sgd_-options": (ops.fused_sgd_, sgd_options_args),
    "fused_adam_-options": (ops.fused_adam_, adam_options_args),
    "fused_adam_-kahan-amsgrad": (ops.fused_adam_, adam_kahan_amsgrad_args),
    "fused_lamb_": (ops.fused_lamb_, lamb_args),
    "sum_fp32": (ops.sum_fp32, sum_args),
    "update_loss_scale_": (ops.update_loss_scale_, loss_scale_args),
    "fused_adagrad_": (ops.fused_adagrad_, adagrad_args),
    "fused_novograd_": (ops.fused_novograd_, novograd_args),
}


@pytest.mark.parametrize("op_name", OPS)
def test_valid_calls(device, op_name):
    """The starting point of every error case is accepted."""
    op, build = OPS[op_name]
    op(**build(device))


# --- breaking one thing ------------------------------------------------------------

def set_arg(name, value):
    """Replaces argument `name` by value(kwargs, device) (or a constant)."""
    def mutate(args, d):
        args[name] = value(args, d) if callable(value) else value
    return mutate


def set_item(name, i, value):
    """Replaces element i of list argument `name` by value(old tensor)."""
    def mutate(args, d):
        args[name][i] = value(args[name][i])
    return mutate


def drop_last(name):
    def mutate(args, d):
        args[name].pop()
    return mutate


def as_dtype(dtype):
    return lambda t: t.to(dtype)


def sparse(t):
    return t.to_sparse()


def non_dense(t):
    """Same shape and dtype, every other column of a wider tensor."""
    wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype, device=t.device)
    view = wide[..., ::2]
    view.copy_(t)
    assert view.stride(-1) == 2  # a gap between neighbours: not dense
    return view


def other_numel(t):
    return torch.zeros(t.numel() + 1, dtype=t.dtype, device=t.device)


def channels_last(t):
    return t.contiguous(memory_format=torch.channels_last)


def one(dtype):
    return lambda args, d: scalar(0.0, d, dtype)


def sized(name, numel):
    """A replacement for scalar argument `name` with `numel` elements, of its dtype."""
    return lambda args, d: torch.zeros(numel, device=d, dtype=args[name].dtype)


@dataclass
class Case:
    op: str
    id: str
    mutate: Callable
    error: type
    name: str  # the argument the message must name

    def param(self):
        return pytest.param(self, id=f"{self.op}-{self.id}")


def list_cases(op, list_name, index, dtypes_rejected, layout=True):
    """Dtype, sparse and non-dense cases for one element of a list argument."""
    cases = [Case(op, f"{list_name}-{str(dt).split('.')[-1]}",
                  set_item(list_name, index, as_dtype(dt)), TypeError, f"{list_name}[{index}]")
             for dt in dtypes_rejected]
    if layout:
        cases += [
            Case(op, f"{list_name}-sparse", set_item(list_name, index, sparse), TypeError,
                 f"{list_name}[{index}]"),
            Case(op, f"{list_name}-non-dense", set_item(list_name, index, non_dense), ValueError,
                 f"{list_name}[{index}]"),
        ]
    return cases


def scalar_cases(op, name, good_dtype=torch.float32):
    bad = [t for t in (torch.float32, torch.float16, torch.float64, torch.int32, torch.int64)
           if t != good_dtype]
    return [Case(op, f"{name}-{str(dt).split('.')[-1]}", set_arg(name, one(dt)), TypeError, name)
            for dt in bad] + [
        Case(op, f"{name}-2-elements", set_arg(name, sized(name, 2)), ValueError, name),
        Case(op, f"{name}-0-elements", set_arg(name, sized(name, 0)), ValueError, name),
    ]


def value_case(op, name, value):
    return Case(op, f"{name}={value}", set_arg(name, value), ValueError, name)


BAD_LIST_DTYPES = [torch.int32, torch.complex64, torch.float64]

CASES = [
    # multi_tensor_unscale_
    *list_cases("multi_tensor_unscale_", "tensors", 1, BAD_LIST_DTYPES),
    *list_cases("multi_tensor_unscale_", "tensors", 2, [torch.float64], layout=False),
    Case("multi_tensor_unscale_", "tensors-overlapping",
         set_item("tensors", 0, lambda t: t[:1].expand(t.shape)), ValueError, "tensors[0]"),
    *scalar_cases("multi_tensor_unscale_", "found_inf"),
    *scalar_cases("multi_tensor_unscale_", "inv_scale"),
    # multi_tensor_check_finite_
    *list_cases("multi_tensor_check_finite_", "tensors", 0, BAD_LIST_DTYPES),
    *scalar_cases("multi_tensor_check_finite_", "found_inf"),
    # multi_tensor_unscale_to_
    Case("multi_tensor_unscale_to_", "dst-shorter", drop_last("dst"), ValueError, "dst"),
    Case("multi_tensor_unscale_to_", "dst-numel", set_item("dst", 1, other_numel), ValueError,
         "dst[1]"),
    Case("multi_tensor_unscale_to_", "dst-memory-order", set_item("dst", 2, channels_last),
         ValueError, "dst[2]"),
    *list_cases("multi_tensor_unscale_to_", "src", 0, BAD_LIST_DTYPES),
    *list_cases("multi_tensor_unscale_to_", "dst", 1, BAD_LIST_DTYPES),
    *scalar_cases("multi_tensor_unscale_to_", "found_inf"),
    *scalar_cases("multi_tensor_unscale_to_", "inv_scale"),
    # multi_tensor_copy_
    Case("multi_tensor_copy_", "dst-shorter", drop_last("dst"), ValueError, "dst"),
    Case("multi_tensor_copy_", "src-shorter", drop_last("src"), ValueError, "dst"),
    Case("multi_tensor_copy_", "dst-numel", set_item("dst", 0, other_numel), ValueError, "dst[0]"),
    *list_cases("multi_tensor_copy_", "src", 2, BAD_LIST_DTYPES),
    *list_cases("multi_tensor_copy_", "dst", 1, BAD_LIST_DTYPES),
    # multi_tensor_l2norm
    *list_cases("multi_tensor_l2norm", "tensors", 1, BAD_LIST_DTYPES),
    *scalar_cases("multi_tensor_l2norm", "inv_scale"),
    # fused_sgd_
    Case("fused_sgd_", "grads-shorter", drop_last("grads"), ValueError, "grads"),
    Case("fused_sgd_", "grads-numel", set_item("grads", 2, other_numel), ValueError, "grads[2]"),
    Case("fused_sgd_", "momentum_buffers-shorter", drop_last("momentum_buffers"), ValueError,
         "momentum_buffers"),
    Case("fused_sgd_", "momentum_buffers-numel", set_item("momentum_buffers", 1, other_numel),
         ValueError, "momentum_buffers[1]"),
    Case("fused_sgd_", "momentum_buffers-with-momentum-0", set_arg("momentum", 0.0), ValueError,
         "momentum_buffers"),
    Case("fused_sgd_", "model_params-shorter", drop_last("model_params"), ValueError,
         "model_params"),
    Case("fused_sgd_", "model_params-numel", set_item("model_params", 0, other_numel),
         ValueError, "model_params[0]"),
    Case("fused_sgd_", "masters-fp16", set_item("params", 1, as_dtype(torch.float16)), TypeError,
         "params[1]"),
    Case("fused_sgd_", "grads-memory-order", set_item("grads", 1, lambda t: t.t().contiguous().t()),
         ValueError, "grads[1]"),
    *list_cases("fused_sgd_", "params", 0, BAD_LIST_DTYPES),
    *list_cases("fused_sgd_", "grads", 1, BAD_LIST_DTYPES),
    *list_cases("fused_sgd_", "momentum_buffers", 2, [torch.float16, torch.float64]),
    *list_cases("fused_sgd_", "model_params", 0, BAD_LIST_DTYPES),
    *scalar_cases("fused_sgd_", "found_inf"),
    *scalar_cases("fused_sgd_", "inv_scale"),
    value_case("fused_sgd_", "lr", -0.1),
    value_case("fused_sgd_", "lr", float("nan")),
    value_case("fused_sgd_", "lr", float("inf")),
    value_case("fused_sgd_", "momentum", -0.5),
    value_case("fused_sgd_", "momentum", float("inf")),
    value_case("fused_sgd_", "dampening", float("inf")),
    value_case("fused_sgd_", "weight_decay", -1e-4),
    Case("fused_sgd_", "nesterov-momentum-0",
         lambda a, d: a.update(nesterov=True, momentum=0.0, momentum_buffers=[]),
         ValueError, "momentum"),
    Case("fused_sgd_", "nesterov-dampening", lambda a, d: a.update(nesterov=True, dampening=0.1),
         ValueError, "dampening"),
    # fused_adam_
    *scalar_cases("fused_adam_", "step"),
    *scalar_cases("fused_adam_", "found_inf"),
    *scalar_cases("fused_adam_", "inv_scale"),
    Case("fused_adam_", "grads-shorter", drop_last("grads"), ValueError, "grads"),
    Case("fused_adam_", "exp_avgs-shorter", drop_last("exp_avgs"), ValueError, "exp_avgs"),
    Case("fused_adam_", "exp_avg_sqs-numel", set_item("exp_avg_sqs", 1, other_numel),
         ValueError, "exp_avg_sqs[1]"),
    Case("fused_adam_", "model_params-shorter", drop_last("model_params"), ValueError,
         "model_params"),
    Case("fused_adam_", "masters-bf16", set_item("params", 0, as_dtype(torch.bfloat16)),
         TypeError, "params[0]"),
    *list_cases("fused_adam_", "params", 2, BAD_LIST_DTYPES),
    *list_cases("fused_adam_", "grads", 0, BAD_LIST_DTYPES),
    *list_cases("fused_adam_", "exp_avgs", 1, [torch.float16, torch.float64]),
    Case("fused_adam_", "exp_avg_sqs-dtype-of-exp_avgs",
         set_item("exp_avg_sqs", 1, as_dtype(torch.bfloat16)), TypeError, "exp_avg_sqs[1]"),
    *list_cases("fused_adam_", "exp_avg_sqs", 2, [torch.float16, torch.float64]),
    *list_cases("fused_adam_", "model_params", 1, BAD_LIST_DTYPES),
    value_case("fused_adam_", "lr", -1e-3),
    value_case("fused_adam_", "lr", float("nan")),
    value_case("fused_adam_", "beta1", 1.0),
    value_case("fused_adam_", "beta1", -0.1),
    value_case("fused_adam_", "beta2", 1.5),
    value_case("fused_adam_", "beta2", float("nan")),
    value_case("fused_adam_", "eps", -1e-8),
    value_case("fused_adam_", "eps", float("inf")),
    value_case("fused_adam_", "weight_decay", -0.1),
    # Kahan compensations (fused_sgd_ and fused_adam_ alike)
    *[case for op in ("fused_sgd_-kahan", "fused_adam_-kahan") for case in (
        Case(op, "kahan_comps-shorter", drop_last("kahan_comps"), ValueError,
             "kahan_comps"),
        Case(op, "kahan_comps-numel", set_item("kahan_comps", 1, other_numel), ValueError,
             "kahan_comps[1]"),
        Case(op, "params-fp32", set_item("params", 2, as_dtype(torch.float32)), TypeError,
             "params[2]"),
        Case(op, "params-fp16", set_item("params", 0, as_dtype(torch.float16)), TypeError,
             "params[0]"),
        Case(op, "with-masters", lambda a, d: a.update(
            model_params=a["params"], params=[p.float() for p in a["params"]]), ValueError,
            "model_params"),
        *list_cases(op, "kahan_comps", 1, [torch.float32, torch.float16, torch.float64]),
    )],
    # Stochastic rounding (fused_sgd_ and fused_adam_ alike)
    *[case for op in ("fused_sgd_-stochastic", "fused_adam_-stochastic") for case in (
        Case(op, "sr_salts-shorter", drop_last("sr_salts"), ValueError, "sr_salts"),
        Case(op, "sr_salts-numel", set_item("sr_salts", 1, other_numel), ValueError,
             "sr_salts[1]"),
        Case(op, "sr_salts-float64", set_item("sr_salts", 1, as_dtype(torch.float64)),
             TypeError, "sr_salts[1]"),
        Case(op, "sr_salts-float32-value", set_item("sr_salts", 1, lambda t: t[:, :1].float()),
             TypeError, "sr_salts[1]"),
        Case(op, "sr_salts-strided", set_item("sr_salts", 1, lambda t: t.repeat(1, 2)[:, ::2]),
             ValueError, "sr_salts[1]"),
        Case(op, "sr_salts-without-seed", set_arg("sr_seed", None), ValueError, "sr_salts"),
        Case(op, "params-fp32", set_item("params", 2, as_dtype(torch.float32)), TypeError,
             "params[2]"),
        Case(op, "with-masters", lambda a, d: a.update(
            model_params=a["params"], params=[p.float() for p in a["params"]]), ValueError,
            "model_params"),
        Case(op, "with-kahan_comps", set_arg("kahan_comps", lambda a, d: [
            torch.zeros_like(p) for p in a["params"]]), ValueError, "kahan_comps"),
    )],
    # torch.optim's options: lr_tensor, amsgrad's maxima (of exp_avg_sqs' dtype)
    *scalar_cases("fused_sgd_-options", "lr_tensor"),
    Case("fused_adam_-options", "max_exp_avg_sqs-shorter", drop_last("max_exp_avg_sqs"),
         ValueError, "max_exp_avg_sqs"),
    Case("fused_adam_-options", "max_exp_avg_sqs-empty", set_arg("max_exp_avg_sqs", []),
         ValueError, "max_exp_avg_sqs"),
    Case("fused_adam_-options", "max_exp_avg_sqs-numel",
         set_item("max_exp_avg_sqs", 1, other_numel), ValueError, "max_exp_avg_sqs[1]"),
    Case("fused_adam_-options", "max_exp_avg_sqs-memory-order",
         set_item("max_exp_avg_sqs", 1, lambda t: t.t().contiguous().t()), ValueError,
         "max_exp_avg_sqs[1]"),
    Case("fused_adam_-options", "max_exp_avg_sqs-dtype-of-exp_avg_sqs",
         set_item("max_exp_avg_sqs", 2, as_dtype(torch.bfloat16)), TypeError,
         "max_exp_avg_sqs[2]"),
    Case("fused_adam_-kahan-amsgrad", "max_exp_avg_sqs-dtype-of-exp_avg_sqs",
         set_item("max_exp_avg_sqs", 0, as_dtype(torch.float32)), TypeError,
         "max_exp_avg_sqs[0]"),
    *list_cases("fused_adam_-options", "max_exp_avg_sqs", 0, [torch.float16, torch.float64]),
    *scalar_cases("fused_adam_-options", "lr_tensor"),
    Case("fused_sgd_-stochastic", "no-step", set_arg("step", None), ValueError, "step"),
    Case("fused_sgd_-stochastic", "step-numel", set_arg("step", sized("step", 2)), ValueError,
         "step"),
    # sum_fp32
    Case("sum_fp32", "self-int32", set_arg("self", lambda a, d: a["self"].int()),
         TypeError, "self"),
    Case("sum_fp32", "self-complex64", set_arg("self", lambda a, d: a["self"].to(torch.complex64)),
         TypeError, "self"),
    Case("sum_fp32", "self-sparse", set_arg("self", lambda a, d: a["self"].float().to_sparse()),
         TypeError, "self"),
    # update_loss_scale_
    *scalar_cases("update_loss_scale_", "scale"),
    *scalar_cases("update_loss_scale_", "growth_tracker", torch.int32),
    *scalar_cases("update_loss_scale_", "hysteresis_tracker", torch.int32),
    *scalar_cases("update_loss_scale_", "found_inf"),
    value_case("update_loss_scale_", "growth_factor", 0.5),
    value_case("update_loss_scale_", "growth_factor", float("inf")),
    value_case("update_loss_scale_", "backoff_factor", 0.0),
    value_case("update_loss_scale_", "backoff_factor", 1.5),
    value_case("update_loss_scale_", "growth_interval", 0),
    value_case("update_loss_scale_", "hysteresis", 0),
    value_case("update_loss_scale_", "min_scale", -1.0),
    value_case("update_loss_scale_", "min_scale", 2.0**25),  # above max_scale
    Case("update_loss_scale_", "max_scale=0", lambda a, d: a.update(min_scale=0.0, max_scale=0.0),
         ValueError, "max_scale"),
    # "expected <name>": the other bound's message mentions this one, blaming the wrong one
    Case("update_loss_scale_", "max_scale=nan", set_arg("max_scale", float("nan")), ValueError,
         "expected max_scale"),
    Case("update_loss_scale_", "min_scale=nan", set_arg("min_scale", float("nan")), ValueError,
         "expected min_scale"),
    Case("update_loss_scale_", "both-nan",
         lambda a, d: a.update(min_scale=float("nan"), max_scale=float("nan")), ValueError,
         "expected max_scale"),
    Case("update_loss_scale_", "min-above-max", set_arg("min_scale", 2.0**25), ValueError,
         "expected min_scale"),
]


# --- sparse compressed layouts (CSR, CSC, BSR, BSC) ---------------------------------

SPARSE_COMPRESSED = [torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc]


def compressed(layout):
    """The tensor as a 2-D float32 matrix in a sparse compressed layout."""
    def convert(t):
        blocks = (1, 1) if layout in (torch.sparse_bsr, torch.sparse_bsc) else None
        with warnings.catch_warnings():  # "Sparse CSR tensor support is in beta state"
            warnings.simplefilter("ignore", UserWarning)
            return t.float().reshape(1, -1).to_sparse(layout=layout, blocksize=blocks)
    return convert


# (op, argument, list index or None): one tensor of each op.
COMPRESSED_ARGS = [
    ("multi_tensor_unscale_", "tensors", 1),
    ("multi_tensor_check_finite_", "tensors", 0),
    ("multi_tensor_unscale_to_", "src", 2),
    ("multi_tensor_copy_", "dst", 1),
    ("multi_tensor_l2norm", "tensors", 2),
    ("fused_sgd_", "grads", 1),
    ("fused_adam_", "exp_avg_sqs", 0),
    ("sum_fp32", "self", None),
    ("update_loss_scale_", "scale", None),
]

CASES += [
    Case(op, f"{name}-{str(layout).split('.')[-1]}",
         set_item(name, index, compressed(layout)) if index is not None
         else set_arg(name, lambda a, d, name=name, layout=layout: compressed(layout)(a[name])),
         TypeError, name if index is None else f"{name}[{index}]")
    for op, name, index in COMPRESSED_ARGS for layout in SPARSE_COMPRESSED
]


CASES += [
    *scalar_cases("fused_lamb_", "step"),
    *scalar_cases("fused_lamb_", "found_inf"),
    *scalar_cases("fused_lamb_", "inv_scale"),
    *scalar_cases("fused_lamb_", "global_grad_norm"),
    Case("fused_lamb_", "grads-shorter", drop_last("grads"), ValueError, "grads"),
    Case("fused_lamb_", "exp_avgs-shorter", drop_last("exp_avgs"), ValueError, "exp_avgs"),
    Case("fused_lamb_", "exp_avg_sqs-numel", set_item("exp_avg_sqs", 1, other_numel),
         ValueError, "exp_avg_sqs[1]"),
    Case("fused_lamb_", "masters-bf16", set_item("params", 0, as_dtype(torch.bfloat16)),
         TypeError, "params[0]"),
    *list_cases("fused_lamb_", "params", 2, BAD_LIST_DTYPES),
    *list_cases("fused_lamb_", "grads", 0, BAD_LIST_DTYPES),
    *list_cases("fused_lamb_", "exp_avgs", 1, [torch.float16, torch.bfloat16]),
    *list_cases("fused_lamb_", "model_params", 1, BAD_LIST_DTYPES),
    value_case("fused_lamb_", "lr", -1e-3),
    value_case("fused_lamb_", "beta1", 1.0),
    value_case("fused_lamb_", "beta2", float("nan")),
    value_case("fused_lamb_", "eps", -1e-8),
    value_case("fused_lamb_", "weight_decay", float("inf")),
    value_case("fused_lamb_", "max_grad_norm", 0.0),
    value_case("fused_lamb_", "max_grad_norm", float("nan")),
]


def check_rejected(case, args):
    op, _ = OPS[case.op]
    before = snapshot(args)
    with pytest.raises(case.error, match=re.escape(case.name)):
        op(**args)
    assert_unchanged(args, before)


@pytest.mark.parametrize("case", [c.param() for c in CASES])
def test_bad_argument(device, case):
    args = OPS[case.op][1](device)
    case.mutate(args, device)
    check_rejected(case, args)


# --- tensors on another device -------------------------------------------------------

def move(name, index=None):
    """Moves argument `name` (or its element `index`) to the other device."""
    def mutate(args, other):
        if index is None:
            args[name] = args[name].to(other)
        else:
            args[name][index] = args[name][index].to(other)
    return mutate


DEVICE_CASES = [
    Case("multi_tensor_unscale_", "tensors", move("tensors", 2), RuntimeError, "tensors[2]"),
    Case("multi_tensor_unscale_", "found_inf", move("found_inf"), RuntimeError, "found_inf"),
    Case("multi_tensor_unscale_", "inv_scale", move("inv_scale"), RuntimeError, "inv_scale"),
    Case("multi_tensor_check_finite_", "tensors", move("tensors", 1), RuntimeError,
         "tensors[1]"),
    Case("multi_tensor_check_finite_", "found_inf", move("found_inf"), RuntimeError,
         "found_inf"),
    Case("multi_tensor_unscale_to_", "dst", move("dst", 1), RuntimeError, "dst[1]"),
    Case("multi_tensor_unscale_to_", "src", move("src", 0), RuntimeError, "src[0]"),
    Case("multi_tensor_copy_", "src", move("src", 1), RuntimeError, "src[1]"),
    Case("multi_tensor_copy_", "dst", move("dst", 0), RuntimeError, "dst[0]"),
    Case("multi_tensor_l2norm", "tensors", move("tensors", 1), RuntimeError, "tensors[1]"),
    Case("multi_tensor_l2norm", "inv_scale", move("inv_scale"), RuntimeError, "inv_scale"),
    Case("fused_sgd_", "grads", move("grads", 2), RuntimeError, "grads[2]"),
    Case("fused_sgd_", "params", move("params", 1), RuntimeError, "params[1]"),
    Case("fused_sgd_", "momentum_buffers", move("momentum_buffers", 0), RuntimeError,
         "momentum_buffers[0]"),
    Case("fused_sgd_", "model_params", move("model_params", 1), RuntimeError, "model_params[1]"),
    Case("fused_sgd_", "found_inf", move("found_inf"), RuntimeError, "found_inf"),
    Case("fused_sgd_", "inv_scale", move("inv_scale"), RuntimeError, "inv_scale"),
    Case("fused_adam_", "step", move("step"), RuntimeError, "step"),
    Case("fused_adam_", "found_inf", move("found_inf"), RuntimeError, "found_inf"),
    Case("fused_adam_", "inv_scale", move("inv_scale"), RuntimeError, "inv_scale"),
    Case("fused_adam_", "exp_avg_sqs", move("exp_avg_sqs", 1), RuntimeError, "exp_avg_sqs[1]"),
    Case("fused_adam_", "exp_avgs", move("exp_avgs", 2), RuntimeError, "exp_avgs[2]"),
    Case("fused_adam_", "model_params", move("model_params", 0), RuntimeError,
         "model_params[0]"),
    Case("update_loss_scale_", "scale", move("scale"), RuntimeError, "scale"),
    Case("update_loss_scale_", "found_inf", move("found_inf"), RuntimeError, "found_inf"),
    Case("update_loss_scale_", "hysteresis_tracker", move("hysteresis_tracker"), RuntimeError,
         "hysteresis_tracker"),
]


DEVICE_CASES += [
    Case("fused_sgd_-options", "lr_tensor", move("lr_tensor"), RuntimeError, "lr_tensor"),
    Case("fused_adam_-options", "max_exp_avg_sqs", move("max_exp_avg_sqs", 1), RuntimeError,
         "max_exp_avg_sqs[1]"),
    Case("fused_lamb_", "step", move("step"), RuntimeError, "step"),
    Case("fused_lamb_", "global_grad_norm", move("global_grad_norm"), RuntimeError,
         "global_grad_norm"),
    Case("fused_lamb_", "exp_avgs", move("exp_avgs", 2), RuntimeError, "exp_avgs[2]"),
    Case("fused_lamb_", "model_params", move("model_params", 0), RuntimeError,
         "model_params[0]"),
]


@pytest.mark.parametrize("case", [c.param() for c in DEVICE_CASES])
def test_tensor_on_another_device(device, other_device, case):
    args = OPS[case.op][1](device)
    case.mutate(args, other_device)
    check_rejected(case, args)


# --- arguments that share memory -------------------------------------------------------

def alias(name, index, source, source_index=None):
    """args[name][index] (or args[name], index None) becomes the tensor args[source]
    (or its element source_index) itself."""
    def mutate(args, d):
        t = args[source] if source_index is None else args[source][source_index]
        if index is None:
            args[name] = t
        else:
            args[name][index] = t
    return mutate


def first_element_of(source, source_index):
    """A one-element view of the start of args[source][source_index]."""
    return lambda args, d: args[source][source_index].view(-1)[:1]


def half_overlap(a_name, b_name, i):
    """a[i] and b[i] become float32 views of one buffer that overlap by half."""
    def mutate(args, d):
        n = args[a_name][i].numel()
        buf = randn(2 * n, F32, d, 42)
        args[a_name][i] = buf[:n].view(args[a_name][i].shape)
        args[b_name][i] = buf[n // 2:n // 2 + n].view(args[b_name][i].shape)
    return mutate


def overlap_case(op, id, mutate, first, second):
    return Case(op, f"overlap-{id}", mutate, ValueError, f"{first} overlaps {second}")


OVERLAP_CASES = [
    *[overlap_case(op, "compensation-is-param", alias("kahan_comps", 1, "params", 1),
                   "params[1]", "kahan_comps[1]")
      for op in ("fused_sgd_-kahan", "fused_adam_-kahan")],
    overlap_case("fused_adam_-kahan", "compensation-is-moment",
                 alias("exp_avgs", 2, "kahan_comps", 2), "kahan_comps[2]", "exp_avgs[2]"),
    overlap_case("fused_adam_-stochastic", "step-in-salt", lambda a, d: a.update(
        step=a["sr_salts"][0].view(torch.float32).view(-1)[:1]), "step", "sr_salts[0]"),
    overlap_case("fused_sgd_-stochastic", "salt-in-momentum-buffer", lambda a, d: (
        a["momentum_buffers"].__setitem__(1, torch.zeros(a["params"][1].shape, device=d)),
        a["sr_salts"].__setitem__(1, a["momentum_buffers"][1].view(-1)[:8].view(torch.int64))),
        "sr_salts[1]", "momentum_buffers[1]"),
    overlap_case("multi_tensor_unscale_", "same-tensor-twice", alias("tensors", 1, "tensors", 0),
                 "tensors[0]", "tensors[1]"),
    overlap_case("multi_tensor_unscale_", "found_inf-in-tensors",
                 alias("tensors", 2, "found_inf"), "found_inf", "tensors[2]"),
    overlap_case("multi_tensor_unscale_", "inv_scale-in-tensors",
                 alias("tensors", 0, "inv_scale"), "inv_scale", "tensors[0]"),
    overlap_case("multi_tensor_check_finite_", "found_inf-in-tensors",
                 alias("tensors", 1, "found_inf"), "found_inf", "tensors[1]"),
    overlap_case("multi_tensor_unscale_to_", "partly", half_overlap("src", "dst", 0),
                 "src[0]", "dst[0]"),
    overlap_case("multi_tensor_unscale_to_", "found_inf-in-dst",
                 set_arg("found_inf", first_element_of("dst", 1)), "found_inf", "dst[1]"),
    overlap_case("multi_tensor_unscale_to_", "inv_scale-in-dst",
                 set_arg("inv_scale", first_element_of("dst", 2)), "inv_scale", "dst[2]"),
    overlap_case("multi_tensor_copy_", "partly", half_overlap("src", "dst", 1),
                 "src[1]", "dst[1]"),
    overlap_case("multi_tensor_copy_", "dst-twice",
                 lambda a, d: a.update(src=[a["src"][0]] * 2, dst=[a["dst"][0]] * 2),
                 "dst[0]", "dst[1]"),
    overlap_case("multi_tensor_copy_", "src-is-another-dst",
                 lambda a, d: a.update(src=[a["dst"][1], a["src"][1]],
                                       dst=[torch.zeros_like(a["dst"][1]), a["dst"][1]]),
                 "src[0]", "dst[1]"),
    overlap_case("fused_sgd_", "grads-are-params", alias("grads", 2, "params", 2),
                 "params[2]", "grads[2]"),
    overlap_case("fused_sgd_", "momentum-is-params", alias("momentum_buffers", 0, "params", 0),
                 "params[0]", "momentum_buffers[0]"),
    overlap_case("fused_sgd_", "model-is-momentum", alias("model_params", 1, "momentum_buffers", 1),
                 "model_params[1]", "momentum_buffers[1]"),
    overlap_case("fused_sgd_", "model-is-another-param",
                 lambda a, d: a.update(model_params=[a["params"][1].view(-1)[:4]] +
                                       a["model_params"][1:]),
                 "params[1]", "model_params[0]"),
    overlap_case("fused_sgd_", "found_inf-in-params",
                 set_arg("found_inf", first_element_of("params", 1)), "found_inf", "params[1]"),
    overlap_case("fused_adam_", "exp_avg-is-exp_avg_sq", alias("exp_avg_sqs", 2, "exp_avgs", 2),
                 "exp_avgs[2]", "exp_avg_sqs[2]"),
    overlap_case("fused_adam_", "step-in-exp_avgs",
                 set_arg("step", first_element_of("exp_avgs", 0)), "step", "exp_avgs[0]"),
    overlap_case("fused_adam_", "model-is-grads", alias("model_params", 2, "grads", 2),
                 "grads[2]", "model_params[2]"),
    overlap_case("fused_adam_", "found_inf-in-exp_avg_sqs",
                 set_arg("found_inf", first_element_of("exp_avg_sqs", 1)), "found_inf",
                 "exp_avg_sqs[1]"),
    overlap_case("fused_adagrad_", "sums-are-params", alias("state_sums", 1, "params", 1),
                 "params[1]", "state_sums[1]"),
    overlap_case("fused_adagrad_", "found_inf-in-state_sums",
                 set_arg("found_inf", first_element_of("state_sums", 2)), "found_inf",
                 "state_sums[2]"),
    overlap_case("fused_novograd_", "step-in-exp_avg_sq",
                 set_arg("step", lambda a, d: a["exp_avg_sq"][:1]), "step", "exp_avg_sq"),
    overlap_case("fused_novograd_", "exp_avgs-are-params", alias("exp_avgs", 0, "params", 0),
                 "params[0]", "exp_avgs[0]"),
    overlap_case("update_loss_scale_", "trackers-are-one",
                 alias("hysteresis_tracker", None, "growth_tracker"), "growth_tracker",
                 "hysteresis_tracker"),
    overlap_case("update_loss_scale_", "found_inf-is-scale", alias("found_inf", None, "scale"),
                 "scale", "found_inf"),
]


OVERLAP_CASES += [
    # unscale_grads writes the grads: they may then share no memory (a read-only
    # argument may, without it: test_read_only_grads_may_share_memory).
    *[overlap_case(op, "grads-share-memory",
                   lambda a, d: a["grads"].__setitem__(0, a["grads"][2][:4]),
                   "grads[0]", "grads[2]")
      for op in ("fused_sgd_-options", "fused_adam_-options")],
    overlap_case("fused_sgd_-options", "lr_tensor-in-grads",
                 set_arg("lr_tensor", first_element_of("grads", 2)), "lr_tensor", "grads[2]"),
    overlap_case("fused_adam_-options", "max-is-exp_avg_sq",
                 alias("max_exp_avg_sqs", 1, "exp_avg_sqs", 1), "exp_avg_sqs[1]",
                 "max_exp_avg_sqs[1]"),
    overlap_case("fused_adam_-kahan-amsgrad", "max-is-compensation",
                 alias("max_exp_avg_sqs", 0, "kahan_comps", 0), "kahan_comps[0]",
                 "max_exp_avg_sqs[0]"),
    overlap_case("fused_lamb_", "exp_avg-is-exp_avg_sq", alias("exp_avg_sqs", 2, "exp_avgs", 2),
                 "exp_avgs[2]", "exp_avg_sqs[2]"),
    overlap_case("fused_lamb_", "global_grad_norm-in-exp_avgs",
                 set_arg("global_grad_norm", first_element_of("exp_avgs", 0)),
                 "global_grad_norm", "exp_avgs[0]"),
    overlap_case("fused_lamb_", "model-is-grads", alias("model_params", 2, "grads", 2),
                 "grads[2]", "model_params[2]"),
]


@pytest.mark.parametrize("case", [c.param() for c in OVERLAP_CASES])
def test_overlapping_arguments(device, case):
    """A written tensor that shares memory with another argument gives wrong values:
    rejected, naming both, before anything is written."""
    args = OPS[case.op][1](device)
    case.mutate(args, device)
    check_rejected(case, args)


def test_overlap_cases_cover_every_op_that_writes():
    writers = set(OPS) - {"multi_tensor_l2norm", "sum_fp32"}
    assert {c.op for c in OVERLAP_CASES} == writers


@pytest.mark.parametrize("op_name", ["multi_tensor_unscale_to_", "multi_tensor_copy_"])
def test_in_place_pairs_are_allowed(device, op_name):
    """src[i] the very view of dst[i]: each element is read before it is written."""
    op, build = OPS[op_name]
    args = build(device)
    args["dst"] = [t.clone() for t in args["src"]]
    expected = {k: v for k, v in args.items()}
    op(**expected)  # out of place, into copies
    in_place = build(device)
    in_place["dst"] = in_place["src"]
    op(**in_place)
    for got, want in zip(in_place["dst"], expected["dst"]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("op_name", ["fused_sgd_", "fused_adam_", "fused_lamb_"])
def test_fp32_param_as_its_own_master(device, op_name):
    """model_params[i] the very view of params[i]: written with its own values (what
    the fused optimizers pass for an fp32 param among masters)."""
    op, build = OPS[op_name]
    args, expected = build(device), build(device)
    args["model_params"][2] = args["params"][2]
    op(**args)
    op(**expected)
    for got, want in zip(args["params"], expected["params"]):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("op_name", ["fused_sgd_", "fused_adam_"])
def test_read_only_grads_may_share_memory(device, op_name):
    """Without unscale_grads the grads are only read: two params may share one."""
    grad = randn(6, F16, device, 3)

    def run(grads):
        params = [randn(6, F32, device, 0), randn(6, F32, device, 1)]
        if op_name == "fused_sgd_":
            ops.fused_sgd_(params, grads, [], [], lr=0.1, inv_scale=scalar(0.5, device))
        else:
            state = [torch.zeros_like(p) for p in params + params]
            ops.fused_adam_(params, grads, state[:2], state[2:], [], step=scalar(0.0, device),
                            lr=1e-3, inv_scale=scalar(0.5, device))
        return params

    for got, want in zip(run([grad, grad]), run([grad.clone(), grad.clone()])):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_read_only_arguments_may_share_memory(device):
    """check_finite_ only reads its tensors; l2norm reads everything."""
    x = randn(6, F32, device, 7)
    found_inf = scalar(0.0, device)
    ops.multi_tensor_check_finite_([x, x, x[2:]], found_inf)
    assert found_inf.item() == 0.0
    norm, _ = ops.multi_tensor_l2norm([x, x], x[:1].abs() + 1, per_tensor=False)
    assert norm.isfinite().all()


@pytest.mark.parametrize("op, make_args, old", [
    (ops.fused_adam_, adam_args, "adamw"),
    (ops.fused_lamb_, lamb_args, "adamw"),
    (ops.fused_adagrad_, adagrad_args, "adagrad_w_mode"),
])
def test_a_renamed_keyword_names_its_new_name(op, make_args, old):
    """A call written before the rename (decoupled_weight_decay, 2026-11-28) gets an error
    that says what to pass instead, and nothing is written; the signature shows only the
    new name, and the new name works."""
    args = make_args("cpu")
    value = args.pop("decoupled_weight_decay")
    before = snapshot(args)
    with pytest.raises(TypeError, match=f"{op.__name__}: the keyword argument '{old}' was "
                                        f"renamed 'decoupled_weight_decay': pass "
                                        f"decoupled_weight_decay={value!r}"):
        op(**args, **{old: value})
    assert_unchanged(args, before)
    parameters = inspect.signature(op).parameters
    assert old not in parameters and "decoupled_weight_decay" in parameters
    op(**args, decoupled_weight_decay=value)
