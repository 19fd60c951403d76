"""mixedprec.grads: the one gradient module of the core (grouping by device, the
read-only overflow check, unscale, which gradient an update reads), and what its
callers gained from it: amp's overflow check and unscale take sparse gradients and
gradients on several devices.

Every test runs on the CPU; those taking the ``device`` fixture have a CUDA twin that
skips on a machine without a GPU (``other_device``: two devices, CUDA either way)."""

import contextlib
import copy

import pytest
import torch
from helpers import bits, randn
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mixedprec
from mixedprec import amp, grads, masters

INF = float("inf")
NAN = float("nan")
ALL_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
ALL_DTYPE_IDS = ["fp32", "fp16", "bf16", "fp64"]
SYNC_METHODS = ("item", "__bool__", "__float__", "__int__", "tolist", "cpu")


@pytest.fixture(autouse=True)
def _forget_pending_registrations():
    yield
    amp._registered_casts.clear()


@contextlib.contextmanager
def refuse_host_reads():
    """Tensor methods that read a value on the host raise inside."""
    def forbidden(name):
        def method(self, *args, **kwargs):
            raise AssertionError(f"Tensor.{name}: a host read")
        return method

    with pytest.MonkeyPatch.context() as m:
        for name in SYNC_METHODS:
            m.setattr(torch.Tensor, name, forbidden(name))
        yield


@pytest.fixture
def no_host_reads():
    """Tensor methods that read a value on the host raise while the test runs."""
    with refuse_host_reads():
        yield


def flag(device):
    return torch.zeros((), dtype=torch.float32, device=device)


def sparse(values, indices, size, device, dtype=torch.float32):
    """A 1-d sparse COO tensor, uncoalesced when ``indices`` repeat."""
    with torch.sparse.check_sparse_tensor_invariants():
        return torch.sparse_coo_tensor(torch.tensor([indices]),
                                       torch.tensor(values, dtype=dtype), (size,), device=device)


# --- grouping ----------------------------------------------------------------------------

def test_by_device_groups_parallel_lists_in_order():
    a, b, c = torch.zeros(1), torch.ones(2, dtype=torch.float16), torch.zeros(3)
    out = grads.by_device([a, b, c], ["x", "y", "z"])
    assert list(out) == [torch.device("cpu")]
    [(tensors, tags)] = out.values()
    assert [t is s for t, s in zip(tensors, (a, b, c))] == [True] * 3 and tags == ["x", "y", "z"]
    assert grads.by_device([]) == {}


def test_by_device_and_dtype_is_torchs_grouping():
    a, b, c = torch.zeros(1), torch.ones(2, dtype=torch.float16), torch.zeros(3)
    out = grads.by_device_and_dtype([a, b, c])
    assert set(out) == {(torch.device("cpu"), torch.float32), (torch.device("cpu"), torch.float16)}
    assert [t.shape for t in out[(torch.device("cpu"), torch.float32)][0]] == [(1,), (3,)]
    assert grads.by_device_and_dtype([]) == {}


def test_by_device_splits_two_devices(device, other_device):
    a, b = torch.zeros(1, device=device), torch.zeros(2, device=other_device)
    out = grads.by_device([a, b, a])
    assert {str(d.type): [t.numel() for t in ts] for d, (ts,) in out.items()} == {
        device: [1, 1], other_device: [2]}


# --- which gradient an update reads ------------------------------------------------------

def test_update_grad_is_the_masters_when_set():
    p = nn.Parameter(torch.zeros(2, dtype=torch.float16))
    master = nn.Parameter(torch.zeros(2))
    assert grads.update_grad(p, master) is None and grads.update_grad(p, None) is None
    p.grad = torch.ones(2, dtype=torch.float16)
    assert grads.update_grad(p, master) is p.grad and grads.update_grad(p, None) is p.grad
    master.grad = torch.full((2,), 2.0)
    assert grads.update_grad(p, master) is master.grad


# --- the read-only overflow check --------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("bad", [None, INF, float("nan")])
def test_check_finite_sets_the_flag_and_writes_nothing(device, dtype, bad, no_host_reads):
    gs = [torch.ones(5, dtype=dtype, device=device), torch.ones(4, 3, device=device).t()]
    if bad is not None:
        gs[0][3] = bad
    before = [(g.clone(), g._version) for g in gs]
    found_inf = flag(device)
    flags = grads.check_finite_(gs, found_inf)
    assert len(flags) == 1 and flags[found_inf.device] is found_inf
    assert torch.equal(found_inf, flag(device) + (bad is not None))
    for g, (kept, version) in zip(gs, before):
        assert g._version == version and torch.equal(g.nan_to_num(), kept.nan_to_num())


def test_check_finite_never_clears_the_flag():
    found_inf = torch.ones(1)
    grads.check_finite_([torch.ones(3)], found_inf)
    assert torch.equal(found_inf, torch.ones(1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_check_finite_reads_a_sparse_gradients_values(device, dtype):
    finite = sparse([1.0, 2.0], [0, 3], 5, device, dtype)
    found_inf = flag(device)
    grads.check_finite_([finite], found_inf)
    assert found_inf.item() == 0
    grads.check_finite_([sparse([1.0, INF], [0, 3], 5, device, dtype)], found_inf)
    assert found_inf.item() == 1


def test_check_finite_reads_a_sparse_gradient_coalesced():
    """Two fp16 entries at one index: each is finite, their sum (what the update adds)
    is not. The gradient itself is left as it is."""
    g = sparse([60000.0, 60000.0], [2, 2], 4, "cpu", torch.float16)
    assert not g.is_coalesced()
    found_inf = flag("cpu")
    grads.check_finite_([g], found_inf)
    assert found_inf.item() == 1 and not g.is_coalesced()


def test_check_finite_on_two_devices(device, other_device):
    here, there = torch.ones(3, device=device), torch.ones(3, device=other_device)
    there[1] = INF
    found_inf = flag(device)
    flags = grads.check_finite_([here, there], found_inf)
    assert set(flags) == {here.device, there.device} and flags[here.device] is found_inf
    assert found_inf.item() == 1 and flags[there.device].item() == 1
    kept = flag(device)  # merge=False: one flag per device, as torch's GradScaler keeps them
    flags = grads.check_finite_([here, there], kept, merge=False)
    assert kept.item() == 0 and flags[there.device].item() == 1


# --- unscale -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_unscale_in_place(device, dtype):
    dense = torch.arange(6, dtype=dtype, device=device) * 4
    strided = (torch.arange(12, dtype=dtype, device=device) * 4)[::2]  # not dense: a dense copy
    expected = [dense / 4, strided / 4]
    found_inf = flag(device)
    grads.unscale_([dense, strided], found_inf, torch.tensor(0.25, device=device))
    assert torch.equal(dense, expected[0]) and torch.equal(strided, expected[1])
    assert found_inf.item() == 0
    dense[2] = INF
    grads.unscale_([dense], found_inf, torch.tensor(0.25, device=device))
    assert found_inf.item() == 1


def test_unscale_without_inv_scale_checks_only(device):
    g = torch.arange(4.0, device=device)
    found_inf = flag(device)
    grads.unscale_([g], found_inf, None)
    assert torch.equal(g, torch.arange(4.0, device=device)) and found_inf.item() == 0


def test_unscale_a_sparse_gradients_values_in_place(device):
    g = sparse([4.0, 8.0, 2.0], [0, 3, 0], 5, device)
    found_inf = flag(device)
    grads.unscale_([g], found_inf, torch.tensor(0.5, device=device))
    assert torch.equal(g.to_dense(), torch.tensor([3.0, 0, 0, 4.0, 0], device=device))
    assert found_inf.item() == 0


def test_unscale_into_other_tensors(device):
    src = [torch.full((3,), 6.0, dtype=torch.float16, device=device),
           torch.full((2,), 2.0, dtype=torch.bfloat16, device=device)]
    dst = [torch.empty(3, device=device), torch.empty(2, device=device)]
    found_inf = flag(device)
    grads.unscale_(src, found_inf, torch.tensor(0.5, device=device), out=dst)
    assert torch.equal(dst[0], torch.full((3,), 3.0, device=device))
    assert torch.equal(dst[1], torch.ones(2, device=device))
    assert torch.equal(src[0], torch.full((3,), 6.0, dtype=torch.float16, device=device))


def test_unscale_on_two_devices(device, other_device):
    here, there = torch.full((3,), 4.0, device=device), torch.full((2,), 8.0, device=other_device)
    found_inf = flag(device)
    grads.unscale_([here, there], found_inf, torch.tensor(0.25, device=device))
    assert torch.equal(here.cpu(), torch.ones(3))
    assert torch.equal(there.cpu(), torch.full((2,), 2.0))
    assert found_inf.item() == 0
    there[0] = INF
    grads.unscale_([here, there], found_inf, torch.tensor(0.25, device=device))
    assert found_inf.item() == 1


def test_no_host_read_in_check_and_unscale(device, no_host_reads):
    gs = [torch.ones(4, device=device), torch.ones(3, dtype=torch.float16, device=device)]
    found_inf = flag(device)
    grads.check_finite_(gs, found_inf)
    grads.unscale_(gs, found_inf, torch.tensor(0.5, device=device))
    grads.unscale_(gs, found_inf, None, out=[torch.empty(4, device=device),
                                            torch.empty(3, device=device)])


# --- gradients that are not dense: mixedprec's ops, never torch's kernel ------------------

class RefuseTorchUnscale(TorchDispatchMode):
    """torch's unscale kernel raises for the dtypes mixedprec's ops take, as on CUDA
    for bfloat16 (no such kernel there): a CPU run fails where a CUDA run would."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten._amp_foreach_non_finite_check_and_unscale_ \
                and any(t.dtype in grads.OP_DTYPES for t in args[0]):
            raise NotImplementedError(f"{func}: refused for {args[0][0].dtype}, which "
                                      "mixedprec's ops take (torch's kernel has no bfloat16 "
                                      "CUDA implementation)")
        return func(*args, **(kwargs or {}))


def test_the_refusal_refuses_torchs_unscale_of_op_dtypes(device):
    inv_scale = torch.tensor(0.5, device=device)
    with RefuseTorchUnscale():
        for dtype in grads.OP_DTYPES:
            with pytest.raises(NotImplementedError, match="refused"):
                torch._amp_foreach_non_finite_check_and_unscale_(
                    [torch.ones(3, dtype=dtype, device=device)], flag(device), inv_scale)
        wide = torch.ones(3, dtype=torch.float64, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_([wide], flag(device), inv_scale)
    assert torch.equal(wide, torch.full((3,), 0.5, dtype=torch.float64, device=device))


# Views that are strided but not dense (the ops take none of them as they are), each
# as (shape of the tensor viewed, the view): a slice of a transpose, every third
# element, a slice in the middle dimension.
NON_DENSE = [((6, 8), lambda t: t.t()[::2]), ((10,), lambda t: t[1::3]),
             ((5, 4, 3), lambda t: t[:, 1:3, :])]


def non_dense_grads(dtype, device, bad=None):
    """(tensors, their non-dense views), values about 1000 (scaled gradients); ``bad``
    put into the first view."""
    bases = [randn(shape, dtype, device, seed=i, scale=1000.0)
             for i, (shape, _) in enumerate(NON_DENSE)]
    views = [view(base) for base, (_, view) in zip(bases, NON_DENSE)]
    assert not any(mixedprec.ops.is_dense(v) for v in views)
    if bad is not None:
        views[0][1, 2] = bad
    return bases, views


def ref_unscaled(g, inv_scale):
    """``g * inv_scale`` as the ops compute it: float32 math (the float64 product of two
    float32 values is exact, so rounding it to float32 is float32's product), stored in
    g's dtype; a float64 gradient in float64 (torch's kernel)."""
    exact = g.double() * inv_scale.double()
    return exact if g.dtype == torch.float64 else exact.float().to(g.dtype)


def assert_same_bits(got, want, msg=""):
    """Equal values and bits, NaN where the other has NaN (its payload aside)."""
    assert got.dtype == want.dtype, msg
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True, msg=msg or None)
    numbers = ~want.isnan()
    assert torch.equal(bits(got)[numbers], bits(want)[numbers]), f"{msg}: bits differ"


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ALL_DTYPE_IDS)
@pytest.mark.parametrize("bad", [None, INF, NAN], ids=["finite", "inf", "nan"])
def test_unscale_of_non_dense_gradients(device, dtype, bad):
    """Non-dense fp32/fp16/bf16 gradients are unscaled by mixedprec's op (torch's kernel,
    refused here for them, has no bfloat16 CUDA kernel), in place: each view holds the
    float64 reference's value rounded as the op rounds, the elements around it are left
    as they were, and found_inf is set exactly when a gradient holds inf or NaN. Dense
    gradients in the same call, and float64 ones through torch's kernel, alike."""
    bases, views = non_dense_grads(dtype, device, bad)
    dense = randn((7,), dtype, device, seed=9, scale=1000.0)
    inv_scale = torch.tensor(1 / 3, device=device)  # not a power of two: the products round
    want_bases = [base.clone() for base in bases]
    for want, view, (_, make_view) in zip(want_bases, views, NON_DENSE):
        make_view(want).copy_(ref_unscaled(view, inv_scale))
    want_dense = ref_unscaled(dense, inv_scale)
    found_inf = flag(device)

    with RefuseTorchUnscale(), refuse_host_reads():
        grads.unscale_([views[0], dense, *views[1:]], found_inf, inv_scale)

    for i, (base, want) in enumerate(zip(bases, want_bases)):
        assert_same_bits(base, want, msg=f"view {i} and the tensor around it")
    assert_same_bits(dense, want_dense, msg="dense")
    assert torch.equal(found_inf, flag(device) + (bad is not None))


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ALL_DTYPE_IDS)
@pytest.mark.parametrize("bad", [None, INF, NAN], ids=["finite", "inf", "nan"])
def test_check_finite_of_non_dense_gradients(device, dtype, bad):
    """The read-only check of non-dense gradients (dense copies through mixedprec's op,
    float64 through torch's isfinite): the flag set exactly on inf or NaN, nothing
    written."""
    bases, views = non_dense_grads(dtype, device, bad)
    before = [(base.clone(), base._version) for base in bases]
    found_inf = flag(device)
    with refuse_host_reads():
        grads.check_finite_(views, found_inf)
    assert torch.equal(found_inf, flag(device) + (bad is not None))
    for base, (kept, version) in zip(bases, before):
        assert base._version == version
        assert_same_bits(base, kept)


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=ALL_DTYPE_IDS)
@pytest.mark.parametrize("bad", [None, INF, NAN, "max"], ids=["finite", "inf", "nan", "max"])
def test_nonfinite_per_tensor_of_non_dense_gradients(device, dtype, bad):
    """A non-dense gradient is flagged as its dense copy is (inf, NaN, or "max": every
    element the dtype's largest value, an L2 norm past float32's range for float32 and
    bfloat16), and as the float64 reference says for inf and NaN."""
    _, views = non_dense_grads(dtype, device, None if bad == "max" else bad)
    if bad == "max":
        views[0].fill_(torch.finfo(dtype).max)

    def flags(gs):  # one flag per gradient, in order
        with refuse_host_reads():
            found = grads.nonfinite_per_tensor(gs)
        out = torch.zeros(len(gs), dtype=torch.bool, device=device)
        for positions, flagged in found:
            out[positions] = flagged
        return out

    got = flags(views)
    assert torch.equal(got, flags([v.contiguous() for v in views]))
    if bad != "max":
        reference = torch.stack([~torch.isfinite(v.double()).all() for v in views])
        assert torch.equal(got, reference)


# --- amp: its overflow check and unscale through grads ------------------------------------

AMP_OPTIMIZERS = {  # the fused path checks (check_finite_), the other unscales (unscale_)
    "mixedprec.optim.SGD": lambda params: mixedprec.optim.SGD(params, lr=0.5),
    "torch.optim.SGD": lambda params: torch.optim.SGD(params, lr=0.5),
}


def amp_embedding(device, opt_name):
    torch.manual_seed(0)
    emb = nn.Embedding(6, 3, sparse=True).to(device)
    reference = copy.deepcopy(emb)
    opt = AMP_OPTIMIZERS[opt_name](emb.parameters())
    emb, opt = amp.initialize(emb, opt, opt_level="O0", loss_scale="dynamic", verbosity=0)
    return emb, opt, reference


@pytest.mark.parametrize("opt_name", list(AMP_OPTIMIZERS))
def test_amp_steps_a_sparse_gradient(device, opt_name):
    emb, opt, reference = amp_embedding(device, opt_name)
    idx = torch.tensor([1, 4, 4], device=device)
    with amp.scale_loss(emb(idx).sum(), opt) as scaled:
        scaled.backward()
    assert emb.weight.grad.is_sparse
    opt.step()
    reference(idx).sum().backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    assert torch.equal(emb.weight.detach(), reference.weight.detach())
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**16


@pytest.mark.parametrize("opt_name", list(AMP_OPTIMIZERS))
def test_amp_skips_the_step_when_a_sparse_gradient_overflows(device, opt_name):
    emb, opt, _ = amp_embedding(device, opt_name)
    before = emb.weight.detach().clone()
    idx = torch.tensor([1, 4], device=device)
    with amp.scale_loss(emb(idx).sum() * 1e35, opt) as scaled:  # * 2**16: inf in fp32
        scaled.backward()
    opt.step()
    assert torch.equal(emb.weight.detach(), before)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**15


class TwoDevices(nn.Module):
    """One weight on each device; the loss is formed on the first."""

    def __init__(self, device, other_device):
        super().__init__()
        self.a = nn.Parameter(torch.ones(3, device=device))
        self.b = nn.Parameter(torch.ones(3, device=other_device))

    def forward(self, x, y):
        return (self.a * x).sum() + (self.b * y).sum().to(self.a.device)


@pytest.mark.parametrize("opt_name", ["FusedSGD", "torch.optim.SGD"])
@pytest.mark.parametrize("overflow", [False, True], ids=["finite", "overflow"])
def test_amp_with_gradients_on_two_devices(device, other_device, opt_name, overflow):
    """amp's overflow check (fused) and unscale (other optimizers) see every device's
    gradients; an overflow on the device other than the loss's skips the step."""
    model = TwoDevices(device, other_device)
    make = (lambda ps: mixedprec.FusedSGD(ps, lr=0.5)) if opt_name == "FusedSGD" \
        else (lambda ps: torch.optim.SGD(ps, lr=0.5))
    model, opt = amp.initialize(model, make(model.parameters()), opt_level="O0",
                                loss_scale="dynamic", verbosity=0)
    x = torch.full((3,), 2.0, device=device)
    y = torch.full((3,), 1e35 if overflow else 4.0, device=other_device)
    with amp.scale_loss(model(x, y), opt) as scaled:
        scaled.backward()
    opt.step()
    if overflow:
        assert torch.equal(model.a.detach().cpu(), torch.ones(3))
        assert torch.equal(model.b.detach().cpu(), torch.ones(3))
        assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**15
    else:
        assert torch.equal(model.a.detach().cpu(), torch.zeros(3))  # 1 - 0.5 * 2
        assert torch.equal(model.b.detach().cpu(), torch.full((3,), -1.0))  # 1 - 0.5 * 4
        assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 2.0**16


def test_amp_handle_unscales_a_sparse_gradient():
    """amp.init()'s handle (2018 API) unscales sparse gradients in place."""
    handle = amp.init(verbose=False)
    try:
        emb = nn.Embedding(6, 3, sparse=True)
        opt = torch.optim.SGD(emb.parameters(), lr=0.5)
        idx = torch.tensor([1, 4, 4])
        with handle.scale_loss(emb(idx).float().sum(), opt) as scaled:
            scaled.backward()
        dense = emb.weight.grad.to_dense()
        assert torch.equal(dense[4], torch.full((3,), 2.0)) and torch.equal(dense[0],
                                                                           torch.zeros(3))
    finally:
        handle._deactivate()


# --- bad input: refused before anything is written (an outside audit, 2026-12-02) ------

def test_unscale_refuses_a_gradient_it_cannot_take_before_writing():
    """Before: the float gradients before it were unscaled in place, then torch's kernel
    raised a bare NotImplementedError."""
    given = [torch.full((3,), 4.0), torch.ones(2, dtype=torch.int64)]
    found_inf = torch.zeros(())
    with pytest.raises(TypeError, match=r"unscale_: expected grads\[1\] to be a float32"):
        grads.unscale_(given, found_inf, torch.tensor(0.5))
    assert torch.equal(given[0], torch.full((3,), 4.0)) and float(found_inf) == 0.0
    with pytest.raises(ValueError, match="expected out to hold one tensor per gradient"):
        grads.unscale_([torch.ones(3)], found_inf, None, out=[torch.ones(3), torch.ones(3)])


def test_copy_to_model_checks_every_pair_before_writing():
    """Before: the pairs before a mismatched one were written, then reshape raised; lists
    of two lengths were cut to the shorter."""
    params = [torch.zeros(3, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.bfloat16)]
    with pytest.raises(ValueError, match=r"masters\[1\] has shape \(5,\), params\[1\] \(4,\)"):
        masters.copy_to_model([torch.ones(3), torch.ones(5)], params)
    assert not params[0].any()
    with pytest.raises(ValueError, match="expected masters and params of one length, got 1 "
                                         "and 2"):
        masters.copy_to_model([torch.ones(3)], params)
    with pytest.raises(TypeError, match=r"expected masters\[0\] and params\[0\] to be tensors"):
        masters.copy_to_model([1.0], params[:1])
    halves = [torch.zeros(3, dtype=torch.float16, requires_grad=True)]
    halves[0].grad = torch.ones(3, dtype=torch.float16)
    with pytest.raises(ValueError, match="expected params and masters of one length"):
        masters.unscale_into_masters(halves, [], torch.zeros(()), None)
