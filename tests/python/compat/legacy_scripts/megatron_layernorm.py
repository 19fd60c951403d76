"""A Megatron-LM-like model: apex.normalization imported unconditionally at the top,
FusedLayerNorm in the blocks, MixedFusedLayerNorm (fp32 weights) at the end; a few
training steps on a toy regression. Run as `python -m mixedprec.apex <this file>`."""

import torch
from apex.normalization import FusedLayerNorm, MixedFusedLayerNorm
from apex.normalization.fused_layer_norm import FusedRMSNorm


class Block(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.input_layernorm = FusedLayerNorm(hidden, eps=1e-5)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(hidden, 4 * hidden), torch.nn.GELU(),
                                       torch.nn.Linear(4 * hidden, hidden))
        self.post_norm = FusedRMSNorm(hidden)

    def forward(self, x):
        return self.post_norm(x + self.mlp(self.input_layernorm(x)))


class Model(torch.nn.Module):
    def __init__(self, hidden=16, layers=2):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(hidden) for _ in range(layers))
        self.final_layernorm = MixedFusedLayerNorm(hidden, eps=1e-5)
        self.head = torch.nn.Linear(hidden, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(self.final_layernorm(x))


def main():
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = Model().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(64, 8, 16).to(device)
    y = x.sum(-1, keepdim=True).tanh()
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    # bf16 activations through the fp32-weight MixedFusedLayerNorm: fp32 out, as Apex.
    norm = model.final_layernorm
    assert norm.weight.dtype == torch.float32
    assert norm(x.bfloat16()).dtype == torch.float32
    print("MEGATRON-LIKE-OK", device, round(losses[0], 4), round(losses[-1], 4))


if __name__ == "__main__":
    main()
