"""pytorch-pretrained-BERT's examples (run_classifier.py, 2019), in outline (written for
mixedprec's tests): an fp16 model, FusedAdam with bias_correction=False and
max_grad_norm=1.0 wrapped in apex.optimizers.FP16_Optimizer, a warmup schedule written
into param_groups, optimizer.backward(loss) and optimizer.step()."""

import torch
from apex.optimizers import FP16_Optimizer, FusedAdam


def warmup_linear(x, warmup=0.1):
    return x / warmup if x < warmup else 1.0 - x


def main():
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                torch.nn.Linear(32, 3)).to(device).half()
    no_decay = ["bias"]
    named = list(model.named_parameters())
    groups = [
        {"params": [p for n, p in named if not any(nd in n for nd in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in named if any(nd in n for nd in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = FusedAdam(groups, lr=5e-3, bias_correction=False, max_grad_norm=1.0)
    loss_scale = 0
    if loss_scale == 0:
        optimizer = FP16_Optimizer(optimizer, dynamic_loss_scale=True)
    else:
        optimizer = FP16_Optimizer(optimizer, static_loss_scale=loss_scale)
    x = torch.randn(64, 16).half().to(device)
    y = torch.randint(0, 3, (64,)).to(device)
    total_steps, first, last = 40, None, None
    for global_step in range(total_steps):
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.float(), y)
        optimizer.backward(loss)
        lr_this_step = 5e-3 * warmup_linear(global_step / total_steps)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr_this_step
        optimizer.step()
        optimizer.zero_grad()
        first = loss.item() if first is None else first
        last = loss.item()
    assert last < 0.8 * first, (first, last)
    assert optimizer.loss_scale == 2.0**16, optimizer.loss_scale
    print("LEGACY-SCRIPT-OK", device)


if __name__ == "__main__":
    main()
