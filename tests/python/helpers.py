"""Tensor builders, the small model, snapshots and assertions shared by the tests of
every layer (ops/, optim/, scaler/, apex/, distributed/)."""

import contextlib
import copy
import importlib.util
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from mixedprec import FusedAdam, FusedSGD

# (dtype, atol, rtol) for a result stored in `dtype` and computed in fp32: about two
# units in the last place of the storage type, the rounding eager PyTorch itself
# incurs when it writes an fp32 result into that type.
TOLERANCES = {
    torch.float32: dict(atol=1e-6, rtol=1e-5),
    torch.float16: dict(atol=1e-5, rtol=2e-3),
    torch.bfloat16: dict(atol=1e-4, rtol=1.6e-2),
}
DTYPES = list(TOLERANCES)
DTYPE_IDS = ["fp32", "fp16", "bf16"]
FLOAT_DTYPES = [pytest.param(dtype, tol["atol"], tol["rtol"], id=name)
                for (dtype, tol), name in zip(TOLERANCES.items(), DTYPE_IDS)]

_INT_VIEW = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float8_e4m3fn: torch.uint8,
    torch.float8_e8m0fnu: torch.uint8,
}


def randn(shape, dtype, device, seed, scale=1.0):
    """Normal values drawn on the CPU from `seed`, so that the CPU and CUDA twins of
    a test see the same data."""
    gen = torch.Generator().manual_seed(seed)
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def adam_state(params, device, seed):
    """fp32 moments as a few steps of Adam leave them: |exp_avg| <= sqrt(exp_avg_sq)."""
    m = [randn(p.shape, torch.float32, device, seed=seed + i, scale=0.1)
         for i, p in enumerate(params)]
    v = [mi.square() + randn(mi.shape, torch.float32, device, seed=seed + 500 + i,
                             scale=0.1).square() for i, mi in enumerate(m)]
    return m, v


def scalar(value, device, dtype=torch.float32):
    """A one-element tensor (found_inf, inv_scale, step, scale, trackers)."""
    return torch.tensor([value], dtype=dtype, device=device)


def offset_copy(t, offset=1):
    """A copy of `t` that starts `offset` elements into its storage, so that its data
    pointer is not aligned to 16 bytes."""
    buf = torch.empty(t.numel() + offset, dtype=t.dtype, device=t.device)
    view = buf[offset:].view(t.shape)
    view.copy_(t)
    assert view.data_ptr() % 16 != 0
    return view


def fp32_math(fn, *tensors, dtype):
    """What eager PyTorch gives for `fn` evaluated in fp32 and stored in `dtype`."""
    return fn(*(t.float() for t in tensors)).to(dtype)


def bits(t):
    """The raw bits of a floating-point tensor (an integer view), else the tensor."""
    return t.view(_INT_VIEW[t.dtype]) if t.dtype in _INT_VIEW else t


def assert_bitwise_equal(actual, expected, msg=""):
    assert actual.dtype == expected.dtype, f"{msg}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{msg}: shape {actual.shape} != {expected.shape}"
    assert actual.device == expected.device, f"{msg}: device {actual.device} != {expected.device}"
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True, msg=msg or None)
    assert torch.equal(bits(actual), bits(expected)), f"{msg}: bits differ"


def named_tensors(obj, name="arg"):
    """(name, tensor) for every tensor in nested lists, tuples and dicts."""
    if isinstance(obj, torch.Tensor):
        yield name, obj
    elif isinstance(obj, (list, tuple)):
        for i, item in enumerate(obj):
            yield from named_tensors(item, f"{name}[{i}]")
    elif isinstance(obj, dict):
        for key, item in obj.items():
            yield from named_tensors(item, key)


def snapshot(obj):
    """Clones of every tensor in `obj` (sparse ones densified), for assert_unchanged."""
    return [
        (name, (t.to_dense() if t.layout != torch.strided else t).detach().clone())
        for name, t in named_tensors(obj)
    ]


def assert_unchanged(obj, before):
    """Every tensor in `obj` holds bit for bit what `snapshot` saw."""
    after = snapshot(obj)
    assert [n for n, _ in after] == [n for n, _ in before]
    for (name, now), (_, then) in zip(after, before):
        assert_bitwise_equal(now, then, msg=f"{name} was modified")


def torch_optimizer(cls, params, kwargs):
    """The torch.optim counterpart of cls(params, **kwargs): FusedSGD/FusedAdam with
    Apex's arguments, or mixedprec.optim's SGD/Adam/AdamW with torch's (their
    keyword-only extras left out)."""
    kwargs = dict(kwargs)
    if cls is FusedSGD:
        return torch.optim.SGD(params, foreach=False, **kwargs)
    if cls is FusedAdam:
        adam_w_mode = kwargs.pop("adam_w_mode", True)
        torch_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
        kwargs.setdefault("weight_decay", 0.0)  # AdamW's default is 1e-2, Apex's 0
        return torch_cls(params, foreach=False, **kwargs)
    assert cls.__module__.startswith("mixedprec.optim."), cls
    for extra in ("master", "state_dtype", "seed", "unscale_grads"):
        kwargs.pop(extra, None)
    return getattr(torch.optim, cls.__name__)(params, foreach=False, **kwargs)


# A documented difference from torch.optim.SGD (an xfail reason of the tests that meet it).
DAMPENED_FIRST_STEP = (
    "documented: a step skipped on the device still creates the (zero) momentum buffers "
    "of mixedprec.optim.SGD and FusedSGD, so with dampening != 0 the next step dampens the "
    "gradient where torch.optim.SGD, which skips on the host, would start the buffer at "
    "the gradient (torch's own SGD(fused=True) creates its buffers the same way)")


def named_snapshot(obj):
    """helpers.snapshot of `obj` as {position:name: clone}."""
    return {f"{i}:{name}": t for i, (name, t) in enumerate(snapshot(obj))}


def state_dict_snapshot(model, opt):
    """Deep copies of the model's tensors (``model.state_dict()``, or for a list of
    parameters the list of their values) and of ``opt.state_dict()``, taken for a later
    comparison: assert_state_dict_unchanged (hyperparameters included, tensors by
    torch.equal), or a test's own."""
    weights = model.state_dict() if isinstance(model, nn.Module) else [
        p.detach() for p in model]
    return copy.deepcopy((weights, opt.state_dict()))


def assert_state_dict_unchanged(model, opt, before):
    """The model's (or the list of parameters') and the optimizer's state dicts are
    what `state_dict_snapshot` saw: the same tensors (torch.equal), param_groups and
    state keys."""
    model_sd, opt_sd = before
    if isinstance(model, nn.Module):
        for k, v in model.state_dict().items():
            assert torch.equal(v, model_sd[k]), k
    else:
        params = list(model)
        assert len(params) == len(model_sd)
        for i, (p, then) in enumerate(zip(params, model_sd)):
            assert torch.equal(p.detach(), then), f"param {i}"
    now = opt.state_dict()
    assert now["param_groups"] == opt_sd["param_groups"]
    assert {k for k, v in now["state"].items() if v} == set(opt_sd["state"])
    for pid, st in opt_sd["state"].items():
        for key, value in st.items():
            assert torch.equal(now["state"][pid][key], value), (pid, key)


def live_tensors(model, opt):
    """{name: tensor}, the live tensors, of everything an optimizer step may write:
    params, per-param state, group tensors (FusedAdam's step), named by position and key
    (whatever order the dicts were filled in)."""
    tensors = {}
    for i, p in enumerate(model.parameters()):
        tensors[f"param{i}"] = p
        for key, value in opt.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                tensors[f"state{i}.{key}"] = value
    for j, group in enumerate(opt.param_groups):
        for key, value in group.items():
            if isinstance(value, torch.Tensor):
                tensors[f"group{j}.{key}"] = value
    return tensors


def full_snapshot(model, opt):
    """{name: clone} of :func:`live_tensors`."""
    return {name: t.detach().clone() for name, t in live_tensors(model, opt).items()}


def assert_same_snapshot(a, b, msg=""):
    """Two full_snapshots hold the same names and the same bits."""
    assert sorted(a) == sorted(b), msg
    for name in a:
        assert_bitwise_equal(a[name], b[name], msg=f"{msg} {name}")


def max_abs_error(actual, reference):
    return (actual.double() - reference.double()).abs().max().item()


def assert_within_eager_error(actual, reference, eager, factor=2.0):
    """The error of `actual` against the fp64 `reference` is at most `factor` times
    that of eager PyTorch's `eager`, plus the rounding of an fp32 result."""
    floor = 2 * torch.finfo(torch.float32).eps * reference.double().abs().max().item()
    error = max_abs_error(actual, reference)
    eager_error = max_abs_error(eager, reference)
    assert error <= factor * eager_error + floor, (
        f"error {error:.3e} > {factor} x eager error {eager_error:.3e} + {floor:.3e}"
    )


# --- the small model of the optimizer and scaler tests ------------------------------------

IN, HIDDEN, OUT = 6, 10, 3


class Net(nn.Module):
    """Two linear layers whose dtypes may differ. The math runs in fp32 on weights cast
    from the layers' dtypes (fp16/bf16 matmuls are slow on CPU); gradients come back in
    each parameter's dtype."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(IN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        h = torch.tanh(F.linear(x, self.fc1.weight.float(), self.fc1.bias.float()))
        return F.linear(h, self.fc2.weight.float(), self.fc2.bias.float())


def backward(model, step, scale=1.0, batch=8):
    """Gradients of a regression loss of make_model's Net on the batch of `step`
    (deterministic: drawn from seeds), the loss times `scale`; returns the loss."""
    device = model.fc1.weight.device
    x = randn((batch, IN), torch.float32, device, seed=10_000 + step)
    y = randn((batch, OUT), torch.float32, device, seed=20_000 + step)
    loss = (model(x) - y).pow(2).mean() * scale
    loss.backward()
    return loss


def make_model(device="cpu", dtype=torch.float32, fc2_dtype=None, seed=0, *, sizes=None,
               activation=nn.Tanh, norm=None):
    """The small model of the tests, its weights a function of `seed` only.

    Without `sizes`: a :class:`Net` (IN -> HIDDEN -> OUT), fc1 in `dtype`, fc2 in
    `fc2_dtype` (default: `dtype`), weights drawn from private generators (torch's
    global RNG is left alone).

    With `sizes` = (d_in, h_1, ..., d_out): ``nn.Sequential`` of Linear layers with an
    `activation` (a module class, or one per gap) between them and, with `norm` (say
    ``nn.BatchNorm1d``), a norm of each hidden width before its activation, in torch's
    default initialization after ``torch.manual_seed(seed)`` (as the tests' own
    Sequential models were built, so the global RNG is reseeded; ``seed=None`` draws
    from the global RNG as it stands), moved to `device` and `dtype`, the last Linear
    to `fc2_dtype` when given. Parameter names are Sequential's ("0.weight", ...)."""
    if sizes is None:
        model = Net()
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p.copy_(randn(p.shape, torch.float32, "cpu", seed=seed + i, scale=0.5))
        model.fc1.to(device=device, dtype=dtype)
        model.fc2.to(device=device, dtype=fc2_dtype or dtype)
        return model
    gaps = len(sizes) - 2
    activations = list(activation) if isinstance(activation, (list, tuple)) \
        else [activation] * gaps
    assert len(activations) == gaps, "one activation per hidden layer"
    if seed is not None:
        torch.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < gaps:
            layers += ([norm(b)] if norm is not None else []) + [activations[i]()]
    model = nn.Sequential(*layers).to(device=device, dtype=dtype)
    if fc2_dtype is not None:
        model[-1].to(dtype=fc2_dtype)
    return model


# --- no host synchronisation --------------------------------------------------------------

SYNC_METHODS = ("item", "__bool__", "cpu", "tolist", "__float__", "__int__")
_SYNC_OPS = ("_local_scalar_dense", "is_nonzero", "equal")
# A tensor made from host data (torch.tensor, as_tensor, from_numpy, new_tensor all end
# in lift_fresh): on CUDA a copy from host memory, which waits for the host and cannot
# be captured in a CUDA graph, even where it is on the CPU's device.
_HOST_DATA_OPS = ("lift_fresh", "lift_fresh_copy")


class HostSyncError(AssertionError):
    pass


class _ForbidSyncOps(TorchDispatchMode):
    """Catches the ATen ops that read a tensor on the host, however they are reached
    (also a `.item()` that bypasses the Python attribute), tensors made from host data,
    and copies between the host and a device (seen on the CPU machines under
    :func:`fake_cuda`)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _SYNC_OPS:
            raise HostSyncError(f"{func} during a sync-free call")
        if name in _HOST_DATA_OPS:
            raise HostSyncError(f"{func}: a tensor made from host data during a sync-free "
                                "call (on CUDA, a copy from host memory)")
        if name in ("_to_copy", "copy_"):
            devices = {a.device.type for a in args if isinstance(a, torch.Tensor)}
            if kwargs.get("device") is not None:
                devices.add(torch.device(kwargs["device"]).type)
            if "cpu" in devices and len(devices) > 1:
                raise HostSyncError(f"{func} between the host and the device")
        return func(*args, **kwargs)


@contextlib.contextmanager
def forbid_host_sync(monkeypatch):
    """Tensor.item/__bool__/cpu/tolist/__float__/__int__ raise (and are recorded), the
    ATen ops behind them raise, and on CUDA so does any synchronising CUDA call."""
    calls = []

    def forbidden(name):
        def method(self, *args, **kwargs):
            calls.append(name)
            raise HostSyncError(f"Tensor.{name} during a sync-free call")
        return method

    patched = {name: forbidden(name) for name in SYNC_METHODS}
    with monkeypatch.context() as m:
        for name, method in patched.items():
            m.setattr(torch.Tensor, name, method)
        cuda = torch.cuda.is_available()
        if cuda:
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
        try:
            with _ForbidSyncOps():
                yield calls
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(previous)
        # What ran was the patched version, and nothing swallowed a HostSyncError.
        assert all(getattr(torch.Tensor, n) is patched[n] for n in SYNC_METHODS)
        assert calls == [], f"host syncs: {calls}"


@contextlib.contextmanager
def fake_cuda():
    """A FakeTensorMode in which tensors made on "cuda" are fake CUDA tensors: metadata
    only, no GPU needed, mixedprec's ops running their fake kernels. A step run in it
    on CUDA parameters takes the CUDA path of the Python code, so that a copy from
    the host to the device (``.to("cuda")`` of a host tensor) shows as one to
    :func:`forbid_host_sync`, as only a GPU run showed it before."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with warnings.catch_warnings():
        # (plans key parameters by data_ptr(), which a fake tensor answers with 0)
        warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
        with FakeTensorMode():
            yield


def eager_and_compiled_steps(make_optimizer, steps=3):
    """The parameters of a small bf16 model after ``steps`` steps of the optimizer
    ``make_optimizer(params)`` builds, stepped eagerly and through
    ``torch.compile(fullgraph=True)``: [eager params, compiled params]."""
    torch._dynamo.reset()
    results = []
    for compiled in (False, True):
        torch.manual_seed(0)
        model = nn.Linear(8, 4).to(torch.bfloat16)
        opt = make_optimizer(model.parameters())
        step = (torch.compile(opt.step, backend="eager", fullgraph=True) if compiled
                else opt.step)
        for _ in range(steps):
            opt.zero_grad()
            model(torch.ones(2, 8, dtype=torch.bfloat16)).float().sum().backward()
            step()
        results.append([p.detach().clone() for p in model.parameters()])
    return results


REPO = Path(__file__).resolve().parents[2]


def missing_modules(*names):
    """The names among ``names`` (top-level modules) that this interpreter cannot import:
    optional test dependencies, whose tests skip naming them."""
    return [n for n in names if importlib.util.find_spec(n) is None]


def load_script(path: str):
    """The repository's script at ``path`` (relative to the root, e.g.
    "scripts/cuda_resources.py"), imported as a module of its file's name."""
    spec = importlib.util.spec_from_file_location(Path(path).stem, REPO / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
