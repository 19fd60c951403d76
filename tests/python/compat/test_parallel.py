"""mixedprec.parallel: LARC against a plain float64 reference of Apex's algorithm,
SyncBatchNorm (channel_last, z, fuse_relu) and convert_syncbn_model, the flat helpers
(split_by_type, split_half_float_double, extract_tensors) and apex_C, and on two gloo
processes DistributedDataParallel with Apex's arguments (parameters in sync, gradients
averaged or summed, one bucket, no_sync, retain_allreduce_buffers), flat_dist_call,
apply_flat_dist_call and Reducer."""

import gc
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from helpers import make_model, randn
from torch import nn

from mixedprec import apex_C
from mixedprec.parallel import (
    LARC,
    DistributedDataParallel,
    ReduceOp,
    Reducer,
    SyncBatchNorm,
    apply_flat_dist_call,
    convert_syncbn_model,
    extract_tensors,
    flat_dist_call,
    split_by_type,
    split_half_float_double,
)

# --- LARC ----------------------------------------------------------------------------


def ref_larc_grads(params, grads, lr, weight_decay, trust_coefficient, clip, eps):
    """Apex's LARC gradient adaptation, with host-side tests, in float64."""
    out = []
    for p, g in zip(params, grads):
        p, g = p.double(), g.double()
        param_norm, grad_norm = p.norm().item(), g.norm().item()
        if param_norm != 0 and grad_norm != 0:
            local = trust_coefficient * param_norm / (grad_norm + param_norm * weight_decay + eps)
            if clip:
                local = min(local / lr, 1.0)
            g = (g + weight_decay * p) * local
        out.append(g)
    return out


def larc_setup(device, dtype=torch.float32):
    shapes = [(4, 3), (7,), (2, 2, 5), (3,)]
    params = [randn(s, dtype, device, seed=i).requires_grad_() for i, s in enumerate(shapes)]
    grads = [randn(s, dtype, device, seed=10 + i, scale=0.1 * (i + 1))
             for i, s in enumerate(shapes)]
    with torch.no_grad():
        params[3].zero_()  # a zero parameter: its gradient is left alone
    grads[1] = torch.zeros_like(grads[1])  # a zero gradient: likewise
    for p, g in zip(params, grads):
        p.grad = g.clone()
    return params, grads


@pytest.mark.parametrize("clip", [True, False], ids=["clip", "scale"])
@pytest.mark.parametrize("weight_decay", [0.0, 1e-2], ids=["no_decay", "decay"])
def test_larc_matches_reference(device, clip, weight_decay):
    params, grads = larc_setup(device)
    before = [p.detach().clone() for p in params]
    lr, tc = 0.5, 0.02
    optimizer = LARC(torch.optim.SGD(params, lr=lr, weight_decay=weight_decay),
                     trust_coefficient=tc, clip=clip)
    expected_grads = ref_larc_grads(before, grads, lr, weight_decay, tc, clip, 1e-8)

    optimizer.step()

    for p, ref_g, p0 in zip(params, expected_grads, before):
        torch.testing.assert_close(p.grad.double(), ref_g, atol=1e-7, rtol=1e-5)
        # The wrapped SGD stepped with weight decay 0: LARC folded it into the grad.
        torch.testing.assert_close(p.detach().double(), p0.double() - lr * ref_g,
                                   atol=1e-6, rtol=1e-5)
    assert optimizer.param_groups[0]["weight_decay"] == weight_decay


def test_larc_fp16_grads(device):
    params, grads = larc_setup(device, torch.float16)
    optimizer = LARC(torch.optim.SGD(params, lr=0.1, weight_decay=1e-3))
    expected = ref_larc_grads([p.detach() for p in params], grads, 0.1, 1e-3, 0.02, True, 1e-8)
    optimizer.step()
    for p, ref_g in zip(params, expected):
        assert p.grad.dtype == torch.float16
        torch.testing.assert_close(p.grad.double(), ref_g, atol=1e-5, rtol=2e-3)


def test_larc_forwards_to_the_optimizer():
    params, _ = larc_setup("cpu")
    sgd = torch.optim.SGD(params[:2], lr=0.1, momentum=0.9)
    optimizer = LARC(sgd, trust_coefficient=0.01, clip=False, eps=1e-6)
    assert optimizer.param_groups is sgd.param_groups and optimizer.state is sgd.state
    assert repr(optimizer) == repr(sgd)
    optimizer.add_param_group({"params": params[2:]})
    assert len(sgd.param_groups) == 2
    optimizer.step()
    state = optimizer.state_dict()
    assert state == sgd.state_dict()
    optimizer.load_state_dict(state)
    optimizer.zero_grad()
    assert all(p.grad is None for p in params)
    calls = []
    optimizer.step(lambda: calls.append(1))
    assert calls == [1]


def test_larc_step_does_not_synchronize():
    if not torch.cuda.is_available():
        pytest.skip("the host-sync check needs CUDA")
    params, _ = larc_setup("cuda")

    class NoStep(torch.optim.Optimizer):
        def step(self, closure=None):
            pass

    optimizer = LARC(NoStep(params, dict(lr=0.1, weight_decay=1e-2)))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        optimizer.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_larc_closure_runs_before_the_adaptation():
    """A closure computes the gradients LARC then adapts (as torch's optimizers run it
    first); run by the wrapped step instead, it would replace the adapted gradients."""
    params, grads = larc_setup("cpu")
    before = [p.detach().clone() for p in params]
    optimizer = LARC(torch.optim.SGD(params, lr=0.5, weight_decay=1e-2))
    for p in params:
        p.grad = None

    def closure():
        for p, g in zip(params, grads):
            p.grad = g.clone()
        return torch.ones(())

    assert optimizer.step(closure) == 1
    expected = ref_larc_grads(before, grads, 0.5, 1e-2, 0.02, True, 1e-8)
    for p, ref_g, p0 in zip(params, expected, before):
        torch.testing.assert_close(p.detach().double(), p0.double() - 0.5 * ref_g,
                                   atol=1e-6, rtol=1e-5)


def test_larc_norms_of_float64_parameters_are_float64():
    params = [torch.full((3,), 1 + 2**-40, dtype=torch.float64, requires_grad=True)]
    params[0].grad = torch.full((3,), 1e-3, dtype=torch.float64)
    optimizer = LARC(torch.optim.SGD(params, lr=1.0), trust_coefficient=1.0, clip=False,
                     eps=0.0)
    optimizer.step()
    # local = |p| / |g| exactly in float64: the gradient becomes p (up to float64 rounding)
    torch.testing.assert_close(params[0].detach(), torch.zeros(3, dtype=torch.float64),
                               atol=1e-14, rtol=0)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_amp_initialize_and_scale_loss_take_larc(opt_level):
    """As Apex's amp: a LARC around the optimizer goes through initialize (returned as
    given) and scale_loss, and LARC adapts unscaled gradients (the fp32 masters' at O2):
    torch's SGD and mixedprec's FusedSGD at a scale of 128 step as torch's SGD at a scale
    of 1, the adapted step and not the plain one."""
    from amp_common import OPTIMIZERS, batch, make_mlp

    from mixedprec import amp

    def run(name, loss_scale, larc=True):
        model = make_mlp(0)
        optimizer = OPTIMIZERS[name](model.parameters())
        if larc:
            optimizer = LARC(optimizer, trust_coefficient=0.02)
        model, returned = amp.initialize(model, optimizer, opt_level=opt_level,
                                         loss_scale=loss_scale, verbosity=0)
        assert returned is optimizer
        for step in range(3):
            optimizer.zero_grad()
            x, y = batch(step)
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
            with amp.scale_loss(loss, optimizer) as scaled:
                scaled.backward()
            optimizer.step()
        masters = [m.detach().clone() for m in amp.master_params(optimizer)]
        return [p.detach().float() for p in model.parameters()], masters

    expected = run("SGD", 1.0)
    for name in ("SGD", "FusedSGD"):
        torch.testing.assert_close(run(name, 128.0), expected, atol=1e-4, rtol=1e-3)
    plain = run("SGD", 1.0, larc=False)
    assert not torch.allclose(plain[1][0], expected[1][0], atol=1e-3)


# --- SyncBatchNorm -------------------------------------------------------------------


def test_convert_syncbn_model_replaces_batch_norms():
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
        nn.Sequential(nn.Flatten(), nn.Linear(4 * 4 * 4, 5), nn.BatchNorm1d(5, affine=False)),
    )
    model[1].running_mean.fill_(0.5)
    weight = model[1].weight

    converted = convert_syncbn_model(model, process_group=None)

    assert issubclass(SyncBatchNorm, nn.SyncBatchNorm)
    assert isinstance(converted[1], SyncBatchNorm) and not converted[1].channel_last
    assert isinstance(converted[3][2], nn.SyncBatchNorm)
    assert not converted[3][2].affine
    assert isinstance(converted[0], nn.Conv2d) and isinstance(converted[3][1], nn.Linear)
    assert converted[1].weight is weight
    assert torch.equal(converted[1].running_mean, torch.full((4,), 0.5))
    converted.eval()
    assert converted(torch.randn(2, 3, 6, 6)).shape == (2, 5)

    single = convert_syncbn_model(nn.BatchNorm1d(3), channel_last=True)
    assert isinstance(single, SyncBatchNorm) and single.channel_last


def ref_batch_norm(x, weight, bias, eps, channel_dim):
    """Training-mode batch norm over every dimension but ``channel_dim``, in float64."""
    x = x.double()
    dims = [d for d in range(x.dim()) if d != channel_dim]
    mean = x.mean(dims, keepdim=True)
    var = x.var(dims, unbiased=False, keepdim=True)
    shape = [1] * x.dim()
    shape[channel_dim] = -1
    return (x - mean) / torch.sqrt(var + eps) * weight.double().view(shape) \
        + bias.double().view(shape)


def test_sync_batch_norm_channel_last_z_and_fuse_relu():
    """Without torch.distributed initialised the statistics are the local batch's."""
    torch.manual_seed(0)
    bn = SyncBatchNorm(5, eps=1e-3, channel_last=True, fuse_relu=True)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)
    x = torch.randn(3, 4, 2, 5)  # channels last: [N, H, W, C]
    z = torch.randn(3, 4, 2, 5)
    out = bn(x, z)
    expected = torch.relu(ref_batch_norm(x, bn.weight, bn.bias, 1e-3, 3) + z.double())
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    assert (out == 0).any(), "the ReLU clamps something"
    mean = x.double().mean((0, 1, 2))
    torch.testing.assert_close(bn.running_mean.double(), 0.1 * mean, atol=1e-6, rtol=1e-6)

    # Channels first: z and fuse_relu are ignored there, as in Apex.
    first = SyncBatchNorm(4, fuse_relu=True)
    x = torch.randn(3, 4, 6)
    out = first(x, torch.full_like(x, 100.0))
    torch.testing.assert_close(
        out.double(), ref_batch_norm(x, first.weight, first.bias, 1e-5, 1), atol=1e-5, rtol=1e-5)
    assert (out < 0).any()
    # 2-D input is [N, C] either way, and z and the ReLU apply.
    flat = SyncBatchNorm(4, fuse_relu=True)
    x2 = torch.randn(8, 4)
    expected = torch.relu(ref_batch_norm(x2, flat.weight, flat.bias, 1e-5, 1) + 1.0)
    torch.testing.assert_close(flat(x2, torch.ones(8, 4)).double(), expected,
                               atol=1e-5, rtol=1e-5)


# --- flat helpers and apex_C ---------------------------------------------------------


def test_split_helpers_and_extract_tensors():
    a, b, c = torch.ones(2), torch.zeros(3, dtype=torch.float64), torch.ones(1)
    h = torch.ones(4, dtype=torch.float16)
    groups = split_by_type([a, b, c, h])
    assert list(groups) == ["torch.FloatTensor", "torch.DoubleTensor", "torch.HalfTensor"]
    assert groups["torch.FloatTensor"][0] is a and groups["torch.FloatTensor"][1] is c
    assert split_half_float_double([a, b, h]) == []  # CPU tensors: none, as in Apex
    found = []
    extract_tensors([a, (b, [c, 3, "text"]), {"not": "iterated as tensors"}, None], found)
    assert found[0] is a and found[1] is b and found[2] is c and len(found) == 3
    assert ReduceOp is dist.ReduceOp


def test_apex_c_flatten_unflatten():
    tensors = [torch.arange(6.0).view(2, 3), torch.tensor([7.0]), torch.ones(2, 1, 2)]
    flat = apex_C.flatten(tensors)
    torch.testing.assert_close(flat, torch.cat([t.reshape(-1) for t in tensors]))
    views = apex_C.unflatten(flat, tensors)
    for view, t in zip(views, tensors):
        assert view.shape == t.shape and torch.equal(view, t)
        assert view.data_ptr() >= flat.data_ptr()  # views into flat, not copies
    flat.zero_()
    assert all(not v.any() for v in views)
    with pytest.raises(TypeError, match="one dtype"):
        apex_C.flatten([torch.ones(1), torch.ones(1, dtype=torch.float64)])
    with pytest.raises(ValueError, match="elements"):
        apex_C.unflatten(torch.ones(3), tensors)
    with pytest.raises(TypeError, match="sequence of tensors"):
        apex_C.flatten(torch.ones(3))


# --- DistributedDataParallel on two gloo processes -----------------------------------

WORLD_SIZE = 2


# helpers.make_model's Sequential, drawn from torch's RNG as each rank seeded it
TINY = dict(sizes=(4, 8, 2), seed=None)


def batch(rank, step, dtype=torch.float32):
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(6, 4, generator=gen).to(dtype)


def gathered(tensor):
    out = [torch.empty_like(tensor) for _ in range(WORLD_SIZE)]
    dist.all_gather(out, tensor)
    return out


def flat_params(module):
    return torch.cat([p.detach().reshape(-1).float() for p in module.parameters()])


def local_grads(module, x):
    """Gradients of this rank's loss, without any communication."""
    module.zero_grad()
    module(x).square().sum().backward()
    return [p.grad.detach().clone() for p in module.parameters()]


def assert_grads(ddp_module, expected, **tol):
    for p, e in zip(ddp_module.parameters(), expected):
        torch.testing.assert_close(p.grad, e, **tol)


def ddp_worker(rank, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD_SIZE)
    try:
        check_ddp(rank)
        gc.collect()  # free DDP reducers while their process group exists
        dist.barrier()  # tear gloo down together (a rank leaving early can abort its peer)
    finally:
        dist.destroy_process_group()
    os._exit(0)  # skip interpreter finalisation (gloo threads can abort there); see test_ddp_amp


def check_ddp(rank):
    torch.manual_seed(rank)  # different initial weights on each rank
    apex_kwargs = dict(
        message_size=50, delay_allreduce=False, shared_param=False,
        allreduce_trigger_params=None, retain_allreduce_buffers=False,
        allreduce_always_fp32=False, num_allreduce_streams=1, allreduce_communicators=None,
        gradient_average=True, gradient_predivide_factor=1.0, prof=False,
    )
    model = make_model(**TINY)
    ddp = DistributedDataParallel(model, **apex_kwargs)
    assert isinstance(ddp, nn.parallel.DistributedDataParallel) and ddp.module is model
    assert abs(ddp.bucket_bytes_cap - 50 * 4) <= 1  # message_size elements of fp32
    first, second = gathered(flat_params(model))
    assert torch.equal(first, second), "parameters were not broadcast from rank 0"

    # Averaged gradients, and parameters that stay in sync over a few steps.
    reference = make_model(**TINY)
    reference.load_state_dict(model.state_dict())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x = batch(rank, step)
        mine = local_grads(reference, x)
        expected = [sum(gathered(g)) / WORLD_SIZE for g in mine]
        optimizer.zero_grad()
        ddp(x).square().sum().backward()
        assert_grads(ddp, expected)
        optimizer.step()
        reference.load_state_dict(model.state_dict())
        first, second = gathered(flat_params(model))
        assert torch.equal(first, second), f"parameters diverged at step {step}"

    # gradient_average=False sums; a predivide factor with averaging still averages.
    for options, divisor in [(dict(gradient_average=False), 1),
                             (dict(gradient_predivide_factor=4.0), WORLD_SIZE),
                             (dict(gradient_average=False, gradient_predivide_factor=2.0), 2)]:
        summed = DistributedDataParallel(make_model(**TINY), **options)
        reference.load_state_dict(summed.module.state_dict())
        x = batch(rank, 10)
        expected = [sum(gathered(g)) / divisor for g in local_grads(reference, x)]
        summed(x).square().sum().backward()
        assert_grads(summed, expected)

    # allreduce_always_fp32 on an fp16 model; delay_allreduce puts all in one bucket.
    half = DistributedDataParallel(make_model(dtype=torch.float16, **TINY),
                                   allreduce_always_fp32=True, delay_allreduce=True)
    total_bytes = sum(p.numel() * p.element_size() for p in half.parameters())
    assert half.bucket_bytes_cap >= total_bytes
    reference = make_model(dtype=torch.float16, **TINY)
    reference.load_state_dict(half.module.state_dict())
    x = batch(rank, 20, torch.float16)
    expected = [(sum(g.float() for g in gathered(g16)) / WORLD_SIZE).half()
                for g16 in local_grads(reference, x)]
    half(x).float().square().sum().backward()
    assert_grads(half, expected, atol=1e-3, rtol=2e-3)

    # disable_allreduce leaves gradients local until enable_allreduce.
    local = DistributedDataParallel(make_model(**TINY), bucket_cap_mb=1)
    local.disable_allreduce()
    reference = make_model(**TINY)
    reference.load_state_dict(local.module.state_dict())
    x = batch(rank, 30)
    local(x).square().sum().backward()
    assert_grads(local, local_grads(reference, x))
    local.enable_allreduce()
    assert local.require_backward_grad_sync

    # Reducer: broadcast at construction, average on reduce().
    torch.manual_seed(rank)
    module = make_model(**TINY)
    reducer = Reducer(module)
    first, second = gathered(flat_params(module))
    assert torch.equal(first, second)
    x = batch(rank, 40)
    mine = local_grads(module, x)
    reducer.reduce()
    assert_grads(module, [sum(gathered(g)) / WORLD_SIZE for g in mine])

    check_retained_buffers(rank)
    check_flat_dist_calls(rank)


def check_retained_buffers(rank):
    """retain_allreduce_buffers: .allreduce_buffers holds the reduced gradients, and
    .grad views into it."""
    torch.manual_seed(rank)
    ddp = DistributedDataParallel(make_model(**TINY), message_size=40,
                                  retain_allreduce_buffers=True)
    assert ddp.allreduce_buffers == []
    reference = make_model(**TINY)
    reference.load_state_dict(ddp.module.state_dict())
    x = batch(rank, 50)
    expected = [sum(gathered(g)) / WORLD_SIZE for g in local_grads(reference, x)]
    ddp(x).square().sum().backward()
    assert_grads(ddp, expected)
    buffers = ddp.allreduce_buffers
    assert buffers and all(b.dim() == 1 for b in buffers)
    assert sum(b.numel() for b in buffers) == sum(p.numel() for p in ddp.parameters())
    for p in ddp.parameters():
        owner = [b for b in buffers if b.untyped_storage().data_ptr()
                 == p.grad.untyped_storage().data_ptr()]
        assert len(owner) == 1, "each .grad is a view into one retained buffer"
    with pytest.raises(AttributeError, match="allreduce_buffers"):
        DistributedDataParallel(make_model(**TINY)).allreduce_buffers


def check_flat_dist_calls(rank):
    """flat_dist_call / apply_flat_dist_call: all_reduce averages per dtype; broadcast
    takes rank 0's values."""
    tensors = [torch.full((3,), float(rank + 1)), torch.full((2, 2), 10.0 * (rank + 1),
                                                             dtype=torch.float64),
               torch.full((1,), 5.0 * (rank + 1))]
    before = [t.clone() for t in tensors]
    flat_dist_call(tensors, dist.all_reduce)
    for t, b in zip(tensors, before):
        torch.testing.assert_close(t, sum(gathered(b)) / WORLD_SIZE)
    assert tensors[1].dtype == torch.float64
    tensors = [torch.full((2,), float(rank + 7)), torch.full((3,), float(rank))]
    flat_dist_call(tensors, dist.broadcast, (0,))
    assert torch.equal(tensors[0], torch.full((2,), 7.0))
    assert torch.equal(tensors[1], torch.zeros(3))
    bucket = [torch.full((2,), float(rank + 1)), torch.full((1,), 2.0)]
    apply_flat_dist_call(bucket, dist.all_reduce, (ReduceOp.MAX,))
    assert torch.equal(bucket[0], torch.full((2,), 2.0 / WORLD_SIZE))  # max, then / world
    assert torch.equal(bucket[1], torch.full((1,), 2.0 / WORLD_SIZE))


def test_distributed_data_parallel_two_processes(tmp_path):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    mp.spawn(ddp_worker, args=(str(tmp_path / "init"),), nprocs=WORLD_SIZE, join=True)


def test_apex_positional_arguments_and_unknown_keywords():
    """Apex's positional order is kept; a keyword neither Apex nor torch knows fails."""
    import inspect

    names = list(inspect.signature(DistributedDataParallel.__init__).parameters)[1:14]
    assert names == [
        "module", "message_size", "delay_allreduce", "shared_param",
        "allreduce_trigger_params", "retain_allreduce_buffers", "allreduce_always_fp32",
        "num_allreduce_streams", "allreduce_communicators", "gradient_average",
        "gradient_predivide_factor", "gradient_average_split_factor", "prof",
    ]
    with pytest.raises(TypeError):
        DistributedDataParallel(make_model(**TINY), not_an_argument=1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(message_size=-5), "expected message_size to be a number of elements >= 0"),
    (dict(message_size="big"), "expected message_size"),
    (dict(gradient_predivide_factor=0), "expected gradient_predivide_factor to be a finite "
                                        "number > 0"),
    (dict(gradient_predivide_factor=float("nan")), "expected gradient_predivide_factor")])
def test_distributed_data_parallel_refuses_bad_sizes_and_factors_first(kwargs, match):
    """Before: a negative message_size was taken, and a factor of 0 raised a bare
    ZeroDivisionError in the comm hook during backward. (Refused before torch's DDP is
    built: no process group is needed to see it.)"""
    with pytest.raises(ValueError, match=f"DistributedDataParallel: {match}"):
        DistributedDataParallel(make_model(**TINY), **kwargs)


def test_a_message_size_of_zero_reduces_each_parameter_alone():
    """Apex took message_size=0 (each parameter its own all-reduce); torch's DDP takes no
    zero bucket cap and failed with 'bucket_cap_mb should be set by now'."""
    from mixedprec.compat.parallel import _bucket_cap_mb

    cap = _bucket_cap_mb(make_model(**TINY), 0, delay_allreduce=False)
    assert 0 < cap <= 1 / 2**20
