"""A BERT-pretraining-style loop (written for mixedprec's tests after the pattern of
NVIDIA's run_pretraining.py): FusedLAMB with decay and no-decay groups, amp at O2,
gradient accumulation with delay_unscale, the initial scale set through amp's
internals, gradient clipping on amp.master_params, and FusedLayerNorm as BertLayerNorm.
Run under ``python -m mixedprec.apex``; checks that the loss falls and that the scale
set through ``_amp_state`` is the one used."""

import math

import torch
from apex import amp
from apex.amp import _amp_state
from apex.normalization import FusedLayerNorm as BertLayerNorm
from apex.optimizers import FusedLAMB
from torch import nn

VOCAB, DIM, SEQ, BATCH, ACCUMULATE, STEPS = 64, 32, 16, 8, 2, 30


class TinyBert(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layer = nn.TransformerEncoderLayer(DIM, 4, 4 * DIM, dropout=0.0, batch_first=True)
        self.LayerNorm = BertLayerNorm(DIM, eps=1e-12)
        self.decoder = nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        return self.decoder(self.LayerNorm(self.layer(self.embed(ids))))


def batches(step, device):
    g = torch.Generator().manual_seed(step)  # on the CPU: the same batches on any device
    # a learnable task: predict each token's successor modulo VOCAB
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g).to(device)
    return ids, (ids + 1) % VOCAB


def main():
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = TinyBert().to(device)
    no_decay = ["bias", "LayerNorm.bias", "LayerNorm.weight"]
    groups = [
        {"params": [p for n, p in model.named_parameters()
                    if not any(nd in n for nd in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters()
                    if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]
    optimizer = FusedLAMB(groups, lr=5e-3)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O2",
                                      loss_scale="dynamic", cast_model_outputs=torch.float16,
                                      verbosity=0)
    _amp_state.loss_scalers[0]._loss_scale = 2.0**12  # as run_pretraining.py's init_scale
    assert _amp_state.loss_scalers[0].loss_scale() == 2.0**12
    losses = []
    for step in range(STEPS):
        for micro in range(ACCUMULATE):
            ids, labels = batches(step * ACCUMULATE + micro, device)
            logits = model(ids)
            loss = nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB),
                                               labels.reshape(-1)) / ACCUMULATE
            last = micro == ACCUMULATE - 1
            with amp.scale_loss(loss, optimizer, delay_unscale=not last) as scaled:
                if step == 0 and micro == 0:
                    assert math.isclose(scaled.item() / loss.item(), 2.0**12, rel_tol=1e-3)
                scaled.backward()
        torch.nn.utils.clip_grad_norm_(amp.master_params(optimizer), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item() * ACCUMULATE)
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    print(f"LEGACY-SCRIPT-OK {device} {first:.4f} -> {last:.4f}")


if __name__ == "__main__":
    main()
