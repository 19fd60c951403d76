"""maskrcnn-benchmark-style use of the 2018 amp API (written for mixedprec's tests):
``amp.init()`` returns a handle, model code decorates functions with
``amp.float_function``, and the training loop scales the loss through the handle."""

import torch
from apex import amp


@amp.float_function
def roi_align_like(features):
    assert features.dtype == torch.float32, features.dtype
    return features * 1.0


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        features = self.body(x)
        assert features.dtype == torch.float16, features.dtype
        return self.head(roi_align_like(features).relu())


def main():
    torch.manual_seed(0)
    # amp.init turns autocast on for CUDA where there is a GPU (as Apex), else for the CPU
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    amp_handle = amp.init(enabled=True, verbose=False)
    model = Net().to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = torch.randn(32, 8).to(device), torch.randn(32, 2).to(device)
    losses = []
    for it in range(30):
        losses_dict = {"l2": torch.nn.functional.mse_loss(model(x).float(), y)}
        losses = [sum(loss for loss in losses_dict.values())] + losses
        total = losses[0] * (float("inf") if it == 10 else 1.0)
        optimizer.zero_grad()
        with amp_handle.scale_loss(total, optimizer) as scaled_losses:
            scaled_losses.backward()
        optimizer.step()
    assert losses[0] < 0.7 * losses[-1], (losses[0], losses[-1])
    assert amp_handle._default_scaler.loss_scale() == 2.0**15
    disabled = amp.init(enabled=False)
    assert not disabled.is_active()
    print("LEGACY-SCRIPT-OK", device)


if __name__ == "__main__":
    main()
