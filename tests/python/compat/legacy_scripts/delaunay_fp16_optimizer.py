"""Delaunay/MixedPrecision-like use of fp16_utils: the module imported by its file path
(`import apex.fp16_utils.fp16_optimizer as m`, then m.FP16_Optimizer) around an
optimizer of a half-precision model, dynamic loss scaling, a few steps. Run as
`python -m mixedprec.apex <this file>`."""

import apex.fp16_utils.fp16_optimizer as m
import torch
from apex.fp16_utils import network_to_half


def main():
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = network_to_half(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                                torch.nn.Linear(16, 1)).to(device))
    optimizer = m.FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                 dynamic_loss_scale=True,
                                 dynamic_loss_args={"init_scale": 2.0**10}, verbose=False)
    x = torch.randn(32, 8).to(device)
    y = x[:, :1] * 0.5
    losses = []
    for _ in range(15):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
        optimizer.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    assert next(model.parameters()).dtype == torch.float16
    assert losses[-1] < 0.5 * losses[0], losses
    print("DELAUNAY-LIKE-OK", device, round(losses[0], 4), round(losses[-1], 4))


if __name__ == "__main__":
    main()
