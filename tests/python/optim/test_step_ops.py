"""The device ops a planned optimizer step dispatches, pinned on fake CUDA tensors
(:func:`helpers.fake_cuda`), so that a change that adds one to the step fails here (issue
30, part 5: on ResNet-50's 161 tensors a step's device work is ~0.1-0.2 ms on an H200,
and each op is a kernel launch, 3-5 us of the host's time).

A planned step of FusedSGD, FusedAdam, optim.SGD or optim.AdamW dispatches its fused op
(``fused_sgd_``, ``fused_adam_``: one call per param group and device; the op launches
once per 213-256 tensors, csrc/multi_tensor_plan.h, and FusedAdam/AdamW once more for
the step count) and ``applied_steps += 1`` (``add_``); with a scaler's ``grad_scale``
and ``found_inf`` (as torch.amp.GradScaler and mixedprec.GradScaler drive it), ``1 /
grad_scale`` once per device (one ``reciprocal``: loss_scale.inverse) and the count's ``eq``
and ``add_`` instead: 2 ops, or 4 with a scaler, for one group. torch's
``SGD(fused=True)`` dispatches 1 (``_fused_sgd_``), its ``AdamW(fused=True)`` 2, or 3 with
a scaler (``_foreach_add_`` of the step counts, ``_fused_adamw_``, ``_foreach_sub_``
undoing the counts where ``found_inf``), each of their ops launching once per 36-110
tensors (ATen's MultiTensorApply limits by list depth). bench/host_step.py counts both
on ResNet-50's list and times the steps."""

import warnings

import pytest
import torch
from helpers import fake_cuda, load_script

import mixedprec
from mixedprec import optim

F16, F32 = torch.float16, torch.float32

# The dispatch counter bench/host_step.py counts with too.
DeviceOps = load_script("bench/common.py").DeviceOps


# name -> builder(params or groups)
OPTIMIZERS = {
    "FusedSGD": lambda ps, masters: mixedprec.FusedSGD(ps, lr=0.01, momentum=0.9,
                                                       master_weights=masters),
    "FusedAdam": lambda ps, masters: mixedprec.FusedAdam(ps, lr=1e-3, weight_decay=0.01,
                                                         master_weights=masters),
    "optim.SGD": lambda ps, masters: optim.SGD(ps, lr=0.01, momentum=0.9,
                                               master="fp32" if masters else "none"),
    "optim.AdamW": lambda ps, masters: optim.AdamW(ps, lr=1e-3,
                                                   master="fp32" if masters else "none"),
    "torch SGD": lambda ps, _: torch.optim.SGD(ps, lr=0.01, momentum=0.9, fused=True),
    "torch AdamW": lambda ps, _: torch.optim.AdamW(ps, lr=1e-3, fused=True),
}
FUSED_OP = {"FusedSGD": "fused_sgd_", "FusedAdam": "fused_adam_", "optim.SGD": "fused_sgd_",
            "optim.AdamW": "fused_adam_"}

# A small convolutional model's parameters: conv weights and biases, batchnorm, linear.
SHAPES = [(16, 3, 3, 3), (16,), (16,), (16,), (32, 16, 3, 3), (32,), (32,), (32,),
          (64, 32, 1, 1), (64,), (10, 64), (10,)]


def new_params(dtype):
    return [torch.randn(shape, device="cuda").to(dtype).requires_grad_() for shape in SHAPES]


def feed(params):
    for p in params:
        p.grad = torch.randn_like(p)


def planned_step_ops(name, dtype, masters, scaled, groups=1):
    """The device ops of the 4th step (the first three make state and plans) of
    optimizer ``name`` (of OPTIMIZERS, or a builder) over SHAPES' params in ``groups``
    param groups."""
    with warnings.catch_warnings(), fake_cuda():
        warnings.filterwarnings("ignore", message=".*fused.*")
        params = new_params(dtype)
        split = [params[i::groups] for i in range(groups)]
        counter = DeviceOps()
        with counter:
            make = OPTIMIZERS[name] if isinstance(name, str) else name
            opt = make([{"params": ps} for ps in split], masters)
            scale = torch.full((), 1024.0, device="cuda")
            found_inf = torch.zeros((), device="cuda")
            for _ in range(4):
                feed(params)
                if scaled:
                    opt.grad_scale, opt.found_inf = scale, found_inf
                counter.ops.clear()
                opt.step()
    return counter.ops


CASES = [pytest.param(name, dtype, dtype == F16, id=f"{name}-{str(dtype)[6:]}")
         for name in ("FusedSGD", "FusedAdam", "optim.SGD", "optim.AdamW")
         for dtype in (F32, F16)]


@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "scaled"])
@pytest.mark.parametrize("name,dtype,masters", CASES)
def test_a_planned_step_dispatches_its_fused_op_and_at_most_three_more(name, dtype, masters,
                                                                       scaled):
    ops = planned_step_ops(name, dtype, masters, scaled)
    # (fp16 params keep fp32 masters: the same one call, with the model copy)
    expected = ["reciprocal", FUSED_OP[name], "eq", "add_"] if scaled else [FUSED_OP[name], "add_"]
    assert ops == expected


@pytest.mark.parametrize("name", ["FusedSGD", "optim.AdamW"])
def test_each_group_adds_its_fused_op_and_the_scale_is_inverted_once(name):
    ops = planned_step_ops(name, F16, True, True, groups=2)
    assert ops == ["reciprocal", FUSED_OP[name], FUSED_OP[name], "eq", "add_"]


@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "scaled"])
@pytest.mark.parametrize("name,expected", [
    ("torch SGD", {False: ["_fused_sgd_"], True: ["_fused_sgd_"]}),
    ("torch AdamW", {False: ["_foreach_add_", "_fused_adamw_"],
                     True: ["_foreach_add_", "_fused_adamw_", "_foreach_sub_"]})])
def test_torchs_fused_steps_for_comparison(name, expected, scaled):
    """The counts of torch's fused optimizers that the module docstring compares with
    (torch 2.11's SGD(fused=True) and AdamW(fused=True)); a torch that changes them
    changes the comparison, not mixedprec."""
    assert planned_step_ops(name, F32, False, scaled) == expected[scaled]


@pytest.mark.parametrize("name", ["fused_sgd_", "fused_adam_"])
def test_the_positional_calls_follow_the_schemas(name):
    """mixedprec.ops' fused_sgd_ and fused_adam_ pass their arguments to the op by
    position (a step's keyword matching cost ~6 us): the wrapper's parameters must be
    the schema's arguments, in its order."""
    import inspect

    from mixedprec import ops
    schema = [a.name for a in getattr(torch.ops.mixedprec, name).default._schema.arguments]
    assert list(inspect.signature(getattr(ops, name)).parameters) == schema


@pytest.mark.parametrize("scaled", [False, True], ids=["unscaled", "scaled"])
def test_a_stochastic_sgd_step_adds_its_rounding_step_count(scaled):
    """master='stochastic' (and 8-bit buffers): SGD advances the group's step count that
    keys the rounding bits, one ``add_`` (with a scaler, after its ``eq``)."""
    def make(ps, _):
        return optim.SGD(ps, lr=0.01, momentum=0.9, master="stochastic", seed=1)
    ops = planned_step_ops(make, torch.bfloat16, False, scaled)
    assert ops == (["reciprocal", "eq", "add_", "fused_sgd_", "eq", "add_"] if scaled
                   else ["add_", "fused_sgd_", "add_"])
