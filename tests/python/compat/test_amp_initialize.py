"""amp.initialize's models and optimizers against Apex's: lists of them, the user's own
model returned (the forward patch around its original forward, deep copies), optimizers
passed twice or built on another model, wrapped models, the option overrides accepted
and rejected (a rejection changes nothing), and enabled=False.

Every test runs on the CPU; those taking the ``device`` fixture have a CUDA twin that
skips on a machine without a GPU."""

import copy
import io
import types
import warnings

import pytest
import torch
from amp_common import (
    MLP,
    assert_identical,
    assert_untouched,
    fresh,
    make_mlp,
    scaler_state,
    train_step,
)
from torch import nn

import mixedprec
from mixedprec import amp

pytestmark = pytest.mark.usefixtures("one_thread", "forget_pending_registrations")


# --- lists of models and optimizers ----------------------------------------------------------

def test_initialize_lists_of_models_and_optimizers():
    m1, m2 = make_mlp(0), make_mlp(1)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    o2 = mixedprec.FusedAdam(m2.parameters())
    models, opts = amp.initialize([m1, m2], [o1, o2], opt_level="O2", verbosity=0)
    assert isinstance(models, list) and models[0] is m1 and models[1] is m2
    assert opts == [o1, o2]
    assert m1.fc1.weight.dtype == m2.fc1.weight.dtype == torch.float16
    alone = make_mlp(2)
    assert amp.initialize(alone, opt_level="O2", verbosity=0) is alone


# --- initialize returns the user's own models (the forward patch) -------------------------

@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_initialize_returns_the_users_model(level):
    module = make_mlp(0)
    keys, names = list(module.state_dict()), [n for n, _ in module.named_parameters()]
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    model, opt = amp.initialize(module, opt, opt_level=level, verbosity=0)
    assert model is module and isinstance(model, MLP)
    assert list(model.state_dict()) == keys
    assert [n for n, _ in model.named_parameters()] == names
    assert model.tag == "mlp" and model.describe() == "mlp:8->1"
    # A checkpoint of the model loads into a plain module and back.
    plain = make_mlp(5)
    plain.load_state_dict({k: v.float() if v.is_floating_point() else v
                           for k, v in model.state_dict().items()})
    other = amp.initialize(make_mlp(7), opt_level=level, verbosity=0)
    other.load_state_dict(model.state_dict())
    assert_identical(other.state_dict(), model.state_dict())
    train_step(model, opt, 0)


def test_initialize_returns_the_users_sequential():
    seq = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    names = [n for n, _ in seq.named_parameters()]
    first, last = seq[0], seq[2]
    model = amp.initialize(seq, opt_level="O2", verbosity=0)
    assert model is seq and isinstance(model, nn.Sequential)
    assert model[0] is first and model[-1] is last and len(model) == 3
    assert list(model) == [first, seq[1], last]
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == ["0.weight", "0.bias", "2.weight", "2.bias"]
    out = model(torch.randn(2, 4))  # fp32 input cast to fp16, output cast back
    assert out.dtype == torch.float32 and model[0].weight.dtype == torch.float16


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_forward_patch_is_an_instance_attribute_around_the_original(level):
    calls = []

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            """Net's forward."""
            calls.append((x.dtype, torch.is_autocast_enabled("cpu")))
            return self.lin(x)

    net = Net()
    amp.initialize(net, opt_level=level, verbosity=0)
    assert "forward" in vars(net) and Net.forward.__doc__ == net.forward.__doc__
    assert net.forward.__name__ == "forward"
    # A second initialize replaces the wrapper: the original runs once, cast once.
    amp.initialize(net, opt_level=level, verbosity=0)
    assert net.forward.original.__func__ is Net.forward
    out = net(torch.randn(2, 4))
    expected = (torch.float32, True) if level == "O1" else (torch.float16, False)
    assert calls == [expected] and out.dtype == torch.float32
    # O0 afterwards removes the casts altogether.
    amp.initialize(net, opt_level="O0", verbosity=0)
    assert "forward" not in vars(net)
    calls.clear()
    assert net(torch.randn(2, 4)).dtype == torch.float32 and calls == [(torch.float32, False)]


def test_deepcopy_of_an_initialized_model_runs_the_copy():
    """An EMA copy made after initialize must run its own weights, not the original's."""
    model = amp.initialize(make_mlp(0), opt_level="O2", verbosity=0)
    model.eval()
    ema = copy.deepcopy(model)
    assert ema.forward.original.__self__ is ema and ema.forward.module is ema
    with torch.no_grad():
        for p in ema.parameters():
            p.zero_()
    x = torch.randn(3, 8)
    assert torch.equal(ema(x), torch.zeros(3, 1)) and not torch.equal(model(x), ema(x))
    # So does a whole-model checkpoint.
    buffer = io.BytesIO()
    torch.save(ema, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded.forward.original.__self__ is loaded and torch.equal(loaded(x), ema(x))


# --- bad input ---------------------------------------------------------------------------------

def test_optimizer_passed_twice_is_rejected():
    m1 = make_mlp(0)
    opt = torch.optim.SGD(m1.parameters(), lr=0.1)
    amp.initialize(m1, opt, opt_level="O2", verbosity=0)
    m2 = make_mlp(1)
    before = [p.detach().clone() for p in m2.parameters()]
    with pytest.raises(ValueError, match="already passed to amp.initialize"):
        amp.initialize(m2, opt, opt_level="O2", verbosity=0)
    assert all(p.dtype == torch.float32 for p in m2.parameters())
    assert all(torch.equal(p, b) for p, b in zip(m2.parameters(), before))

    model, opt, before = fresh()
    with pytest.raises(ValueError, match="listed twice"):
        amp.initialize(model, [opt, opt], opt_level="O2", verbosity=0)
    assert_untouched(model, opt, before)


@pytest.mark.parametrize("level", ["O1", "O2", "O3"])
def test_optimizer_of_another_model_is_rejected_before_any_cast(level):
    """An optimizer built on another instance (or a copy) of the model: Apex cast the
    model and returned, and the model never learned. A ValueError naming the optimizer,
    nothing cast, the registry and both objects as they were."""
    model, _, before = fresh()
    other = make_mlp(0)
    foreign = torch.optim.SGD(other.parameters(), lr=0.1)
    mine = torch.optim.SGD(model.parameters(), lr=0.1)
    functions = types.SimpleNamespace(add=lambda a, b: a + b)
    original = functions.add
    amp.register_half_function(functions, "add")  # pending: applied by an O1 initialize
    with pytest.raises(ValueError, match=r"optimizers\[1\] \(SGD\) to hold parameters "
                                         r"of the models given"):
        amp.initialize(model, [mine, foreign], opt_level=level, verbosity=0)
    assert functions.add is original and len(amp._registered_casts) == 1
    assert all(p.dtype == torch.float32 for p in other.parameters())
    assert [p for g in foreign.param_groups for p in g["params"]] == list(other.parameters())
    assert foreign not in amp._optimizer_amp and mine not in amp._optimizer_amp
    amp._registered_casts.clear()
    assert_untouched(model, mine, before)


def test_optimizer_with_the_models_and_extra_parameters_is_accepted():
    """A subset of the model's parameters (frozen layers) or some of its own beside
    them (a learnable loss temperature) is still the model's optimizer."""
    model = make_mlp(0)
    temperature = nn.Parameter(torch.ones(()))
    opt = torch.optim.SGD([{"params": model.fc1.parameters()}, {"params": [temperature]}],
                          lr=0.1)
    amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert model.fc1.weight.dtype == torch.float16 and temperature.dtype == torch.float32
    assert opt.param_groups[1]["params"] == [temperature]


def test_ddp_wrapped_model_is_rejected(tmp_path):
    dist = torch.distributed
    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("torch.distributed with gloo is not available")
    model, opt, before = fresh()
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        ddp = nn.parallel.DistributedDataParallel(model)
        with pytest.raises(ValueError, match="DistributedDataParallel"):
            amp.initialize(ddp, opt, opt_level="O2", verbosity=0)
    finally:
        dist.destroy_process_group()
    assert_untouched(model, opt, before)


def test_data_parallel_model_is_rejected():
    model, opt, _ = fresh()
    wrapped = nn.DataParallel(model)  # with one GPU, this moves the model onto it
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match="DataParallel"):
        amp.initialize(wrapped, opt, opt_level="O2", verbosity=0)
    assert_untouched(model, opt, before)


@pytest.mark.parametrize("kwargs,match", [
    (dict(opt_level="01"), "opt_level"),
    (dict(opt_level="o2"), "opt_level"),
    (dict(opt_level="O1", cast_model_type=torch.float16), "cast_model_type"),
    (dict(opt_level="O1", keep_batchnorm_fp32=True), "keep_batchnorm_fp32"),
    (dict(opt_level="O1", keep_batchnorm_fp32="False"), "keep_batchnorm_fp32"),
    (dict(opt_level="O1", master_weights=True), "master_weights"),
    (dict(opt_level="O2", patch_torch_functions=True), "patch_torch_functions"),
    (dict(opt_level="O3", patch_torch_functions="True"), "patch_torch_functions"),
    (dict(opt_level="O2", keep_batchnorm_fp32="yes"), "keep_batchnorm_fp32"),
    (dict(opt_level="O2", loss_scale="huge"), "loss_scale"),
    (dict(opt_level="O2", loss_scale=0), "loss_scale"),
    (dict(opt_level="O2", cast_model_type=torch.int8), "cast_model_type"),
    (dict(opt_level="O2", cast_model_outputs=torch.int32), "cast_model_outputs"),
    (dict(opt_level="O2", num_losses=0), "num_losses"),
    (dict(opt_level="O2", loss_scale=float("inf")), "loss_scale"),
    (dict(opt_level="O2", loss_scale=float("nan")), "loss_scale"),
    (dict(opt_level="O2", loss_scale="-8"), "loss_scale"),
    (dict(opt_level="O2", min_loss_scale=float("nan")), "min_loss_scale"),
    (dict(opt_level="O2", min_loss_scale=0.0), "min_loss_scale"),
    (dict(opt_level="O2", min_loss_scale=-1.0), "min_loss_scale"),
    (dict(opt_level="O2", max_loss_scale=float("nan")), "max_loss_scale"),
    (dict(opt_level="O2", max_loss_scale=0.0), "max_loss_scale"),
    (dict(opt_level="O2", min_loss_scale=2.0**10, max_loss_scale=2.0**8),
     "min_loss_scale <= max_loss_scale"),
])
def test_rejected_options_change_nothing(kwargs, match):
    model, opt, before = fresh()
    with pytest.raises(ValueError, match=match) as info:
        amp.initialize(model, opt, verbosity=0, **kwargs)
    if "opt_level" in match:
        assert "'O0'" in str(info.value) and repr(kwargs["opt_level"]) in str(info.value)
    assert_untouched(model, opt, before)


@pytest.mark.parametrize("kwargs,check", [
    (dict(opt_level="O2", master_weights="False"),
     lambda model, opt: all(m is p for m, p in zip(amp.master_params(opt), model.parameters()))),
    (dict(opt_level="O2", master_weights="True"),
     lambda model, opt: all(m.dtype == torch.float32 for m in amp.master_params(opt))),
    (dict(opt_level="O2", loss_scale="128.0"),
     lambda model, opt: scaler_state() == (128.0, 0)),
    (dict(opt_level="O3", loss_scale="dynamic"),
     lambda model, opt: scaler_state() == (2.0**16, 0)),
    (dict(opt_level="O2", patch_torch_functions="False"),
     lambda model, opt: model.fc1.weight.dtype == torch.float16),
    (dict(opt_level="O2", keep_batchnorm_fp32="True"),
     lambda model, opt: model.bn.weight.dtype == torch.float32),
])
def test_string_overrides_are_accepted(kwargs, check):
    model = make_mlp(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp_model, opt = amp.initialize(model, opt, verbosity=0, **kwargs)
    assert check(model, opt)
    train_step(amp_model, opt, 0)


@pytest.mark.parametrize("bad", ["sgd", [object()], {"lr": 0.1}])
def test_non_optimizer_is_a_type_error(bad):
    model, opt, before = fresh()
    with pytest.raises(TypeError, match="Optimizer"):
        amp.initialize(model, bad, opt_level="O2", verbosity=0)
    with pytest.raises(TypeError, match="Optimizer"):
        amp.initialize(model, [opt, bad], opt_level="O2", verbosity=0)
    with pytest.raises(TypeError, match="nn.Module"):
        amp.initialize(object(), opt, opt_level="O2", verbosity=0)
    assert_untouched(model, opt, before)


# --- enabled=False -----------------------------------------------------------------------------

def check_disabled(model, opt, before):
    out_model, out_opt = amp.initialize(model, opt, enabled=False, opt_level="O2")
    assert out_model is model and out_opt is opt
    assert amp.initialize(model, enabled=False, opt_level="O2") is model
    models, opts = [model], [opt]
    got_models, got_opts = amp.initialize(models, opts, enabled=False, opt_level="O3")
    assert got_models is models and got_opts is opts
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    loss = model(torch.randn(4, 8)).float().mean()
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled is loss
        scaled.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    assert all(torch.allclose(p, b - 0.1 * g) for p, b, g in zip(model.parameters(), before, grads))


def test_enabled_false_returns_inputs_unchanged(monkeypatch):
    monkeypatch.setattr(amp, "_current", None)  # as in a process that never enabled amp
    check_disabled(*fresh())


def test_enabled_false_after_an_enabled_initialize():
    """A disabled initialize after an enabled one (e.g. a second training run in the
    same process): the disabled optimizer's scale_loss still yields the loss itself."""
    first = make_mlp(1)
    amp.initialize(first, torch.optim.SGD(first.parameters(), lr=0.1), opt_level="O1",
                   verbosity=0)
    check_disabled(*fresh())


@pytest.mark.parametrize("opt_level, half, warns", [
    ("O1", None, True), ("O2", None, True), ("O0", None, False), ("O2", "bfloat16", False)])
def test_float16_on_the_cpu_warns_once_naming_bfloat16(opt_level, half, warns, monkeypatch):
    """float16 on CPU parameters takes PyTorch's slow float16 kernels: one warning a
    process that names the bfloat16 switch; none at O0 or in bfloat16."""
    from mixedprec.compat import amp as face

    if half is not None:
        monkeypatch.setenv("MIXEDPREC_HALF_DTYPE", half)
    monkeypatch.setattr(face, "_warned_fp16_on_cpu", False)
    for attempt in range(2):
        model = make_mlp(attempt)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            amp.initialize(model, opt, opt_level=opt_level, verbosity=0)
        said = [w for w in caught if "float16 on the CPU" in str(w.message)]
        assert len(said) == (1 if warns and attempt == 0 else 0), attempt
        if said:
            assert "--half-dtype bfloat16" in str(said[0].message)
            assert said[0].filename == __file__
