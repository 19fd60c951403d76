"""mixedprec's optimizers under torch.optim's names, signatures, defaults and state_dict
format, with keyword-only extras (``master``, ``state_dtype``, ``seed``,
``unscale_grads``): fp32 master weights for fp16/bf16 models or the lean modes, in one
fused op call per group and device, taking a GradScaler's scale and overflow flag
without host synchronisation. Each counts the steps it applied on the device
(``applied_steps``), which :mod:`mixedprec.optim.lr_scheduler`'s schedules follow."""

from . import lr_scheduler
from .adam import Adam, AdamW
from .sgd import SGD

__all__ = ["Adam", "AdamW", "SGD", "lr_scheduler"]
