"""No step reads the device on the host or copies host data to it, in every optimizer and
master/state mode: the first step (state and plans made), a planned step, a step skipped
on the device, a plan rebuilt after a new param group and after a parameter lost its
gradient. Each runs twice on the CPU machines: on CPU tensors, and on fake CUDA tensors
(:func:`helpers.fake_cuda`), where the Python code takes its CUDA path and a copy from
the host to the device shows as one. The guard is :func:`helpers.forbid_host_sync`; the
planted tests show that it fires for each kind of fault, so that a pass is not vacuous.
(The H200 run of 2026-11-27 found the stochastic and 8-bit modes building their rounding
words from host data in their first step: these tests fail on that code.)"""

import contextlib

import pytest
import torch
from helpers import HostSyncError, fake_cuda, forbid_host_sync

import mixedprec
from mixedprec import optim
from mixedprec.optim import lr_scheduler

BF16, F32, E4M3 = torch.bfloat16, torch.float32, torch.float8_e4m3fn
MASTERS = ("fp32", "none", "kahan", "stochastic", "remainder")
STATE_DTYPES = (F32, BF16, E4M3)


def _lean(cls, **kwargs):
    def make(params, master, state_dtype):
        seed = 7 if master == "stochastic" or state_dtype == E4M3 else None
        return cls(params, master=master, state_dtype=state_dtype, seed=seed, **kwargs)
    return make


# name -> (builder(params, master, state_dtype), whether it takes the lean modes)
OPTIMIZERS = {
    "Adam": (_lean(optim.Adam, lr=1e-3, weight_decay=0.01), True),
    "AdamW": (_lean(optim.AdamW, lr=1e-3), True),
    "SGD": (_lean(optim.SGD, lr=0.01, momentum=0.9), True),
    "SGD-no-momentum": (_lean(optim.SGD, lr=0.01), True),
    "FusedAdam": (_lean(mixedprec.FusedAdam, lr=1e-3, weight_decay=0.01), True),
    "FusedSGD": (_lean(mixedprec.FusedSGD, lr=0.01, momentum=0.9), True),
    "FusedLAMB": (lambda ps, master, _: mixedprec.FusedLAMB(
        ps, lr=1e-3, master_weights=master == "fp32"), False),
    "FusedMixedPrecisionLamb": (lambda ps, master, _: mixedprec.FusedMixedPrecisionLamb(
        ps, lr=1e-3), False),
    "FusedAdagrad": (lambda ps, master, _: mixedprec.FusedAdagrad(
        ps, lr=0.01, master_weights=master == "fp32"), False),
    "FusedNovoGrad": (lambda ps, master, _: mixedprec.FusedNovoGrad(
        ps, lr=1e-3, master_weights=master == "fp32"), False),
}


def cases():
    for name, (_, lean) in OPTIMIZERS.items():
        if name == "FusedMixedPrecisionLamb":
            yield pytest.param(name, "fp32", F32, id=name)
            continue
        masters = MASTERS if lean else ("fp32", "none")
        for master in masters:
            for state_dtype in STATE_DTYPES if lean else (F32,):
                yield pytest.param(name, master, state_dtype,
                                   id=f"{name}-{master}-{str(state_dtype)[6:]}")


def new_params(device):
    """bf16 params (one eligible for 8-bit state: 2-D, rows of 32 elements, 4096 of
    them: state8.eligible), an fp32 one (the norms amp O2 keeps in fp32) and a bf16 one
    that loses its gradient at step 4."""
    shapes = [((64, 64), BF16), ((10,), BF16), ((6,), F32), ((3, 5), BF16)]
    return [torch.randn(shape, device=device).to(dtype).requires_grad_()
            for shape, dtype in shapes]


def feed(params, skip=()):
    for i, p in enumerate(params):
        p.grad = None if i in skip else torch.randn_like(p) * 4


@contextlib.contextmanager
def where(device):
    """On "cpu": nothing; on "fake-cuda": fake CUDA tensors, made and stepped."""
    if device == "cpu":
        yield "cpu"
    else:
        with fake_cuda():
            yield "cuda"


def run_steps(opt, params, device, guard):
    """Four steps and an added param group, each step under ``guard()``."""
    scale = torch.full((), 1024.0, device=device)
    for step, found_inf, skip in ((1, 0.0, ()), (2, 0.0, ()), (3, 1.0, ()), (4, 0.0, (3,))):
        feed(params, skip)
        opt.grad_scale = scale
        opt.found_inf = torch.full((1,), found_inf, device=device)
        with guard():
            opt.step()
    extra = torch.randn(64, 64, device=device).to(params[0].dtype).requires_grad_()
    opt.add_param_group({"params": [extra]})
    feed(params + [extra])
    with guard():
        opt.step()


@pytest.mark.parametrize("place", ["cpu", "fake-cuda"])
@pytest.mark.parametrize("name,master,state_dtype", list(cases()))
def test_a_step_neither_syncs_nor_copies_host_data(name, master, state_dtype, place,
                                                  monkeypatch):
    make, _ = OPTIMIZERS[name]
    with where(place) as device:
        params = new_params(device)
        opt = make(params, master, state_dtype)
        run_steps(opt, params, device, lambda: forbid_host_sync(monkeypatch))


# --- the guard fires for each fault planted in a step ----------------------------------

FUSED_OPS = ("fused_adam_", "fused_sgd_", "fused_lamb_", "fused_adagrad_", "fused_novograd_")


def _plant(monkeypatch, fault):
    """Runs ``fault(device)`` before every fused optimizer op an optimizer calls (all of
    them call these wrappers of mixedprec.ops), on the device of its parameters."""
    from mixedprec import ops

    def planted(original):
        def op(params, *args, **kwargs):
            fault(params[0].device)
            return original(params, *args, **kwargs)
        return op
    for name in FUSED_OPS:
        monkeypatch.setattr(ops, name, planted(getattr(ops, name)))


FAULTS = {
    # a tensor from host data on the parameters' device (the 2026-11-27 fault)
    "tensor-from-host-data": lambda device: torch.tensor([1.0, 2.0], device=device),
    # a host tensor copied to the device: seen where the device is not the host
    "host-to-device-copy": lambda device: torch.ones(2).to(device),
    # reads of a device value
    "item": lambda device: torch.zeros((), device=device).item(),
    "bool": lambda device: bool(torch.zeros((), device=device) > 0),
}


@pytest.mark.parametrize("place", ["cpu", "fake-cuda"])
@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("name,master,state_dtype", list(cases()))
def test_the_guard_fires_for_a_fault_planted_in_each_step(name, master, state_dtype, fault,
                                                          place, monkeypatch):
    """The fault planted before the fused op of every optimizer and mode, in its first
    and in a planned step: the guard raises (fake tensors refuse a host read with their
    own error, as CUDA would sync)."""
    if fault == "host-to-device-copy" and place == "cpu":
        pytest.skip("on the CPU the host is the device: no copy to see")
    make, _ = OPTIMIZERS[name]
    with where(place) as device:
        params = new_params(device)
        opt = make(params, master, state_dtype)
        for planned in (False, True):
            with monkeypatch.context() as m:
                _plant(m, FAULTS[fault])
                feed(params)
                with pytest.raises((HostSyncError, RuntimeError)) as raised:
                    with forbid_host_sync(monkeypatch):
                        opt.step()
            assert (isinstance(raised.value, HostSyncError)
                    or "DataDependentOutput" in type(raised.value).__name__
                    or "synchronizing CUDA operation" in str(raised.value)), raised.value
            feed(params)
            opt.step()  # (unguarded: makes the plans the next round reuses)


def test_fake_cuda_runs_the_cuda_path():
    """The fake-CUDA runs are what they claim: parameters, state and the fused op's
    arguments on "cuda", nothing real computed."""
    from torch._subclasses.fake_tensor import FakeTensor
    with fake_cuda():
        params = new_params("cuda")
        opt = optim.AdamW(params, lr=1e-3, master="stochastic", seed=3)
        feed(params)
        opt.step()
        states = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    assert states and all(isinstance(t, FakeTensor) and t.device.type == "cuda"
                          for t in params + states)


@pytest.mark.parametrize("place", ["cpu", "fake-cuda"])
@pytest.mark.parametrize("name,master,state_dtype", [
    ("AdamW", "stochastic", BF16), ("AdamW", "remainder", E4M3), ("SGD", "kahan", BF16),
    ("SGD", "fp32", E4M3), ("Adam", "fp32", F32)])
def test_a_scaled_training_step_neither_syncs_nor_copies_host_data(name, master, state_dtype,
                                                                  place, monkeypatch):
    """The whole step of a training loop with mixedprec.GradScaler (scale, unscale_ for
    clipping, step, update), an overflow step included; the gradients set as a backward
    of the scaled loss would leave them."""
    make, _ = OPTIMIZERS[name]
    with where(place) as device:
        model = torch.nn.Linear(64, 64, device=device, dtype=BF16)
        opt = make(list(model.parameters()), master, state_dtype)
        with monkeypatch.context() as m:  # (else GradScaler("cuda") disables itself here)
            m.setattr(torch.cuda, "is_available", lambda: True)
            scaler = mixedprec.GradScaler(device, init_scale=2.0**10, growth_interval=2)
        assert scaler.is_enabled()
        for step in range(4):
            opt.zero_grad()
            with forbid_host_sync(monkeypatch):
                scaled = scaler.scale(torch.ones((), device=device))
            for p in model.parameters():  # (autograd does not run on fake CUDA tensors)
                p.grad = (torch.randn_like(p) * scaled).to(p.dtype)
                if step == 2:
                    p.grad.fill_(float("inf"))
            with forbid_host_sync(monkeypatch):
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
                scaler.step(opt)
                scaler.update()


SCHEDULERS = {
    "StepLR": lambda opt: lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "MultiStepLR": lambda opt: lr_scheduler.MultiStepLR(opt, milestones=[1, 3], gamma=0.5),
    "CosineAnnealingLR": lambda opt: lr_scheduler.CosineAnnealingLR(opt, T_max=5),
    "LinearLR": lambda opt: lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=3),
    "LambdaLR": lambda opt: lr_scheduler.LambdaLR(opt, lambda epoch: 0.9 ** epoch),
    "SequentialLR": lambda opt: lr_scheduler.SequentialLR(opt, [
        lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=2),
        lr_scheduler.StepLR(opt, step_size=2)], milestones=[2]),
}


@pytest.mark.parametrize("place", ["cpu", "fake-cuda"])
@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
def test_a_scheduled_step_neither_syncs_nor_copies_host_data(scheduler, place, monkeypatch):
    """mixedprec.optim.lr_scheduler's step after the optimizer's (which writes a device
    lr the fused ops read), a skipped step included."""
    with where(place) as device:
        params = new_params(device)
        opt = optim.AdamW(params, lr=1e-3, master="stochastic", seed=3)
        sched = SCHEDULERS[scheduler](opt)
        for found_inf in (0.0, 0.0, 1.0, 0.0):
            feed(params)
            opt.found_inf = torch.full((1,), found_inf, device=device)
            with forbid_host_sync(monkeypatch):
                opt.step()
                sched.step()
