"""NVIDIA-BERT-style use of amp's internals (written for mixedprec's tests, after the
pattern of run_pretraining.py with allreduce_post_accumulation): the initial loss scale
set through ``_amp_state.loss_scalers[0]._loss_scale`` after ``amp.initialize``,
gradients accumulated with ``delay_unscale=True``, the overflow checked with ``amp_C``
into a script-owned buffer that ``update_scale()`` reads, and master gradients cleared
through ``optimizer._amp_stash`` on an overflow."""

import amp_C
import torch
from apex import amp
from apex.amp import _amp_state
from apex.multi_tensor_apply import multi_tensor_applier
from apex.optimizers import FusedAdam


def main():
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    model = model.to(device)
    optimizer = FusedAdam(model.parameters(), lr=1e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2", loss_scale="dynamic",
                                      cast_model_outputs=torch.float16, verbosity=0)
    amp._amp_state.loss_scalers[0]._loss_scale = 2.0**20
    assert _amp_state.loss_scalers[0].loss_scale() == 2.0**20

    x, y = torch.randn(32, 8).half().to(device), torch.randint(0, 4, (32,)).to(device)
    initial = [p.detach().clone() for p in model.parameters()]
    accumulation = 2
    skipped = stepped = 0
    scales = []
    for step in range(6):
        for micro in range(accumulation):
            logits = model(x[micro::accumulation])
            loss = torch.nn.functional.cross_entropy(logits.float(), y[micro::accumulation])
            loss = loss / accumulation * 2.0**-8  # keeps 2**20 * loss within fp16
            if step == 3 and micro == 1:
                loss = loss * float("inf")
            with amp.scale_loss(loss, optimizer, delay_unscale=True) as scaled_loss:
                scales.append(scaled_loss.item() / loss.item())
                scaled_loss.backward()
        # The script's own overflow check of the (still scaled) gradients.
        scaler = _amp_state.loss_scalers[0]
        overflow_buf = torch.zeros(1, dtype=torch.int32, device=device)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        multi_tensor_applier(amp_C.multi_tensor_l2norm, overflow_buf, [grads], False)
        old_overflow_buf = scaler._overflow_buf
        scaler._overflow_buf = overflow_buf
        had_overflow = scaler.update_scale()
        scaler._overflow_buf = old_overflow_buf
        if had_overflow == 0:
            optimizer.step()
            stepped += 1
        else:
            skipped += 1
            if _amp_state.opt_properties.master_weights:
                for param in optimizer._amp_stash.all_fp32_from_fp16_params:
                    param.grad = None
        for param in model.parameters():
            param.grad = None
    assert skipped == 1 and stepped == 5, (skipped, stepped)
    # The scale set above was used until the overflow, then half of it.
    assert scales[:7] == [2.0**20] * 7 and scales[8:] == [2.0**19] * 4, scales
    assert _amp_state.loss_scalers[0].loss_scale() == 2.0**19
    assert _amp_state.loss_scalers[0]._unskipped == 2
    for before, p in zip(initial, model.parameters()):  # five unscaled Adam steps of lr 1e-3
        change = (p.detach().float() - before.float()).abs().max().item()
        assert torch.isfinite(p).all() and 1e-3 < change < 6e-3, change
    print("LEGACY-SCRIPT-OK", device)


if __name__ == "__main__":
    main()
