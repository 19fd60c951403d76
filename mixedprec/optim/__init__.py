"""mixedprec's optimizers under torch.optim's names, signatures, defaults and state_dict
format, with keyword-only extras (``master``, ``state_dtype``, ``seed``,
``unscale_grads``): fp32 master weights for fp16/bf16 models or the lean modes, in one
fused op call per group and device, taking a GradScaler's scale and overflow flag
without host synchronisation."""

from .adam import Adam, AdamW
from .sgd import SGD

__all__ = ["Adam", "AdamW", "SGD"]
