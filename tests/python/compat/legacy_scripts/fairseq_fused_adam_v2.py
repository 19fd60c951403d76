"""A fairseq-style training loop (written for mixedprec's tests after the pattern of
fairseq/optim/fused_adam.py, v0.10-v0.12): picks Apex's FusedAdam when
multi_tensor_applier is available, subclasses it, and steps through
multi_tensor_applier(self.multi_tensor_adam, ...) itself. Run under
``python -m mixedprec.apex``; checks the loss falls and the update matches torch's Adam."""

import torch


def get_fused_adam_class():
    try:
        from apex.multi_tensor_apply import multi_tensor_applier
        from apex.optimizers import FusedAdam as _FusedAdam  # noqa: F401
        if multi_tensor_applier.available:
            return FusedAdamV2
    except ImportError:
        pass
    return None


from apex.multi_tensor_apply import multi_tensor_applier  # noqa: E402
from apex.optimizers import FusedAdam  # noqa: E402


class FusedAdamV2(FusedAdam):
    def __init__(self, *args, use_fp16_stats=False, **kwargs):
        if use_fp16_stats:
            raise NotImplementedError("use_fp16_stats")
        super().__init__(*args, **kwargs)
        if not hasattr(self, "multi_tensor_adam"):
            raise Exception("Apex installation is outdated. Please install an updated version.")

    def step(self, closure=None, grads=None, output_params=None, scale=None, grad_norms=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            bias_correction = 1 if group["bias_correction"] else 0
            beta1, beta2 = group["betas"]
            if "step" in group:
                group["step"] += 1
            else:
                group["step"] = 1
            g_32, p_32, m_32, v_32 = [], [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p.data, dtype=torch.float)
                    state["exp_avg_sq"] = torch.zeros_like(p.data, dtype=torch.float)
                g_32.append(p.grad.data)
                p_32.append(p.data)
                m_32.append(state["exp_avg"])
                v_32.append(state["exp_avg_sq"])
            if g_32:
                multi_tensor_applier(self.multi_tensor_adam, self._dummy_overflow_buf,
                                     [g_32, p_32, m_32, v_32], group["lr"], beta1, beta2,
                                     group["eps"], group["step"], self.adam_w_mode,
                                     bias_correction, group["weight_decay"])
        return loss


def main():
    torch.manual_seed(0)
    cls = get_fused_adam_class()
    assert cls is FusedAdamV2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    twin = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    twin.load_state_dict(model.state_dict())
    model, twin = model.to(device), twin.to(device)
    opt = cls(model.parameters(), lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.01)
    ref = torch.optim.AdamW(twin.parameters(), lr=1e-2, betas=(0.9, 0.98), eps=1e-8,
                            weight_decay=0.01)
    x, y = torch.randn(64, 8).to(device), torch.randn(64, 1).to(device)
    losses = []
    for _ in range(50):
        for m, o in ((model, opt), (twin, ref)):
            o.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            o.step()
        losses.append(loss.item())
    assert losses[-1] < 0.8 * losses[0], losses
    assert opt.param_groups[0]["step"] == 50
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.allclose(p, q, atol=1e-5), (p - q).abs().max()
    print("LEGACY-SCRIPT-OK", device)


if __name__ == "__main__":
    main()
