"""mixedprec's optimizers under torch.optim's names, signatures, defaults and state_dict
format, with keyword-only extras (``master``, ``state_dtype``, ``seed``,
``unscale_grads``): fp32 master weights for fp16/bf16 models or the lean modes, in one
fused op call per group and device, taking a GradScaler's scale and overflow flag
without host synchronisation. Each counts the steps it applied on the device
(``applied_steps``), which :mod:`mixedprec.optim.lr_scheduler`'s schedules follow.

:class:`Optimizer` is their base (:mod:`mixedprec.optim.optimizer`); LAMB and NovoGrad,
which torch.optim lacks, take torch-style arguments. :func:`in_backward` makes one step
inside backward, freeing each bucket's gradients as it goes."""

from . import lr_scheduler
from .adagrad import Adagrad
from .adam import Adam, AdamW
from .in_backward import InBackward, in_backward
from .lamb import LAMB
from .novograd import NovoGrad
from .optimizer import Optimizer
from .precision import BF16_MODES, FLOAT_DTYPES, MASTER_MODES, STATE_DTYPES
from .sgd import SGD

__all__ = ["Adam", "AdamW", "SGD", "Adagrad", "LAMB", "NovoGrad", "Optimizer", "lr_scheduler",
           "in_backward", "InBackward",
           "MASTER_MODES", "BF16_MODES", "STATE_DTYPES", "FLOAT_DTYPES"]
