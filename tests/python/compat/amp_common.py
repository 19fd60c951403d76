"""What the tests of mixedprec.amp (compat/test_amp*.py) share: their optimizers and opt
levels, the MLP (with a BatchNorm) and its batches, a training step through scale_loss,
the loss scalers' state, and snapshots compared bit for bit. Their fixtures are in this
folder's conftest.py."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixedprec
from mixedprec import amp

HALF_DTYPES = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]
# (opt_level, the model's reduced precision type); O0 has none.
LEVELS = [
    pytest.param("O0", torch.float32, id="O0"),
    pytest.param("O1", torch.float16, id="O1-fp16"),
    pytest.param("O1", torch.bfloat16, id="O1-bf16"),
    pytest.param("O2", torch.float16, id="O2-fp16"),
    pytest.param("O2", torch.bfloat16, id="O2-bf16"),
    pytest.param("O3", torch.float16, id="O3-fp16"),
    pytest.param("O3", torch.bfloat16, id="O3-bf16"),
]

OPTIMIZERS = {
    "SGD": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "Adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "FusedSGD": lambda params: mixedprec.FusedSGD(params, lr=0.05, momentum=0.9),
    "FusedAdam": lambda params: mixedprec.FusedAdam(params, lr=1e-2, adam_w_mode=False),
}
OPT_NAMES = list(OPTIMIZERS)
FUSED = ("FusedSGD", "FusedAdam")


class MLP(nn.Module):
    def __init__(self, d_in=8, hidden=32, d_out=1):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.fc2 = nn.Linear(hidden, d_out)
        self.tag = "mlp"

    def forward(self, x):
        return self.fc2(torch.relu(self.bn(self.fc1(x))))

    def describe(self):
        return f"{self.tag}:{self.fc1.in_features}->{self.fc2.out_features}"


def make_mlp(seed, device="cpu", **kwargs):
    """An MLP with BatchNorm whose initial weights depend only on `seed`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = MLP(**kwargs)
    return model.to(device)


def level_kwargs(level, half, **extra):
    kwargs = dict(opt_level=level, verbosity=0)
    kwargs.update(extra)
    if half is torch.bfloat16:
        kwargs["cast_model_type"] = torch.bfloat16
    return kwargs


def setup(level, half, opt_name, device, seed=0, **extra):
    """A fresh MLP and optimizer through amp.initialize; also the fp32 weights before."""
    model = make_mlp(seed, device)
    before = [p.detach().clone() for p in model.parameters()]
    opt = OPTIMIZERS[opt_name](model.parameters())
    amp_model, opt = amp.initialize(model, opt, **level_kwargs(level, half, **extra))
    return amp_model, opt, before


def batch(step, device="cpu", n=16, d_in=8):
    """Synthetic regression data, a function of `step` only."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(n, d_in, generator=gen)
    y = 0.5 * x[:, :1] - torch.sin(2 * x[:, 1:2]) + 0.3 * x[:, 2:3] * x[:, 3:4]
    return x.to(device), y.to(device)


def poison(model):
    """Puts an inf into the first gradient (as an overflowing backward would)."""
    for p in model.parameters():
        if p.grad is not None:
            p.grad.view(-1)[:1].fill_(float("inf"))  # (no tensor from host data)
            return
    raise AssertionError("no gradient to poison")


def train_step(model, opt, step, device="cpu", overflow=False, **scale_kwargs):
    opt.zero_grad()
    x, y = batch(step, device)
    loss = F.mse_loss(model(x).float(), y)
    with amp.scale_loss(loss, opt, **scale_kwargs) as scaled:
        scaled.backward()
        if overflow:
            poison(model)
    opt.step()
    return loss.detach()


def loss_scale(loss_id=0):
    return amp.state_dict()[f"loss_scaler{loss_id}"]["loss_scale"]


def scaler_state(loss_id=0):
    sd = amp.state_dict()[f"loss_scaler{loss_id}"]
    return sd["loss_scale"], sd["unskipped"]


def clone_tree(value):
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: clone_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(clone_tree(v) for v in value)
    return copy.deepcopy(value)


def assert_identical(a, b, path="value"):
    """Same structure, and tensors equal bit for bit (NaNs included)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: tensor vs {type(b)}"
        assert a.dtype == b.dtype and a.shape == b.shape, \
            f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        bits_a = a.detach().cpu().reshape(-1).contiguous().view(torch.uint8)
        bits_b = b.detach().cpu().reshape(-1).contiguous().view(torch.uint8)
        assert torch.equal(bits_a, bits_b), f"{path} differs:\n{a}\n{b}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), f"{path}: keys {set(a)} vs {set(b)}"
        for k in a:
            assert_identical(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{path}: length differs"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_identical(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def snapshot(model, opt, buffers=False):
    """What a step may change: the model's parameters (and its buffers, which a forward
    pass changes too, when `buffers`), the masters and the optimizer state."""
    weights = model.state_dict() if buffers else dict(model.named_parameters())
    return dict(model=clone_tree(weights),
                masters=[m.detach().clone() for m in amp.master_params(opt)],
                optimizer=clone_tree(opt.state_dict()))


def assert_untouched(model, opt, before):
    """Nothing was cast or registered: the optimizer can still be initialized."""
    assert "forward" not in vars(model)  # not patched
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert [p for g in opt.param_groups for p in g["params"]] == list(model.parameters())
    amp_model, _ = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    assert model.fc1.weight.dtype == torch.float16


def fresh():
    model = make_mlp(0)
    return model, torch.optim.SGD(model.parameters(), lr=0.1), \
        [p.detach().clone() for p in model.parameters()]
