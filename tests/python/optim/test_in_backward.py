"""The step inside backward (mixedprec.optim.in_backward, issue #32 part 1): bit for bit
the ordinary step() in every master mode and state dtype, with buckets of one parameter
or of all, across param groups, on a compiled model; gradient accumulation, unused
parameters, tied weights, state_dict and resume, schedulers, zero_grad; gradients freed
as backward goes; no host synchronisation; and what it refuses (with nothing changed),
fp16 among them, with the reason for that choice checked: a step cannot be undone
exactly."""

import copy
import gc
import weakref

import pytest
import torch
from helpers import (
    assert_same_snapshot,
    assert_unchanged,
    forbid_host_sync,
    full_snapshot,
    make_model,
    randn,
    snapshot,
)
from torch import nn

from mixedprec import optim
from mixedprec.optim import lr_scheduler

BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn
SIZES = (8, 64, 64, 4)  # (the 64x64 weight takes 8-bit moments)
ONE_EACH = 1e-9  # bucket_cap_mb: a bucket per parameter
MODES = [(master, state) for master in optim.MASTER_MODES for state in optim.STATE_DTYPES]


def make_optimizer(cls, params, master="fp32", state_dtype=torch.float32, **kwargs):
    extra = {}
    if cls is optim.SGD:
        extra["momentum"] = 0.9
    if master == "stochastic" or state_dtype == E4M3:
        extra["seed"] = 7
    lean = dict(master=master, state_dtype=state_dtype) if cls is not optim.Adagrad else \
        dict(master=master)
    return cls(params, lr=1e-2, **extra, **lean, **kwargs)


def batch(step, device, dtype=BF16):
    x = randn((5, SIZES[0]), torch.float32, device, seed=100 + step).to(dtype)
    y = randn((5, SIZES[-1]), torch.float32, device, seed=200 + step)
    return x, y


def forward(model, x):
    """The Sequential's forward, each Linear's input cast to its dtype (the last layer may
    be fp32 in a bf16 model, as norms are under amp O2)."""
    for layer in model:
        x = layer(x.to(layer.weight.dtype) if isinstance(layer, nn.Linear) else x)
    return x


def loss_of(model, step, device):
    x, y = batch(step, device, next(model.parameters()).dtype)
    out = forward(model, x) if isinstance(model, nn.Sequential) else model(x)
    return (out.float() - y).pow(2).mean()


def pair(device, cls=optim.AdamW, master="fp32", state_dtype=torch.float32, groups=False,
         dtype=BF16, fc2_dtype=None, **kwargs):
    """Two equal models and optimizers: one to step(), one to step inside backward."""
    out = []
    for _ in range(2):
        model = make_model(device, dtype, fc2_dtype, sizes=SIZES, activation=nn.GELU)
        params = model.parameters()
        if groups:  # (two groups, interleaved with the buckets)
            params = [{"params": [model[0].weight, model[4].bias]},
                      {"params": [model[0].bias, model[2].weight, model[2].bias,
                                  model[4].weight], "lr": 3e-3}]
        out.append((model, make_optimizer(cls, params, master, state_dtype, **kwargs)))
    return out


def train_pair(device, ref, inb, steps=3, start=0):
    """`steps` steps of each: step() on `ref`, backward alone on `inb` (attached)."""
    (model_a, opt_a), (model_b, _) = ref, inb
    for step in range(start, start + steps):
        loss_of(model_a, step, device).backward()
        opt_a.step()
        opt_a.zero_grad()
        loss_of(model_b, step, device).backward()
        assert all(p.grad is None for p in model_b.parameters())


def assert_same(ref, inb, msg=""):
    (model_a, opt_a), (model_b, opt_b) = ref, inb
    assert_same_snapshot(full_snapshot(model_a, opt_a), full_snapshot(model_b, opt_b), msg)
    assert torch.equal(opt_a.applied_steps, opt_b.applied_steps), msg
    sd_a, sd_b = opt_a.state_dict(), opt_b.state_dict()
    assert sd_a["param_groups"] == sd_b["param_groups"] or all(
        {k: v for k, v in a.items() if k != "step"} == {k: v for k, v in b.items()
                                                        if k != "step"}
        and torch.equal(torch.as_tensor(a.get("step", 0)), torch.as_tensor(b.get("step", 0)))
        for a, b in zip(sd_a["param_groups"], sd_b["param_groups"])), msg


# --- bit for bit the ordinary step --------------------------------------------------------

@pytest.mark.parametrize("cls", [optim.Adam, optim.AdamW, optim.SGD], ids=lambda c: c.__name__)
@pytest.mark.parametrize("master,state_dtype", MODES, ids=lambda v: str(v).split(".")[-1])
def test_every_mode_equals_step(device, cls, master, state_dtype):
    ref, inb = pair(device, cls, master, state_dtype, fc2_dtype=torch.float32)
    optim.in_backward(inb[1], bucket_cap_mb=ONE_EACH)
    train_pair(device, ref, inb)
    assert_same(ref, inb, f"{cls.__name__} {master} {state_dtype}")


@pytest.mark.parametrize("cap", [ONE_EACH, 0.01, 25.0])
@pytest.mark.parametrize("cls", [optim.AdamW, optim.SGD, optim.Adagrad],
                         ids=lambda c: c.__name__)
def test_buckets_across_groups_equal_step(device, cls, cap):
    master, state = ("stochastic", E4M3) if cls is not optim.Adagrad else ("fp32", None)
    kwargs = dict(master=master) if state is None else dict(master=master, state_dtype=state)
    ref, inb = pair(device, cls, groups=True, **kwargs)
    handle = optim.in_backward(inb[1], bucket_cap_mb=cap)
    if cap == ONE_EACH:
        assert len(handle.buckets) == 6
    elif cap == 25.0:
        assert len(handle.buckets) == 1
    train_pair(device, ref, inb, steps=4)
    assert_same(ref, inb, f"cap {cap}")


def test_fp32_model_equals_step(device):
    ref, inb = pair(device, optim.Adam, dtype=torch.float32, amsgrad=True)
    optim.in_backward(inb[1], bucket_cap_mb=ONE_EACH)
    train_pair(device, ref, inb)
    assert_same(ref, inb)


class Tied(nn.Module):
    """One weight used twice (an embedding tied to the output layer, in miniature): its
    gradient is complete only when backward has passed both uses."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.w = nn.Parameter(torch.randn(SIZES[0], SIZES[0]) * 0.3)
        self.mid = nn.Linear(SIZES[0], SIZES[0])
        self.out = nn.Linear(SIZES[0], SIZES[-1])

    def forward(self, x):
        return self.out(torch.tanh(self.mid(x @ self.w)) @ self.w.t())


def test_tied_weight_steps_after_its_last_use(device):
    ref, inb = [(m, optim.AdamW(m.parameters(), lr=1e-2, master="remainder"))
                for m in (Tied().to(device, BF16), Tied().to(device, BF16))]
    optim.in_backward(inb[1], bucket_cap_mb=ONE_EACH)
    train_pair(device, ref, inb)
    assert_same(ref, inb)


def test_compiled_model_equals_step():
    """torch.compile compiles the model's forward and backward; the gradients still reach
    the parameters through autograd's accumulation, whose hooks step the buckets."""
    ref, inb = pair("cpu", optim.AdamW, "remainder", E4M3)
    optim.in_backward(inb[1], bucket_cap_mb=ONE_EACH)
    ref, inb = [(torch.compile(model), model, opt) for model, opt in (ref, inb)]
    for step in range(3):
        for compiled, _, opt in (ref, inb):
            x, y = batch(step, "cpu")
            (compiled(x).float() - y).pow(2).mean().backward()
            if opt.in_backward is None:
                opt.step()
                opt.zero_grad()
    assert_same(ref[1:], inb[1:])


# --- accumulation, unused parameters, freed gradients -------------------------------------

def test_accumulation_steps_on_the_sum(device):
    ref, inb = pair(device, optim.AdamW, "remainder", E4M3)
    handle = optim.in_backward(inb[1], bucket_cap_mb=ONE_EACH)
    for step in range(2):
        for micro in range(3):
            loss_of(ref[0], 10 * step + micro, device).backward()
        ref[1].step()
        ref[1].zero_grad()
        with handle.no_step():
            for micro in range(2):
                loss_of(inb[0], 10 * step + micro, device).backward()
        assert all(p.grad is not None for p in inb[0].parameters())
        loss_of(inb[0], 10 * step + 2, device).backward()
        assert all(p.grad is None for p in inb[0].parameters())
    assert_same(ref, inb)


def test_parameters_without_gradient_in_a_backward(device):
    """A layer unused in the stepping backward steps at its end on the gradient it
    accumulated before (as step() would), and a layer with no gradient at all does not
    step (as step() would not)."""
    ref, inb = pair(device, optim.SGD, "stochastic", BF16)
    handle = optim.in_backward(inb[1], bucket_cap_mb=ONE_EACH)
    for (model, opt), attached in ((ref, False), (inb, True)):
        with handle.no_step() if attached else torch.enable_grad():
            loss_of(model, 0, device).backward()
        x, _ = batch(1, device)
        head = forward(model[0:4], x).float().sum()  # (model[4] unused)
        head.backward()
        if not attached:
            opt.step()
            opt.zero_grad()
        model[4].weight.requires_grad_(False)  # no gradient at all from here on
        model[4].bias.requires_grad_(False)
        loss_of(model, 2, device).backward()
        if not attached:
            opt.step()
            opt.zero_grad()
    assert_same(ref, inb)


def test_gradients_are_freed_as_backward_goes(device):
    model, opt = pair(device)[1]
    live = []

    def count(_):
        live.append(sum(p.grad is not None for p in model.parameters()))

    for p in model.parameters():  # (registered first: runs before the step's hook)
        p.register_post_accumulate_grad_hook(count)
    optim.in_backward(opt, bucket_cap_mb=ONE_EACH)
    loss_of(model, 0, device).backward()
    assert len(live) == 6 and max(live) == 1  # only the one just accumulated


def test_zero_grad_to_zeros_before_backward(device):
    ref, inb = pair(device, optim.AdamW, "kahan")
    optim.in_backward(inb[1])
    train_pair(device, ref, inb, steps=1)
    ref[1].zero_grad(set_to_none=False)
    inb[1].zero_grad(set_to_none=False)
    train_pair(device, ref, inb, steps=2, start=1)
    assert_same(ref, inb)


# --- state_dict, resume, schedulers -------------------------------------------------------

def test_resume_from_a_state_dict(device, tmp_path):
    ref, inb = pair(device, optim.AdamW, "remainder", E4M3)
    optim.in_backward(inb[1], bucket_cap_mb=ONE_EACH)
    train_pair(device, ref, inb, steps=2)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": inb[0].state_dict(), "opt": inb[1].state_dict()}, path)
    saved = torch.load(path, weights_only=True)
    model, opt = pair(device, optim.AdamW, "remainder", E4M3)[1]
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["opt"])
    optim.in_backward(opt, bucket_cap_mb=ONE_EACH)
    train_pair(device, ref, (model, opt), steps=2, start=2)
    assert_same(ref, (model, opt))


@pytest.mark.filterwarnings("error")  # (torch's: no "lr_scheduler.step() before step()")
@pytest.mark.parametrize("schedule", ["mixedprec", "torch"])
def test_schedulers_step_after_backward(device, schedule):
    ref, inb = pair(device, optim.AdamW, "remainder")
    optim.in_backward(inb[1])
    module = lr_scheduler if schedule == "mixedprec" else torch.optim.lr_scheduler
    scheds = [module.StepLR(opt, step_size=2, gamma=0.5) for _, opt in (ref, inb)]
    for step in range(5):
        train_pair(device, ref, inb, steps=1, start=step)
        for sched in scheds:
            sched.step()
    assert_same(ref, inb)
    assert [g["lr"] for g in ref[1].param_groups] == [g["lr"] for g in inb[1].param_groups]


def test_remove_goes_back_to_step(device):
    ref, inb = pair(device, optim.AdamW, "stochastic", BF16)
    handle = optim.in_backward(inb[1], bucket_cap_mb=ONE_EACH)
    train_pair(device, ref, inb, steps=1)
    loss_of(inb[0], 1, device)  # (a forward only)
    with pytest.raises(RuntimeError, match="steps inside backward"):
        inb[1].step()
    handle.remove()
    assert inb[1].in_backward is None and inb[1].plans.parts == []
    for (model, opt) in (ref, inb):
        loss_of(model, 1, device).backward()
        opt.step()
    assert_same(ref, inb)
    optim.in_backward(inb[1])  # (and back again)


def test_the_handle_lives_with_its_optimizer_and_lets_both_go(device):
    # The hooks hold the handle weakly (a tensor's hooks live in its C++ autograd data,
    # out of the garbage collector's sight): the optimizer keeps the handle, and once
    # model, optimizer and handle are dropped, without remove(), all are collected.
    ref, inb = pair(device, optim.AdamW, "remainder", E4M3)
    handle = optim.in_backward(inb[1], bucket_cap_mb=ONE_EACH)
    alive = weakref.ref(handle)
    del handle
    gc.collect()
    assert alive() is inb[1].in_backward is not None
    train_pair(device, ref, inb, steps=2)
    assert_same(ref, inb)
    refs = [weakref.ref(x) for x in (inb[0], inb[1], inb[1].in_backward,
                                     next(inb[0].parameters()))]
    del inb
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)


def test_a_dropped_optimizer_leaves_no_hook_on_the_model(device):
    # Optimizer and handle collected, the model kept (a new optimizer for the same model,
    # as a sweep builds): its parameters hold no hook of theirs, and the model trains on
    # with step(); remove() takes the hooks off too.
    model, opt = pair(device)[0]
    params = list(model.parameters())

    def hooks():
        return [len(p._post_accumulate_grad_hooks or {}) for p in params]
    optim.in_backward(opt, bucket_cap_mb=ONE_EACH)
    assert hooks() == [1] * len(params)
    del opt
    gc.collect()
    assert hooks() == [0] * len(params)
    opt = make_optimizer(optim.AdamW, model.parameters())
    loss_of(model, 0, device).backward()
    opt.step()
    optim.in_backward(opt).remove()
    assert hooks() == [0] * len(params)


def test_no_host_sync_in_backward(device, monkeypatch):
    model, opt = pair(device, optim.AdamW, "remainder", E4M3)[1]
    optim.in_backward(opt, bucket_cap_mb=ONE_EACH)
    loss_of(model, 0, device).backward()  # (state created: a loading-time host read)
    for step in (1, 2):  # (the first step makes the buckets' plans, the second uses them)
        loss = loss_of(model, step, device)
        with forbid_host_sync(monkeypatch):
            loss.backward()


# --- refusals: a clear error, and nothing changed ------------------------------------------

def no_hooks(model):
    return all(not getattr(p, "_post_accumulate_grad_hooks", None) for p in model.parameters())


@pytest.mark.parametrize("cls", [optim.LAMB, optim.NovoGrad], ids=lambda c: c.__name__)
def test_refuses_optimizers_that_need_every_gradient(cls):
    model = make_model(sizes=SIZES)
    opt = cls(model.parameters())
    with pytest.raises(TypeError, match=f"in_backward: {cls.__name__} cannot step inside "
                                        "backward: its"):
        optim.in_backward(opt)
    assert opt.in_backward is None and no_hooks(model)


def test_refuses_fp16_parameters():
    model = make_model(sizes=SIZES, dtype=torch.float16)
    opt = optim.AdamW(model.parameters())
    before = snapshot(model)
    with pytest.raises(TypeError, match="float16 parameters, which need a loss scaler"):
        optim.in_backward(opt)
    assert opt.in_backward is None and no_hooks(model)
    assert_unchanged(model, before)


def test_a_step_cannot_be_undone_exactly():
    """Why fp16 (a loss scaler) is refused rather than undone after a late overflow: the
    moments a step wrote do not give back, bit for bit, the moments before it, in fp32
    (b1 * m + (1 - b1) * g rounds) and less so in 8 bits."""
    p = nn.Parameter(torch.zeros(4096))
    opt = optim.AdamW([p], lr=0.0, weight_decay=0.0)
    p.grad = randn((4096,), torch.float32, "cpu", seed=1)
    opt.step()
    before = opt.state[p]["exp_avg"].clone()
    g = randn((4096,), torch.float32, "cpu", seed=2)
    p.grad = g.clone()
    opt.step()
    beta1 = opt.param_groups[0]["betas"][0]
    undone = (opt.state[p]["exp_avg"] - (1 - beta1) * g) / beta1
    assert (undone != before).sum() > 100
    q = nn.Parameter(torch.zeros(4096, dtype=BF16))
    opt8 = optim.AdamW([q], lr=0.0, weight_decay=0.0, state_dtype=E4M3, seed=0)
    q.grad = randn((4096,), torch.float32, "cpu", seed=1).to(BF16)
    opt8.step()
    codes = opt8.state[q]["exp_avg"].view(torch.uint8)
    assert codes.unique().numel() <= 256 < q.grad.unique().numel()  # many moments per code


def test_refuses_a_process_group_of_many(monkeypatch):
    model = make_model(sizes=SIZES)
    opt = optim.AdamW(model.parameters())
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a: 2)
    with pytest.raises(RuntimeError, match="pass the DistributedDataParallel model as model="):
        optim.in_backward(opt)
    assert opt.in_backward is None and no_hooks(model)


@pytest.mark.parametrize("cap", [0, -1.0, float("inf"), float("nan"), True, "25"])
def test_refuses_a_bad_bucket_cap(cap):
    model = make_model(sizes=SIZES)
    opt = optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="expected bucket_cap_mb to be a number > 0"):
        optim.in_backward(opt, bucket_cap_mb=cap)
    assert opt.in_backward is None and no_hooks(model)


def test_refuses_a_model_that_is_not_ddp():
    model = make_model(sizes=SIZES)
    opt = optim.AdamW(model.parameters())
    with pytest.raises(TypeError, match="expected model to be a DistributedDataParallel "
                                        "model .or None., got Sequential"):
        optim.in_backward(opt, model=model)
    assert opt.in_backward is None and no_hooks(model)


def test_refuses_twice_and_other_optimizers():
    model = make_model(sizes=SIZES)
    with pytest.raises(TypeError, match="expected a mixedprec.optim optimizer, got AdamW"):
        optim.in_backward(torch.optim.AdamW(model.parameters()))
    opt = optim.AdamW(model.parameters())
    optim.in_backward(opt)
    with pytest.raises(ValueError, match="already steps inside backward"):
        optim.in_backward(opt)


def test_a_group_added_after_attaching_is_refused_before_any_update(device):
    model, opt = pair(device)[1]
    optim.in_backward(opt)
    extra = nn.Parameter(torch.zeros(3, device=device, dtype=BF16))
    opt.add_param_group({"params": [extra]})
    before = copy.deepcopy(full_snapshot(model, opt))
    with pytest.raises(RuntimeError, match="param groups were added or changed"):
        loss_of(model, 0, device).backward()
    assert_same_snapshot(full_snapshot(model, opt), before)


def test_a_bad_lr_is_refused_before_any_update(device):
    model, opt = pair(device)[1]
    optim.in_backward(opt, bucket_cap_mb=ONE_EACH)
    loss_of(model, 0, device).backward()
    opt.param_groups[0]["lr"] = -1.0
    before = full_snapshot(model, opt)
    with pytest.raises(ValueError, match="lr"):
        loss_of(model, 1, device).backward()
    assert_same_snapshot(full_snapshot(model, opt), before)
    opt.param_groups[0]["lr"] = 1e-2  # (and the next backward steps again)
    loss_of(model, 2, device).backward()
    assert int(opt.applied_steps) == 2


# --- what an outside audit found (2026-12-02) ---------------------------------------------

def checkpointed_loss(model, step, device, last):
    """loss_of with torch.utils.checkpoint(use_reentrant=True) around the middle layers,
    or (``last``) around the last ones: each runs a nested backward of its own."""
    from torch.utils.checkpoint import checkpoint
    x, y = batch(step, device, next(model.parameters()).dtype)
    head, tail = (model[:2], model[2:]) if last else (model[:2], None)
    h = model[0](x)
    if last:
        out = checkpoint(tail, checkpoint(head[1], h, use_reentrant=True), use_reentrant=True)
    else:
        out = model[4](model[3](checkpoint(model[2], model[1](h), use_reentrant=True)))
    return (out.float() - y).pow(2).mean()


@pytest.mark.parametrize("cls, master", [(optim.SGD, "stochastic"), (optim.AdamW, "fp32")])
def test_a_reentrant_checkpoint_inside_is_one_step(device, cls, master):
    """Before: the checkpoint's nested backward (a graph task of its own) was taken for a
    new backward: applied_steps and SGD's group step count advanced two or three times
    per backward, and master='stochastic' drew other rounding bits than step()."""
    ref, inb = pair(device, cls, master)
    optim.in_backward(inb[1], bucket_cap_mb=ONE_EACH)
    for step in range(3):
        checkpointed_loss(ref[0], step, device, last=False).backward()
        ref[1].step()
        ref[1].zero_grad()
        checkpointed_loss(inb[0], step, device, last=False).backward()
    assert int(inb[1].applied_steps) == 3
    assert_same(ref, inb)


def test_a_reentrant_checkpoint_of_the_last_layers_is_refused(device):
    """A nested backward that runs before its outer one's first gradient cannot be told
    from a whole backward until the outer one goes on: refused then, naming the fix."""
    model, opt = pair(device)[1]
    optim.in_backward(opt, bucket_cap_mb=ONE_EACH)
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        checkpointed_loss(model, 0, device, last=True).backward()


def test_a_parameter_unfrozen_after_attaching_is_refused_before_any_update(device):
    """Before: it never stepped (no hook), its gradient kept accumulating, and
    applied_steps counted on."""
    model, opt = pair(device)[1]
    model[0].weight.requires_grad_(False)
    handle = optim.in_backward(opt, bucket_cap_mb=ONE_EACH)
    loss_of(model, 0, device).backward()
    model[0].weight.requires_grad_(True)
    before = copy.deepcopy(full_snapshot(model, opt))
    with pytest.raises(RuntimeError, match="requires grad but did not when in_backward"):
        loss_of(model, 1, device).backward()
    assert_same_snapshot(full_snapshot(model, opt), before)
    handle.remove()
    optim.in_backward(opt, bucket_cap_mb=ONE_EACH)  # (attached again, it steps it)
    weight = model[0].weight.detach().clone()
    model.zero_grad(set_to_none=True)
    loss_of(model, 1, device).backward()
    assert not torch.equal(weight, model[0].weight)


def test_a_parameter_steps_inside_backward_for_one_optimizer():
    """Before: a second optimizer over the same parameters was attached, found their
    gradients freed by the first, stepped nothing and counted a step."""
    model = make_model(sizes=SIZES)
    first = optim.AdamW(model.parameters())
    handle = optim.in_backward(first)
    second = optim.SGD(model[0].parameters(), lr=0.1)
    with pytest.raises(ValueError, match="already steps inside backward with another "
                                         r"optimizer \(AdamW\)"):
        optim.in_backward(second)
    assert second.in_backward is None
    handle.remove()
    optim.in_backward(second)  # (once the first lets go)
    del handle, first
    gc.collect()
