"""mixedprec.optim.Adagrad, LAMB and NovoGrad: torch-style classes on the optimizer base.

Adagrad against torch.optim.Adagrad (its arguments, its state_dict both ways, torch's
own step for the settings the fused op does not take); fp16/bf16 parameters with fp32
masters against float64 references; LAMB and NovoGrad step for step equal to their
Apex faces (whose op tests hold the float64 references); and what every mixedprec.optim
class shares: a GradScaler's skip, unscaled gradients after the step, bad input that
changes nothing, state dicts that round-trip."""

import copy

import pytest
import torch
from helpers import assert_bitwise_equal, assert_unchanged, make_model, snapshot

import mixedprec
from mixedprec import optim

BF16, F16 = torch.bfloat16, torch.float16
SIZES = (12, 16, 10)


def model(dtype=torch.float32, seed=0):
    return make_model(dtype=dtype, seed=seed, sizes=SIZES)


def train(model_, opt, steps, *, seed=0, scaler=None, first=0):
    gen = torch.Generator().manual_seed(seed)
    for step in range(first, first + steps):
        x = torch.randn(8, SIZES[0], generator=gen).to(next(model_.parameters()).dtype)
        opt.zero_grad()
        loss = model_(x).float().square().mean()
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()


def params_of(model_):
    return [p.detach().clone() for p in model_.parameters()]


# --- Adagrad against torch.optim.Adagrad ------------------------------------------------

ADAGRAD = [
    dict(lr=0.1),
    dict(lr=0.05, weight_decay=0.1),
    dict(lr=0.05, initial_accumulator_value=0.3, eps=1e-6),
    dict(lr=0.05, lr_decay=0.01),  # torch's own step (the op has no lr_decay)
    dict(lr=0.05, maximize=True),  # torch's own step
]


@pytest.mark.parametrize("kwargs", ADAGRAD, ids=lambda k: "-".join(k))
def test_adagrad_steps_as_torch_on_fp32(kwargs):
    ours, theirs = model(), model()
    opt = optim.Adagrad(ours.parameters(), **kwargs)
    ref = torch.optim.Adagrad(theirs.parameters(), foreach=False, **kwargs)
    train(ours, opt, 5)
    train(theirs, ref, 5)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)
    for p, q in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(opt.state[p]["sum"], ref.state[q]["sum"], rtol=2e-6,
                                   atol=1e-8)
        assert float(opt.state[p]["step"]) == float(ref.state[q]["step"]) == 5


def test_adagrad_state_dict_loads_both_ways_with_torch():
    ours, theirs = model(), model()
    opt = optim.Adagrad(ours.parameters(), lr=0.1, weight_decay=0.01)
    ref = torch.optim.Adagrad(theirs.parameters(), lr=0.1, weight_decay=0.01)
    train(ours, opt, 3)
    train(theirs, ref, 3)
    # ours -> torch: torch continues from our state as from its own
    again = model()
    again.load_state_dict(ours.state_dict())
    into_torch = torch.optim.Adagrad(again.parameters())
    into_torch.load_state_dict(copy.deepcopy(opt.state_dict()))  # (as saved and loaded)
    train(again, into_torch, 2, first=3, seed=1)
    train(ours, opt, 2, first=3, seed=1)
    for a, b in zip(again.parameters(), ours.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)
    # torch -> ours
    mine = model()
    mine.load_state_dict(theirs.state_dict())
    into_ours = optim.Adagrad(mine.parameters())
    into_ours.load_state_dict(copy.deepcopy(ref.state_dict()))
    train(mine, into_ours, 2, first=3, seed=1)
    train(theirs, ref, 2, first=3, seed=1)
    for a, b in zip(mine.parameters(), theirs.parameters()):
        torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)


def test_adagrad_loads_torchs_bf16_sums_widened():
    """torch's Adagrad keeps a bf16 model's sums in bf16; ours keeps float32 ones and
    loads torch's widened, exactly."""
    theirs = model().bfloat16()
    ref = torch.optim.Adagrad(theirs.parameters(), lr=0.1)
    train(theirs, ref, 2)
    saved = ref.state_dict()
    ours = copy.deepcopy(theirs)
    opt = optim.Adagrad(ours.parameters(), lr=0.1)
    opt.load_state_dict(saved)
    for i, p in enumerate(ours.parameters()):
        assert saved["state"][i]["sum"].dtype == torch.bfloat16
        assert opt.state[p]["sum"].dtype == torch.float32
        assert torch.equal(opt.state[p]["sum"], saved["state"][i]["sum"].float())
    train(ours, opt, 1, first=2)


def _adagrad64(p, grads, lr, eps, weight_decay, decoupled):
    """Adagrad in float64 from fp32 values ``p`` over the gradients of each step."""
    p, total = p.double(), torch.zeros_like(p, dtype=torch.float64)
    for g in grads:
        g = g.double()
        if weight_decay and not decoupled:
            g = g + weight_decay * p
        total += g * g
        update = g / (total.sqrt() + eps)
        if weight_decay and decoupled:
            update = update + weight_decay * p
        p = p - lr * update
    return p


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("decoupled", [False, True], ids=["l2", "decoupled"])
def test_adagrad_fp32_masters_track_float64(dtype, decoupled):
    gen = torch.Generator().manual_seed(3)
    start = torch.randn(300, generator=gen)
    p = start.to(dtype).requires_grad_()
    opt = optim.Adagrad([p], lr=0.03, weight_decay=0.05, decoupled_weight_decay=decoupled)
    grads = [torch.randn(300, generator=gen).to(dtype) for _ in range(6)]
    for g in grads:
        p.grad = g.clone()
        opt.step()
    want = _adagrad64(start.to(dtype).float(), grads, 0.03, 1e-10, 0.05, decoupled)
    master = opt.state[p]["master_param"]
    assert master.dtype == torch.float32
    torch.testing.assert_close(master.double(), want, rtol=1e-5, atol=1e-6)
    assert_bitwise_equal(p.detach(), master.to(dtype))


@pytest.mark.parametrize("kwargs", [dict(lr_decay=0.1), dict(maximize=True)],
                         ids=["lr_decay", "maximize"])
def test_adagrad_torch_path_steps_the_fp32_masters(kwargs):
    """What the fused op does not take goes through torch's step, on the masters."""
    gen = torch.Generator().manual_seed(5)
    start = torch.randn(64, generator=gen)
    p = start.to(BF16).requires_grad_()
    ref = start.to(BF16).float().requires_grad_()
    opt = optim.Adagrad([p], lr=0.05, **kwargs)
    torch_opt = torch.optim.Adagrad([ref], lr=0.05, foreach=False, **kwargs)
    for _ in range(4):
        g = torch.randn(64, generator=gen).to(BF16)
        p.grad, ref.grad = g.clone(), g.float()
        opt.step()
        torch_opt.step()
    master = opt.state[p]["master_param"]
    assert_bitwise_equal(master, ref.detach())
    assert_bitwise_equal(p.detach(), ref.detach().to(BF16))


def test_adagrad_keeps_the_fp32_masters_of_strided_parameters():
    """Adagrad's torch step keeps fp32 masters (above): a bf16 parameter the fused ops do
    not take (every other column of a larger tensor) gets them under master="fp32"."""
    base = torch.randn(6, 10).to(BF16)
    p = torch.nn.Parameter(base[:, ::2])
    ref = torch.nn.Parameter(p.detach().float())
    opt = optim.Adagrad([p], lr=0.05)
    torch_opt = torch.optim.Adagrad([ref], lr=0.05, foreach=False)
    for step in range(3):
        g = torch.randn(6, 5, generator=torch.Generator().manual_seed(step)).to(BF16)
        p.grad, ref.grad = g.clone(), g.float()
        opt.step()
        torch_opt.step()
    assert_bitwise_equal(opt.state[p]["master_param"], ref.detach())
    assert_bitwise_equal(p.detach(), ref.detach().to(BF16))


def test_adagrad_refuses_the_fp32_masters_of_a_sparse_gradients_parameter():
    """Adagrad's torch step applies a sparse gradient to the parameter itself (torch's
    functional Adagrad, no master): a bf16 parameter with one is refused at the step
    under master="fp32", nothing changed; master="none" steps it as torch does."""
    p = torch.nn.Parameter(torch.randn(6, 4).to(BF16))
    opt = optim.Adagrad([p], lr=0.1)
    p.grad = torch.ones(6, 4, dtype=BF16).to_sparse()
    before = snapshot((p, opt))
    with pytest.raises(TypeError, match=r"^Adagrad.step: a torch.bfloat16 parameter of shape "
                                         r"\(6, 4\) has a sparse gradient, .* not "
                                         r"master='fp32' \(use master='none' and "
                                         r"state_dtype=torch.bfloat16\)$"):
        opt.step()
    assert_unchanged((p, opt), before)
    ref = torch.nn.Parameter(p.detach().clone())
    ref.grad = p.grad.clone()
    optim.Adagrad([p], lr=0.1, master="none").step()
    torch.optim.Adagrad([ref], lr=0.1).step()
    assert_bitwise_equal(p.detach(), ref.detach())


@pytest.mark.parametrize("cls", [optim.LAMB, optim.NovoGrad], ids=["LAMB", "NovoGrad"])
def test_what_the_fused_ops_do_not_take_is_refused_before_any_update(cls):
    """LAMB and NovoGrad have no torch.optim step to hand such parameters to: a float64
    one and one that is not dense are refused at construction, a sparse gradient in the
    step, before any parameter or state changed (it failed after the fused update)."""
    name = cls.__name__
    with pytest.raises(TypeError, match=f"^{name}: a torch.float64 parameter of shape \\(3,\\) "
                                        "has a dtype that the fused ops do not take, so it "
                                        "needs torch.optim's implementation of the step, "
                                        "which it has not$"):
        cls([torch.nn.Parameter(torch.randn(3, dtype=torch.float64))])
    with pytest.raises(ValueError, match=f"^{name}: a torch.float32 parameter of shape "
                                         "\\(6, 5\\) is not dense .* which it has not "
                                         "\\(make it contiguous\\)$"):
        cls([torch.nn.Parameter(torch.randn(6, 10)[:, ::2])])
    net = model()
    opt = cls(net.parameters(), lr=0.01)
    train(net, opt, 1)
    before = snapshot((net, opt))
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    net[-1].bias.grad = net[-1].bias.grad.to_sparse()
    with pytest.raises(TypeError, match=f"^{name}.step: .* has a sparse gradient"):
        opt.step()
    assert_unchanged((net, opt), before)


# --- LAMB and NovoGrad: the Apex faces' math under torch-style names --------------------

@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("decoupled", [True, False], ids=["decoupled", "l2"])
def test_lamb_equals_its_apex_face(dtype, decoupled):
    a, b = model(dtype), model(dtype)
    ours = optim.LAMB(a.parameters(), lr=0.02, weight_decay=0.05, max_grad_norm=0.5,
                      decoupled_weight_decay=decoupled, unscale_grads=False)
    face = mixedprec.FusedLAMB(b.parameters(), lr=0.02, weight_decay=0.05, max_grad_norm=0.5,
                               adam_w_mode=decoupled, master_weights=True)
    train(a, ours, 4)
    train(b, face, 4)
    for x, y in zip(a.parameters(), b.parameters()):
        assert_bitwise_equal(x.detach(), y.detach())


@pytest.mark.parametrize("norm_type", [0, 2])
@pytest.mark.parametrize("reg_inside_moment", [False, True], ids=["step", "moment"])
def test_novograd_equals_its_apex_face(norm_type, reg_inside_moment):
    a, b = model(BF16), model(BF16)
    ours = optim.NovoGrad(a.parameters(), lr=0.02, weight_decay=0.01, norm_type=norm_type,
                          reg_inside_moment=reg_inside_moment, unscale_grads=False)
    face = mixedprec.FusedNovoGrad(b.parameters(), lr=0.02, weight_decay=0.01,
                                   norm_type=norm_type, reg_inside_moment=reg_inside_moment,
                                   master_weights=True)
    train(a, ours, 4)
    train(b, face, 4)
    for x, y in zip(a.parameters(), b.parameters()):
        assert_bitwise_equal(x.detach(), y.detach())
    assert face.moment_mode == (0 if reg_inside_moment else 1)


def test_apex_face_state_dicts_of_earlier_releases_load():
    """A FusedLAMB state dict with Apex's adam_w_mode key, and a FusedNovoGrad or
    FusedAdagrad one without the keys the core added, load into today's faces."""
    for make, apex_key in ((lambda m: mixedprec.FusedLAMB(m.parameters(), adam_w_mode=False),
                            ("adam_w_mode", "decoupled_weight_decay")),
                           (lambda m: mixedprec.FusedNovoGrad(m.parameters()), None),
                           (lambda m: mixedprec.FusedAdagrad(m.parameters()), None)):
        m = model()
        opt = make(m)
        train(m, opt, 2)
        saved = opt.state_dict()
        for group in saved["param_groups"]:
            for key in ("reg_inside_moment", "lr_decay", "initial_accumulator_value",
                        "foreach", "maximize", "differentiable", "fused",
                        "decoupled_weight_decay"):
                value = group.pop(key, None)
                if apex_key and key == apex_key[1]:
                    group[apex_key[0]] = value
        fresh = make(m)
        fresh.load_state_dict(saved)

        def plain(groups):
            return [{k: v.tolist() if isinstance(v, torch.Tensor) else v
                     for k, v in g.items()} for g in groups]
        assert plain(fresh.state_dict()["param_groups"]) == \
            plain(opt.state_dict()["param_groups"])


# --- what every mixedprec.optim class shares --------------------------------------------

CLASSES = {
    "Adagrad": lambda ps, **kw: optim.Adagrad(ps, lr=0.05, **kw),
    "LAMB": lambda ps, **kw: optim.LAMB(ps, lr=0.02, **kw),
    "NovoGrad": lambda ps, **kw: optim.NovoGrad(ps, lr=0.02, **kw),
}


@pytest.mark.parametrize("name", list(CLASSES))
def test_a_scaler_skip_changes_nothing_and_grads_come_back_unscaled(name):
    m = model(BF16)
    opt = CLASSES[name](m.parameters())
    train(m, opt, 2)
    before = snapshot((list(m.parameters()), opt.state_dict()))
    scaler = mixedprec.GradScaler("cpu", init_scale=2.0**10)
    opt.zero_grad()
    loss = m(torch.randn(4, SIZES[0]).to(BF16)).float().sum() * float("inf")
    scaler.scale(loss).backward()
    scaler.step(opt)
    assert_unchanged((list(m.parameters()), opt.state_dict()), before)
    assert int(opt.applied_steps) == 2
    scaler.update()
    # a clean step: p.grad holds the unscaled gradient afterwards, as torch's fused
    # optimizers leave it
    opt.zero_grad()
    x = torch.randn(4, SIZES[0]).to(BF16)
    m(x).float().sum().backward()
    unscaled = [p.grad.clone() for p in m.parameters()]
    opt.zero_grad()
    scaler.scale(m(x).float().sum()).backward()
    scaler.step(opt)
    for p, g in zip(m.parameters(), unscaled):
        torch.testing.assert_close(p.grad, g, rtol=1e-2, atol=1e-3)
    assert int(opt.applied_steps) == 3


@pytest.mark.parametrize("name", list(CLASSES))
def test_state_dict_round_trips(name):
    a = model(BF16)
    opt = CLASSES[name](a.parameters())
    train(a, opt, 3)
    b = model(BF16)
    b.load_state_dict(a.state_dict())
    other = CLASSES[name](b.parameters())
    other.load_state_dict(opt.state_dict())
    train(a, opt, 2, first=3, seed=4)
    train(b, other, 2, first=3, seed=4)
    for x, y in zip(a.parameters(), b.parameters()):
        assert_bitwise_equal(x.detach(), y.detach())


@pytest.mark.parametrize("name", list(CLASSES))
@pytest.mark.parametrize("kwargs, error, match", [
    (dict(master="kahan"), TypeError, "take mixedprec.optim.Adam, AdamW or SGD"),
    (dict(state_dtype=BF16), TypeError, "take mixedprec.optim.Adam, AdamW or SGD"),
    (dict(master="half"), ValueError, "expected master to be one of"),
    (dict(unscale_grads=1), TypeError, "unscale_grads"),
], ids=["kahan", "bf16-state", "bad-master", "unscale-grads"])
def test_bad_settings_are_refused_by_name(name, kwargs, error, match):
    with pytest.raises(error, match=match):
        CLASSES[name](model().parameters(), **kwargs)


@pytest.mark.parametrize("name, kwargs, match", [
    ("LAMB", dict(betas=(1.0, 0.9)), "betas"),
    ("LAMB", dict(max_grad_norm=-1.0), "max_grad_norm"),
    ("NovoGrad", dict(norm_type=1), "norm_type"),
    ("NovoGrad", dict(eps=-1.0), "eps"),
    ("Adagrad", dict(lr_decay=-1.0), "lr_decay"),
])
def test_bad_hyperparameters_are_refused_by_name(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        CLASSES[name](model().parameters(), **kwargs)


@pytest.mark.parametrize("name", list(CLASSES))
def test_a_bad_group_set_by_hand_raises_before_any_update(name):
    m = model()
    opt = CLASSES[name](m.parameters())
    train(m, opt, 1)
    opt.param_groups[0]["eps"] = -1.0
    before = snapshot((list(m.parameters()), opt.state_dict()))
    m(torch.randn(2, SIZES[0])).sum().backward()
    with pytest.raises(ValueError, match="param group 0.*eps"):
        opt.step()
    assert_unchanged((list(m.parameters()), opt.state_dict()), before)


def test_configure_sets_the_precision_before_the_first_step():
    m = model(BF16)
    opt = optim.AdamW(m.parameters(), master="none")
    opt.configure(master="remainder", state_dtype=BF16)
    assert (opt.master, opt.state_dtype) == ("remainder", BF16)
    train(m, opt, 1)
    assert {"remainder", "exp_avg"} <= set(opt.state[m[0].weight])
    with pytest.raises(ValueError, match="has not stepped"):
        opt.configure(master="kahan")
    opt.configure(master="remainder", check_only=True)  # (unchanged: fine)
    with pytest.raises(TypeError, match="take mixedprec.optim.Adam"):
        optim.LAMB(m.parameters()).configure(master="stochastic")
