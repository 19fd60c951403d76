"""Legacy Apex code that runs unmodified (issue #9): FusedAdam's attributes for Apex-style
subclasses (fairseq's FusedAdamV2) and its 2019 arguments, amp's internals that scripts
touch (``_amp_state.loss_scalers[i]._loss_scale``, ``_overflow_buf``, ``update_scale``,
``optimizer._amp_stash``), amp with optimizers that are not mixedprec's, the 2018
``amp.init`` handle, Apex 2019's ``apex.optimizers.FP16_Optimizer``, and checkpoints saved
by Apex (pickled loss scalers, ``amp.state_dict()``).

References are float64 (torch.optim on float64 copies, or the few lines of Apex's math
written out here). The scripts in ``legacy_scripts/`` run in test_legacy_scripts.py."""

import io
import pickle
import sys
import types

import pytest
import torch
from helpers import assert_state_dict_unchanged, make_model, state_dict_snapshot
from torch import nn

from mixedprec import amp, fp16_utils
from mixedprec.multi_tensor_apply import multi_tensor_applier
from mixedprec.optimizers import FusedAdam

# --- FusedAdam: an Apex-style subclass (fairseq's FusedAdamV2 pattern) -------------------

class FairseqLikeAdam(FusedAdam):
    """Written for this test after the pattern of fairseq's FusedAdamV2: checks the Apex
    attributes, keeps an int group step and calls ``multi_tensor_adam`` itself per dtype,
    fp16 parameters through fp32 copies written back."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not hasattr(self, "multi_tensor_adam"):
            raise RuntimeError("apex is outdated")
        assert isinstance(self._dummy_overflow_buf, torch.Tensor)
        assert type(self.adam_w_mode) is int

    @torch.no_grad()
    def step(self, closure=None, grads=None, output_params=None, scale=None, grad_norms=None):
        for group in self.param_groups:
            bias_correction = 1 if group["bias_correction"] else 0
            beta1, beta2 = group["betas"]
            group["step"] = group["step"] + 1 if "step" in group else 1
            lists = {torch.float16: ([], [], [], [], []), torch.float32: ([], [], [], [], [])}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float)
                g, q, m, v, orig = lists[p.dtype]
                g.append(p.grad.float() if p.dtype == torch.float16 else p.grad)
                q.append(p.float() if p.dtype == torch.float16 else p)
                m.append(state["exp_avg"])
                v.append(state["exp_avg_sq"])
                orig.append(p)
            for dtype, (g, q, m, v, orig) in lists.items():
                if g:
                    multi_tensor_applier(self.multi_tensor_adam, self._dummy_overflow_buf,
                                         [g, q, m, v], group["lr"], beta1, beta2, group["eps"],
                                         group["step"], self.adam_w_mode, bias_correction,
                                         group["weight_decay"])
                    if dtype == torch.float16:
                        for o, copy in zip(orig, q):
                            o.copy_(copy)
        return None


@pytest.mark.parametrize("adam_w_mode", [True, False], ids=["adamw", "adam-l2"])
def test_fairseq_like_subclass_steps_as_torch(device, adam_w_mode):
    torch.manual_seed(0)
    p32 = nn.Parameter(torch.randn(7, 3, device=device))
    p16 = nn.Parameter(torch.randn(5, device=device).half())
    opt = FairseqLikeAdam([p32, p16], lr=1e-2, weight_decay=0.1, adam_w_mode=adam_w_mode)
    assert opt.adam_w_mode == int(adam_w_mode)
    assert opt._dummy_overflow_buf.dtype == torch.int32
    assert opt._dummy_overflow_buf.device.type == torch.device(device).type
    ref_params = [p32.detach().double().clone().requires_grad_(),
                  p16.detach().double().clone().requires_grad_()]
    cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref = cls(ref_params, lr=1e-2, weight_decay=0.1)
    for _ in range(4):
        grads = [torch.randn(7, 3, device=device), torch.randn(5, device=device).half()]
        p32.grad, p16.grad = grads
        for r, g in zip(ref_params, grads):
            r.grad = g.double()
        opt.step()
        ref.step()
    assert opt.param_groups[0]["step"] == 4
    torch.testing.assert_close(p32.double(), ref_params[0].detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(p16.double(), ref_params[1].detach(), rtol=0, atol=2e-3)
    # Its checkpoint (an int group step) loads into a FusedAdam, which steps on from it.
    sd = opt.state_dict()
    plain = FusedAdam([p32, p16], lr=1e-2, weight_decay=0.1, adam_w_mode=adam_w_mode)
    plain.load_state_dict(sd)
    assert plain.param_groups[0]["step"] == 4
    grads = [torch.randn(7, 3, device=device), torch.randn(5, device=device).half()]
    p32.grad, p16.grad = grads
    for r, g in zip(ref_params, grads):
        r.grad = g.double()
    plain.step()
    ref.step()
    assert float(plain.param_groups[0]["step"]) == 5.0
    torch.testing.assert_close(p32.double(), ref_params[0].detach(), rtol=0, atol=1e-6)


def test_fused_adam_apex_attributes_survive_pickling():
    opt = FusedAdam([nn.Parameter(torch.ones(3))], adam_w_mode=False, max_grad_norm=2.0,
                    amp_scale_adjustment=4.0)
    again = pickle.loads(pickle.dumps(opt))
    assert again.adam_w_mode == 0
    assert again._amp_scale_adjustment == 4.0
    assert again.param_groups[0]["max_grad_norm"] == 2.0
    assert again._dummy_overflow_buf.dtype == torch.int32


# --- FusedAdam: Apex 2019's arguments ------------------------------------------------------

def _clipped(grads, max_norm):
    """torch's clip_grad_norm_ on float64 copies (the norm over the given tensors)."""
    grads = [g.double().clone() for g in grads]
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    coef = min(1.0, max_norm / (float(total) + 1e-6))
    return [g * coef for g in grads]


@pytest.mark.parametrize("given_norms", [False, True], ids=["norms-computed", "norms-given"])
def test_legacy_step_grads_scale_clipping_output_params(device, given_norms):
    """Two groups, explicit fp16 gradients (scaled by 128), fp16 output copies, per-group
    clipping to max_grad_norm, against torch.optim.AdamW in float64."""
    torch.manual_seed(1)
    params = [nn.Parameter(torch.randn(6, device=device)) for _ in range(3)]
    outs = [torch.zeros(6, device=device, dtype=torch.float16) for _ in range(3)]
    groups = [{"params": params[:2]}, {"params": params[2:], "max_grad_norm": 0.5}]
    opt = FusedAdam(groups, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0)
    refs = [p.detach().double().clone().requires_grad_() for p in params]
    ref = torch.optim.AdamW([{"params": refs[:2]}, {"params": refs[2:]}], lr=1e-2,
                            weight_decay=0.01)
    scale = 128.0
    for _ in range(3):
        true = [torch.randn(6, device=device) * 4 for _ in range(3)]
        grads = [(t * scale).half() for t in true]
        norms = None
        if given_norms:  # Apex's convention: the norm of the gradients as given
            norms = [float(torch.linalg.vector_norm(torch.cat([g.float() for g in gs])))
                     for gs in (grads[:2], grads[2:])]
        opt.step(grads=[grads[:2], grads[2:]], output_params=[outs[:2], outs[2:]],
                 scale=scale, grad_norms=norms)
        unscaled = [g.double() / scale for g in grads]
        for r, g in zip(refs, _clipped(unscaled[:2], 1.0) + _clipped(unscaled[2:], 0.5)):
            r.grad = g
        ref.step()
    for p, out, r in zip(params, outs, refs):
        torch.testing.assert_close(p.double(), r.detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(out, p.detach().half(), rtol=0, atol=0)


@pytest.mark.parametrize("norm", [float("nan"), -1.0, 0.5])
def test_a_given_norm_that_is_nan_negative_or_small_clips_nothing(norm):
    """Apex clipped only where (norm / scale + 1e-6) / max_grad_norm > 1: a NaN or a
    negative grad_norms entry stepped unclipped. Before, the clip factor was clamped
    instead, and made every weight NaN or reversed the update."""
    torch.manual_seed(0)
    a = nn.Parameter(torch.randn(4))
    b = a.detach().clone().requires_grad_()
    opt, twin = FusedAdam([a], lr=1e-2, max_grad_norm=1.0), FusedAdam([b], lr=1e-2)
    grad = torch.randn(4)
    opt.step(grads=[grad.clone()], grad_norms=[norm])
    b.grad = grad.clone()
    twin.step()
    assert torch.equal(a, b)


def test_legacy_step_reads_p_grad_and_one_group_list():
    """``grads`` as one flat list for a single group (Apex's backward compatibility); a
    None entry falls back to ``p.grad``; ``scale`` None is 1."""
    a, b = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    a2, b2 = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    opt, twin = FusedAdam([a, b], lr=0.1), FusedAdam([a2, b2], lr=0.1)
    b.grad = torch.full((2,), 3.0)
    opt.step(grads=(g for g in [torch.full((3,), 2.0), None]))
    a2.grad, b2.grad = torch.full((3,), 2.0), torch.full((2,), 3.0)
    twin.step()
    assert torch.equal(a, a2) and torch.equal(b, b2)


@pytest.mark.parametrize("kwargs, error", [
    (dict(grads=[[torch.ones(3)], [torch.ones(3)]]), ValueError),  # two lists, one group
    (dict(grads=[[torch.ones(4)]]), ValueError),  # wrong shape
    (dict(grads=[[torch.ones(3, dtype=torch.int32)]]), TypeError),
    (dict(grads=[[torch.ones(3)]], output_params=[[torch.ones(2)]]), ValueError),
    (dict(grads=[[torch.ones(3)]], scale=0.0), ValueError),
    (dict(grads=[[torch.ones(3)]], scale=float("inf")), ValueError),
    (dict(grads=[[torch.ones(3)]], grad_norms=[1.0, 2.0]), ValueError),
    (dict(grads=[[torch.ones(3)]], grad_norms=["1"]), TypeError),
], ids=["groups", "shape", "dtype", "output-shape", "scale-0", "scale-inf", "norms-count",
        "norm-type"])
def test_legacy_step_rejects_before_writing(kwargs, error):
    p = nn.Parameter(torch.ones(3))
    opt = FusedAdam([p], lr=0.1, max_grad_norm=1.0)
    p.grad = torch.ones(3)
    opt.step()
    before = state_dict_snapshot([p], opt)
    with pytest.raises(error):
        opt.step(**kwargs)
    assert_state_dict_unchanged([p], opt, before)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(eps_inside_sqrt=True), ValueError, "eps_inside_sqrt"),
    (dict(max_grad_norm=-1.0), ValueError, "max_grad_norm"),
    (dict(use_mt="yes"), TypeError, "use_mt"),
    (dict(amp_scale_adjustment=0.0), ValueError, "amp_scale_adjustment"),
])
def test_legacy_constructor_rejects(kwargs, error, words):
    with pytest.raises(error, match=words):
        FusedAdam([nn.Parameter(torch.ones(2))], **kwargs)


def test_legacy_arguments_honoured_in_signature():
    FusedAdam([nn.Parameter(torch.ones(2))], use_mt=True, eps_inside_sqrt=False)  # accepted
    opt = FusedAdam([nn.Parameter(torch.ones(2))])
    assert "max_grad_norm" not in opt.defaults  # old checkpoints without it still load


def test_amp_scale_adjustment_under_amp():
    """Under amp the gradients are also divided by amp_scale_adjustment (Apex: the
    optimizer's ``_amp_stash`` scale times the adjustment)."""
    torch.manual_seed(2)
    model, twin = nn.Linear(4, 2), nn.Linear(4, 2)
    twin.load_state_dict(model.state_dict())
    opt = FusedAdam(model.parameters(), lr=1e-2, amp_scale_adjustment=4.0)
    model, opt = amp.initialize(model, opt, opt_level="O0", verbosity=0)
    ref_params = [p.detach().double().clone().requires_grad_() for p in twin.parameters()]
    ref = torch.optim.AdamW(ref_params, lr=1e-2, weight_decay=0.0)
    x = torch.randn(8, 4)
    for _ in range(2):
        opt.zero_grad()
        with amp.scale_loss(model(x).square().sum(), opt) as scaled:
            scaled.backward()
        opt.step()
        twin.zero_grad()
        twin(x).square().sum().backward()
        for r, p in zip(ref_params, twin.parameters()):
            r.grad = p.grad.double() / 4.0
        ref.step()
        with torch.no_grad():
            for p, r in zip(twin.parameters(), ref_params):
                p.copy_(r)
    for p, r in zip(model.parameters(), ref_params):
        torch.testing.assert_close(p.double(), r.detach(), rtol=0, atol=1e-6)


# --- apex.optimizers.FP16_Optimizer (2019) -------------------------------------------------

def _adam_no_bias_correction(p, m, v, g, lr, wd, b1=0.9, b2=0.999, eps=1e-8):
    """Apex's FusedAdam update with bias_correction=False, in float64."""
    m.mul_(b1).add_((1 - b1) * g)
    v.mul_(b2).add_((1 - b2) * g * g)
    p.sub_(lr * (m / (v.sqrt() + eps) + wd * p))


def test_fp16_optimizer_2019_with_fused_adam_max_grad_norm(device):
    from mixedprec.optimizers import FP16_Optimizer

    torch.manual_seed(3)
    model = nn.Linear(5, 3).to(device).half()
    opt = FP16_Optimizer(FusedAdam(model.parameters(), lr=1e-2, bias_correction=False,
                                   weight_decay=0.01, max_grad_norm=1.0),
                         dynamic_loss_scale=True)
    assert opt.loss_scale == 2.0**16
    masters = [p.detach().double().clone() for p in model.parameters()]
    ms = [torch.zeros_like(p) for p in masters]
    vs = [torch.zeros_like(p) for p in masters]
    x = torch.randn(16, 5, device=device).half()
    for _ in range(3):
        opt.zero_grad()
        loss = model(x).float().square().mean()
        opt.backward(loss)
        grads = _clipped([p.grad.double() / 2.0**16 for p in model.parameters()], 1.0)
        for group in opt.param_groups:
            group["lr"] = 1e-2  # as pytorch-pretrained-BERT's warmup loop sets it
        opt.step()
        for p, m, v, g in zip(masters, ms, vs, grads):
            _adam_no_bias_correction(p, m, v, g, 1e-2, 0.01)
    for master, p, ref in zip(opt.fp32_from_fp16_groups[0], model.parameters(), masters):
        torch.testing.assert_close(master.double(), ref, rtol=0, atol=1e-5)
        assert torch.equal(p.detach(), master.detach().half())
    assert all(p.grad is None for p in model.parameters()) is False
    opt.zero_grad()  # Apex 2019's default: set_grads_to_None
    assert all(p.grad is None for p in model.parameters())

    # An overflow skips the step and halves the scale.
    before = [p.detach().clone() for p in model.parameters()]
    opt.backward(model(x).float().sum() * float("inf"))
    opt.step()
    assert opt.loss_scale == 2.0**15
    assert all(torch.equal(a, b.detach()) for a, b in zip(before, model.parameters()))


def test_fp16_optimizer_2019_static_scale_and_rejections():
    from mixedprec.optimizers import FP16_Optimizer

    model = nn.Linear(3, 1).half()
    opt = FP16_Optimizer(FusedAdam(model.parameters(), lr=0.1), static_loss_scale=128.0)
    assert opt.loss_scale == 128.0 and not opt.dynamic_loss_scale
    opt.backward(model(torch.ones(2, 3).half()).float().sum())
    assert torch.equal(model.bias.grad.float(), torch.full((1,), 256.0))
    with pytest.raises(ValueError, match="dynamic_loss_args"):
        FP16_Optimizer(FusedAdam(nn.Linear(3, 1).half().parameters()),
                       dynamic_loss_scale=True, dynamic_loss_args={"scale_window": 10})


# --- amp internals ---------------------------------------------------------------------------

# The model of the amp tests below (helpers.make_model's Sequential).
MLP = dict(sizes=(4, 8, 2), activation=nn.ReLU)


def test_loss_scale_attribute_write_takes_effect():
    model = make_model(**MLP)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    scaler = amp._amp_state.loss_scalers[0]
    assert scaler._loss_scale == 2.0**16
    amp._amp_state.loss_scalers[0]._loss_scale = 2.0**20  # as NVIDIA's BERT does
    assert scaler._loss_scale == 2.0**20 and scaler.loss_scale() == 2.0**20
    loss = model(torch.randn(3, 4).half()).float().mean() * 2.0**-12  # no fp16 overflow
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled.item() / loss.item() == 2.0**20
        scaled.backward()
    opt.step()
    assert scaler.state_dict()["loss_scale"] == 2.0**20
    with pytest.raises(ValueError):
        scaler._loss_scale = float("nan")
    with pytest.raises(ValueError):
        scaler._loss_scale = 0.0
    assert scaler._loss_scale == 2.0**20
    assert amp._amp_state.opt_properties.master_weights is True
    assert scaler._scale_seq_len == 2000 and scaler._max_loss_scale == 2.0**24


def test_growth_window_and_bounds_writes_take_effect():
    """NVIDIA's GNMT writes the scaler's `_loss_scale` and `_scale_seq_len` (a float
    from argparse) after initialize: the scale then grows after that many clean steps."""
    model = make_model(**MLP)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    scaler = amp._amp_state.loss_scalers[0]
    scaler._loss_scale, scaler._scale_seq_len = 8.0, 4.0
    assert scaler._scale_seq_len == 4
    for bad in (2.5, 0, "4"):
        with pytest.raises(ValueError, match="_scale_seq_len"):
            scaler._scale_seq_len = bad
    scaler._max_loss_scale = 16.0
    for step in range(9):
        loss = model(torch.randn(3, 4).half()).float().mean()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        opt.zero_grad()
        assert scaler.loss_scale() == (8.0 if step < 3 else 16.0)  # (the ceiling from 4 on)
    with pytest.raises(ValueError):
        scaler._min_loss_scale = 32.0  # above the ceiling: refused, nothing changed
    assert scaler._min_loss_scale < 16.0 and scaler.loss_scale() == 16.0
    scaler._min_loss_scale = 4.0
    scaler._min_loss_scale = None  # (Apex's default, written back: the default floor)
    assert scaler._min_loss_scale == 2.0**-24


def test_overflow_buf_and_update_scale_as_bert_uses_them():
    model = make_model(**MLP)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    scaler = amp._amp_state.loss_scalers[0]
    assert scaler._overflow_buf.dtype == torch.int32
    # BERT: its own buffer, written by amp_C kernels, then update_scale().
    import mixedprec.amp_C as amp_C
    overflow_buf = torch.zeros(1, dtype=torch.int32)
    grads = [torch.tensor([1.0, float("inf")])]
    multi_tensor_applier(amp_C.multi_tensor_scale, overflow_buf, [grads, [torch.empty(2)]], 1.0)
    old, scaler._overflow_buf = scaler._overflow_buf, overflow_buf
    assert scaler.update_scale() is True
    scaler._overflow_buf = old
    assert scaler.loss_scale() == 2.0**15 and scaler._unskipped == 0
    scaler.clear_overflow_state()
    assert scaler.update_scale() is False
    assert scaler.loss_scale() == 2.0**15 and scaler._unskipped == 1
    with pytest.raises(TypeError):
        scaler._overflow_buf = 1
    static = amp.LossScaler(128.0)
    static._overflow_buf.fill_(1)
    assert static.update_scale() is False and static.loss_scale() == 128.0


@pytest.mark.parametrize("fused", [False, True], ids=["torch-adam", "fused-adam"])
def test_delay_overflow_check_leaves_the_scale_to_the_script(fused):
    """NVIDIA's BERT pretraining (allreduce_post_accumulation): scale_loss(...,
    delay_overflow_check=True) over the micro-batches, then its own check of the master
    gradients and scaler.update_scale(), then optimizer.step() unless that found an
    overflow. As in Apex, the scale moves once per optimizer step, by update_scale only,
    and amp skips no step itself (it updated at every exit: three times a step here)."""
    import mixedprec.amp_C as amp_C

    model = make_model(**MLP)
    opt = (FusedAdam(model.parameters(), lr=1e-3) if fused
           else torch.optim.Adam(model.parameters(), lr=1e-3))
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    scaler = amp._amp_state.loss_scalers[0]
    scaler._loss_scale, scaler._scale_seq_len = 2.0**8, 2  # (no fp16 overflow of its own)
    overflow_buf = torch.zeros(1, dtype=torch.int32)
    scales, steps = [], 0
    gen = torch.Generator().manual_seed(0)
    for step in range(5):
        for micro in range(2):
            loss = model(torch.randn(3, 4, generator=gen).half()).float().mean()
            with amp.scale_loss(loss, opt, delay_overflow_check=True) as scaled:
                scaled.backward()
        masters = [p.grad for p in amp.master_params(opt) if p.grad is not None]
        if step == 2:
            masters[0].view(-1)[0] = float("inf")  # (the all-reduce's overflow, say)
        overflow_buf.zero_()
        multi_tensor_applier(amp_C.multi_tensor_scale, overflow_buf,
                             [masters, [torch.empty_like(g) for g in masters]], 1.0)
        old, scaler._overflow_buf = scaler._overflow_buf, overflow_buf
        had_overflow = scaler.update_scale()
        scaler._overflow_buf = old
        if not had_overflow:
            before = [p.detach().clone() for p in model.parameters()]
            opt.step()
            steps += 1
            assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        for p in amp.master_params(opt):
            p.grad = None
        for p in model.parameters():
            p.grad = None
        scales.append(scaler.loss_scale())
    assert steps == 4
    assert scales == [2.0**8, 2.0**9, 2.0**8, 2.0**8, 2.0**9]


@pytest.mark.parametrize("fused", [False, True], ids=["torch-sgd", "fused-adam"])
def test_amp_stash_lists(fused):
    model = make_model(**MLP)
    opt = (FusedAdam(model.parameters(), lr=1e-3) if fused
           else torch.optim.SGD(model.parameters(), lr=0.1))
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    stash = opt._amp_stash
    halves = list(model.parameters())
    assert stash.all_fp16_params == halves and all(p.dtype == torch.float16 for p in halves)
    masters = stash.all_fp32_from_fp16_params
    assert len(masters) == 4 and all(m.dtype == torch.float32 for m in masters)
    assert stash.all_fp32_from_fp32_params == []
    assert [len(g) for g in stash.fp16_groups] == [4]
    for half, master in zip(halves, masters):
        torch.testing.assert_close(master.half(), half.detach(), rtol=0, atol=0)
    loss = model(torch.randn(3, 4).half()).float().sum()
    with amp.scale_loss(loss, opt, delay_unscale=True) as scaled:
        scaled.backward()
    assert stash.params_have_scaled_gradients is True
    with amp.scale_loss(model(torch.randn(3, 4).half()).float().sum(), opt) as scaled:
        scaled.backward()
    assert stash.params_have_scaled_gradients is False
    for m in stash.all_fp32_from_fp16_params:  # as BERT does after an overflow
        m.grad = None
    for p in model.parameters():
        p.grad = None
    opt.step()  # nothing to update: the parameters stay
    for half, master in zip(halves, masters):
        torch.testing.assert_close(master.half(), half.detach(), rtol=0, atol=0)


class ForeignFused(torch.optim.Optimizer):
    """A stand-in for another library's fused optimizer: momentum SGD that reads p.grad in
    its own step, treats a missing gradient as zero (so it would move the weights on a
    step it should skip) and counts steps per group."""

    def __init__(self, params, lr=0.1, momentum=0.9):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["count"] = group.get("count", 0) + 1
            for p in group["params"]:
                buf = self.state[p].setdefault("buf", torch.ones_like(p))
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                buf.mul_(group["momentum"]).add_(grad)
                p.sub_(group["lr"] * buf)


@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_foreign_optimizer_trains_and_skips(opt_level):
    """A step after an overflow does not run at all (no count, no state, no weights)
    and the scale halves; clean steps match the same optimizer on float64 copies fed the
    unscaled gradients."""
    model = make_model(seed=4, **MLP)
    opt = ForeignFused(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level=opt_level, verbosity=0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)  # wraps step too
    x = torch.randn(6, 4)
    if opt_level == "O2":
        x = x.half()
    scaler = amp._amp_state.loss_scalers[0]

    def train_step(poison=False):
        opt.zero_grad()
        loss = model(x).float().square().mean()
        with amp.scale_loss(loss * (float("inf") if poison else 1.0), opt) as scaled:
            scaled.backward()
        grads = [p.grad.clone() if p.grad is not None else None
                 for g in opt.param_groups for p in g["params"]]
        opt.step()
        return grads

    weights = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    train_step(poison=True)
    assert scaler.loss_scale() == 2.0**15
    assert all("count" not in g for g in opt.param_groups) and len(opt.state) == 0
    assert all(torch.equal(w, p) for w, p in
               zip(weights, (p for g in opt.param_groups for p in g["params"])))

    refs = [w.double() for w in weights]
    bufs = [torch.ones_like(r) for r in refs]
    for i in range(3):
        lr = opt.param_groups[0]["lr"]
        grads = train_step()
        for r, b, g in zip(refs, bufs, grads):
            b.mul_(0.9).add_(g.double())
            r.sub_(lr * b)
        sched.step()
    assert opt.param_groups[0]["count"] == 3
    assert sched.last_epoch == 3 and opt.param_groups[0]["lr"] == 0.1 * 0.5**3
    for r, p in zip(refs, (p for g in opt.param_groups for p in g["params"])):
        torch.testing.assert_close(p.double(), r, rtol=0, atol=1e-5)


def test_foreign_optimizer_step_reads_the_device_once(monkeypatch):
    model = make_model(seed=5, **MLP)
    opt = ForeignFused(model.parameters())
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    reads = []
    original = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda t: reads.append(1) or original(t))
    for _ in range(2):
        opt.zero_grad()
        with amp.scale_loss(model(torch.randn(3, 4)).float().mean(), opt) as scaled:
            scaled.backward()
        opt.step()
    assert len(reads) == 2 and opt.param_groups[0]["count"] == 2


# --- amp.init (2018 API) -------------------------------------------------------------------

@pytest.fixture
def handle():
    h = amp.init(verbose=False)
    yield h
    h._deactivate()


def test_amp_init_handle_casts_scales_and_skips(handle):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert isinstance(handle, amp.AmpHandle) and handle.is_active() and handle.has_cache
    model = make_model(device, seed=5, **MLP)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 4, device=device)
    assert model(x).dtype == torch.float16  # autocast on for this thread
    with handle._disable_casts():
        assert model(x).dtype == torch.float32
    ref = [p.detach().double().clone() for p in model.parameters()]

    loss = model(x).float().square().mean()
    with handle.scale_loss(loss, opt) as scaled:
        assert scaled.item() / loss.item() == 2.0**16
        scaled.backward()
    grads = [p.grad.double() for p in model.parameters()]  # unscaled in place
    opt.step()
    for p, r, g in zip(model.parameters(), ref, grads):
        torch.testing.assert_close(p.double(), r - 0.1 * g, rtol=0, atol=1e-7)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    with handle.scale_loss(model(x).float().sum() * float("inf"), opt) as scaled:
        scaled.backward()
    opt.step()  # skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert handle._default_scaler.loss_scale() == 2.0**15
    handle._deactivate()
    assert not torch.is_autocast_enabled(device) and model(x).dtype == torch.float32


def test_amp_init_wrap_optimizer_two_losses(handle):
    model = make_model(seed=6, **MLP)
    opt = handle.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), num_loss=2)
    x = torch.randn(4, 4)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    with opt.scale_loss(model(x).float().mean()) as scaled:
        scaled.backward()
    with opt.scale_loss(model(x).float().mean() * float("inf")) as scaled:
        scaled.backward()
    opt.step()  # the second loss overflowed: skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert [s.loss_scale() for s in opt._loss_scaler] == [2.0**16, 2.0**15]
    opt.zero_grad()
    with handle._disable_casts():
        ref = make_model(seed=6, **MLP)
        (ref(x).mean() * 2).backward()
    for _ in range(2):
        with opt.scale_loss(model(x).float().mean()) as scaled:
            scaled.backward()
    opt.step()
    assert opt.param_groups is opt._optimizer.param_groups
    for p, r, b in zip(model.parameters(), ref.parameters(), before):
        torch.testing.assert_close(p, b - 0.1 * r.grad, rtol=0, atol=2e-3)
    with pytest.raises(RuntimeError, match="wrap_optimizer"):
        with handle.scale_loss(torch.ones(()), opt._optimizer):
            pass


def test_amp_init_disabled_and_rejections():
    noop = amp.init(enabled=False)
    assert isinstance(noop, amp.NoOpHandle) and not noop.is_active()
    loss = torch.ones(())
    with noop.scale_loss(loss, None) as scaled:
        assert scaled is loss
    assert not torch.is_autocast_enabled("cpu")
    with pytest.raises(ValueError, match="allow_banned"):
        amp.init(allow_banned=True)
    with pytest.raises(ValueError, match="loss_scale"):
        amp.init(loss_scale=-1.0)
    assert not torch.is_autocast_enabled("cpu")
    live = amp.init(loss_scale=128.0)  # a rejected call leaves the live handle as it is
    try:
        with pytest.raises(ValueError, match="loss_scale"):
            amp.init(loss_scale=float("nan"))
        assert live.is_active() and torch.is_autocast_enabled(live._device)
        assert live._default_scaler.loss_scale() == 128.0 and not live._default_scaler.dynamic
    finally:
        live._deactivate()
    assert not torch.is_autocast_enabled(live._device)


# --- checkpoints saved by Apex ----------------------------------------------------------------

class _ApexLossScaler:
    """Apex's apex.fp16_utils.loss_scaler.LossScaler attributes (cb65b8ed^)."""

    def __init__(self, scale=1):
        self.cur_scale = scale


class _ApexDynamicLossScaler:
    """Apex's apex.fp16_utils.loss_scaler.DynamicLossScaler attributes (cb65b8ed^)."""

    def __init__(self, init_scale=2**32, scale_factor=2.0, scale_window=1000):
        self.cur_scale = init_scale
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = scale_factor
        self.scale_window = scale_window


class _ApexAmpLossScaler:
    """Apex's apex.amp.scaler.LossScaler attributes (cb65b8ed^), which Apex's
    fp16_utils.FP16_Optimizer used and pickled from 2019 on."""

    def __init__(self, loss_scale, init_scale=2.0**16, scale_window=2000,
                 min_loss_scale=None, max_loss_scale=2.0**24):
        self.dynamic = loss_scale == "dynamic"
        self._loss_scale = min(max_loss_scale, init_scale) if self.dynamic else loss_scale
        self._max_loss_scale = max_loss_scale
        self._min_loss_scale = min_loss_scale
        self._scale_seq_len = scale_window
        self._unskipped = 0
        self._has_overflow = False
        self._overflow_buf = torch.zeros(1, dtype=torch.int32)


def _pickled_as_apex(obj_state_dict_maker):
    """Runs ``obj_state_dict_maker(modules)`` with fake ``apex.fp16_utils.loss_scaler``
    and ``apex.amp.scaler`` in sys.modules (classes named as Apex's), returns what
    torch.save wrote; the fakes are gone afterwards."""
    names = ["apex", "apex.fp16_utils", "apex.fp16_utils.loss_scaler", "apex.amp",
             "apex.amp.scaler"]
    saved = {n: sys.modules.get(n) for n in names}
    modules = {n: types.ModuleType(n) for n in names}
    for cls, path in ((_ApexLossScaler, "apex.fp16_utils.loss_scaler.LossScaler"),
                      (_ApexDynamicLossScaler, "apex.fp16_utils.loss_scaler.DynamicLossScaler"),
                      (_ApexAmpLossScaler, "apex.amp.scaler.LossScaler")):
        module, name = path.rsplit(".", 1)
        fake = type(name, (cls,), {"__module__": module})
        fake.__qualname__ = name
        setattr(modules[module], name, fake)
    try:
        sys.modules.update(modules)
        buffer = io.BytesIO()
        torch.save(obj_state_dict_maker(types.SimpleNamespace(
            fp16=modules["apex.fp16_utils.loss_scaler"], amp=modules["apex.amp.scaler"])),
            buffer)
        return buffer.getvalue()
    finally:
        for n, m in saved.items():
            if m is None:
                sys.modules.pop(n, None)
            else:
                sys.modules[n] = m


def _apex_fp16_optimizer_state(module, dynamic, model, masters):
    """What Apex's FP16_Optimizer.state_dict() held: its scaler object pickled in."""
    if dynamic:
        scaler = module.fp16.DynamicLossScaler(init_scale=2.0**10, scale_window=50)
        scaler.cur_iter, scaler.last_overflow_iter = 37, 20
    else:
        scaler = module.fp16.LossScaler(scale=64.0)
    inner = torch.optim.SGD(masters, lr=0.1, momentum=0.9)
    for m in masters:
        m.grad = torch.ones_like(m)
    inner.step()
    return {"loss_scaler": scaler, "dynamic_loss_scale": dynamic, "overflow": False,
            "first_closure_call_this_step": True,
            "optimizer_state_dict": inner.state_dict(), "fp32_from_fp16": [masters]}


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
@pytest.mark.parametrize("weights_only", [True, False], ids=["weights_only", "full-pickle"])
def test_apex_fp16_optimizer_checkpoint_resumes(dynamic, weights_only):
    torch.manual_seed(7)
    model = nn.Linear(3, 2).half()
    masters = [p.detach().float().clone().add_(0.25).requires_grad_() for p in model.parameters()]
    data = _pickled_as_apex(lambda m: _apex_fp16_optimizer_state(m, dynamic, model, masters))
    assert "apex" not in sys.modules
    if weights_only:  # torch's default: the allowlisted Apex names give mixedprec's classes
        sd = torch.load(io.BytesIO(data), weights_only=True)
    else:  # a full unpickle imports apex.fp16_utils.loss_scaler: under the alias
        import mixedprec.apex as alias
        alias.install()
        try:
            sd = torch.load(io.BytesIO(data), weights_only=False)
        finally:
            alias.uninstall()
    scaler = sd["loss_scaler"]
    assert isinstance(scaler, fp16_utils.DynamicLossScaler if dynamic else fp16_utils.LossScaler)
    assert type(scaler).__module__ == "mixedprec.compat.fp16_utils"

    opt = fp16_utils.FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                    dynamic_loss_scale=dynamic, static_loss_scale=1.0)
    opt.load_state_dict(sd)
    expected = 2.0**10 if dynamic else 64.0
    assert opt.loss_scale == expected
    for p, m in zip(model.parameters(), masters):
        assert torch.equal(p.detach(), m.detach().half())
    if dynamic:  # 37 - 20 - 1 = 16 clean updates since the overflow; growth after 50
        assert opt.loss_scaler.scale_window == 50 and opt.loss_scaler.scale_factor == 2.0
        assert opt.loss_scaler.core.trackers()["growth_tracker"] == 16
    # Training continues at the saved scale.
    opt.zero_grad()
    loss = model(torch.ones(1, 3).half()).float().sum()
    opt.backward(loss)
    assert torch.equal(model.bias.grad.float(), torch.full((2,), expected))
    opt.step()
    assert opt.loss_scale == expected


def _amp_scaler_checkpoint(module, dynamic, model, masters):
    sd = _apex_fp16_optimizer_state(module, dynamic, model, masters)
    if dynamic:
        scaler = module.amp.LossScaler("dynamic", scale_window=100, min_loss_scale=4.0)
        scaler._loss_scale, scaler._unskipped = 2.0**12, 99
    else:
        scaler = module.amp.LossScaler(32.0)
    return dict(sd, loss_scaler=scaler)


@pytest.mark.parametrize("dynamic", [True, False], ids=["dynamic", "static"])
def test_apex_fp16_optimizer_checkpoint_with_amp_scaler_resumes(dynamic):
    """Apex's FP16_Optimizer pickled apex.amp.scaler.LossScaler from 2019 on:
    torch.load(weights_only=True) gives fp16_utils' scaler; under an alias that maps
    apex.amp.scaler, amp's LossScaler unpickles it (simulated here) and loads too."""
    torch.manual_seed(9)
    model = nn.Linear(3, 2).half()
    masters = [p.detach().float().clone().add_(0.5).requires_grad_() for p in model.parameters()]
    data = _pickled_as_apex(lambda m: _amp_scaler_checkpoint(m, dynamic, model, masters))
    sd = torch.load(io.BytesIO(data), weights_only=True)
    expected = 2.0**12 if dynamic else 32.0
    assert type(sd["loss_scaler"]) is (fp16_utils.DynamicLossScaler if dynamic
                                       else fp16_utils.LossScaler)
    as_amp = amp.LossScaler.__new__(amp.LossScaler)  # what the alias would unpickle
    as_amp.__setstate__(dict(vars(_ApexAmpLossScaler("dynamic" if dynamic else 32.0))))
    if dynamic:
        as_amp.__setstate__(dict(vars(_ApexAmpLossScaler("dynamic", scale_window=100,
                                                         min_loss_scale=4.0)),
                                 _loss_scale=2.0**12, _unskipped=99))
    for saved in (sd["loss_scaler"], as_amp):
        opt = fp16_utils.FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1,
                                                        momentum=0.9),
                                        dynamic_loss_scale=dynamic)
        opt.load_state_dict(dict(sd, loss_scaler=saved))
        assert opt.loss_scale == expected
        if dynamic:  # one more clean step grows the scale, as Apex's would (99 + 1 = 100)
            assert opt.loss_scaler.min_loss_scale == 4.0
            assert opt.loss_scaler.max_loss_scale == 2.0**24
            opt.zero_grad()
            opt.backward(model(torch.ones(1, 3).half()).float().sum())
            assert torch.equal(model.bias.grad.float(), torch.full((2,), expected))
            opt.step()
            assert opt.loss_scale == 2 * expected


def test_apex_dynamic_scaler_growth_matches_apex_rule():
    """The unpickled scaler grows when Apex's would: (cur_iter - last_overflow_iter) %
    scale_window == 0 at the update."""
    apex_like = _ApexDynamicLossScaler(init_scale=8.0, scale_window=5)
    apex_like.cur_iter, apex_like.last_overflow_iter = 13, 9
    ours = fp16_utils.DynamicLossScaler.__new__(fp16_utils.DynamicLossScaler)
    ours.__setstate__(dict(vars(apex_like)))
    for _ in range(12):  # Apex's update_scale(False), written out
        if (apex_like.cur_iter - apex_like.last_overflow_iter) % apex_like.scale_window == 0:
            apex_like.cur_scale *= apex_like.scale_factor
        apex_like.cur_iter += 1
        ours.update_scale(False)
        assert ours.loss_scale == apex_like.cur_scale
    with pytest.raises(ValueError, match="unpickle"):
        fp16_utils.LossScaler.__new__(fp16_utils.LossScaler).__setstate__({"x": 1})


def test_apex_amp_checkpoint_resumes():
    model = make_model(seed=8, **MLP)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    buffer = io.BytesIO()
    torch.save({"loss_scaler0": {"loss_scale": 1024.0, "unskipped": 1999}}, buffer)
    amp.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True))
    loss = model(torch.randn(2, 4)).float().sum()
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled.item() / loss.item() == 1024.0
        scaled.backward()
    opt.step()
    assert amp.state_dict()["loss_scaler0"] == {"loss_scale": 2048.0, "unskipped": 0}
