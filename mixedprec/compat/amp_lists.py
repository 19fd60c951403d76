"""Apex's ``apex.amp.lists`` modules (``functional_overrides``, ``torch_overrides``,
``tensor_overrides``): the names of the functions Apex's O1 cast to fp16 or fp32, or
whose arguments it cast to one type, each module with its ``MODULE``. Scripts of
Apex's time edit them before ``amp.initialize`` (NVIDIA's Tacotron2 moves
``'softmax'``); under the alias (``python -m mixedprec.apex``) those edits succeed.

mixedprec's O1 is ``torch.autocast`` around the model's forward, and autocast keeps its
own lists: these are kept for such scripts and are not read. To run a function in
fp16 or fp32 under O1, use ``amp.register_half_function`` or
``amp.register_float_function``, which mixedprec applies.

The alias exposes them under Apex's names, each module's from the lists below
(``apex.amp.lists.torch_overrides.FP32_FUNCS`` is :data:`TORCH_FP32_FUNCS`).
"""

import torch
import torch.nn.functional

__all__ = [
    "FUNCTIONAL_MODULE", "FUNCTIONAL_FP16_FUNCS", "FUNCTIONAL_FP32_FUNCS",
    "FUNCTIONAL_BANNED_FUNCS", "TORCH_MODULE", "TORCH_FP16_FUNCS", "TORCH_FP32_FUNCS",
    "TORCH_CASTS", "TORCH_SEQUENCE_CASTS", "TENSOR_MODULE", "TENSOR_FP16_FUNCS",
    "TENSOR_FP32_FUNCS", "TENSOR_CASTS", "TENSOR_SEQUENCE_CASTS",
]

_CONVOLUTIONS = ["conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
                 "conv_transpose2d", "conv_transpose3d"]

# --- apex.amp.lists.functional_overrides: torch.nn.functional -----------------------------
FUNCTIONAL_MODULE = torch.nn.functional
FUNCTIONAL_FP16_FUNCS = _CONVOLUTIONS + ["linear"]
FUNCTIONAL_FP32_FUNCS = [
    # interpolation, activations and normalizations
    "cosine_similarity", "gelu", "grid_sample", "group_norm", "interpolate", "layer_norm",
    "local_response_norm", "log_softmax", "normalize", "softmax", "softmin", "softplus",
    # losses
    "binary_cross_entropy_with_logits", "cosine_embedding_loss", "cross_entropy",
    "ctc_loss", "hinge_embedding_loss", "kl_div", "l1_loss", "margin_ranking_loss",
    "mse_loss", "multi_margin_loss", "multilabel_margin_loss",
    "multilabel_soft_margin_loss", "nll_loss", "poisson_nll_loss", "smooth_l1_loss",
    "soft_margin_loss", "triplet_margin_loss",
]
#: (name, why) pairs: what Apex's O1 refused unless ``allow_banned``.
FUNCTIONAL_BANNED_FUNCS = [
    ("binary_cross_entropy",
     "binary_cross_entropy takes probabilities, which fp16 rounds badly: use "
     "binary_cross_entropy_with_logits (torch.nn.BCEWithLogitsLoss) on the logits"),
]

# --- apex.amp.lists.torch_overrides: torch ------------------------------------------------
TORCH_MODULE = torch
TORCH_FP16_FUNCS = _CONVOLUTIONS + ["addmm", "addmv", "addr", "matmul", "mm", "mv", "prelu",
                                    "addbmm", "baddbmm", "bmm"]
TORCH_FP32_FUNCS = ["acos", "asin", "cosh", "cumprod", "cumsum", "dist", "erfinv", "exp",
                    "expm1", "log", "log10", "log2", "norm", "pow", "prod", "reciprocal",
                    "renorm", "rsqrt", "sinh", "std", "sum", "tan", "var"]
TORCH_CASTS = ["add", "addcdiv", "addcmul", "atan2", "bilinear", "cross", "div", "dot", "eq",
               "equal", "ge", "gt", "le", "lt", "mul", "ne"]
TORCH_SEQUENCE_CASTS = ["cat", "stack"]


# --- apex.amp.lists.tensor_overrides: torch.Tensor's methods ------------------------------
def _methods(names):
    """The names torch.Tensor has, in order."""
    return [name for name in names if hasattr(torch.Tensor, name)]


TENSOR_MODULE = torch.Tensor
TENSOR_FP16_FUNCS = _methods(["__matmul__"] + TORCH_FP16_FUNCS)
TENSOR_FP32_FUNCS = _methods(["__ipow__", "__pow__", "__rpow__", "cpu"] + TORCH_FP32_FUNCS)
TENSOR_CASTS = _methods(["__add__", "__div__", "__eq__", "__ge__", "__gt__", "__iadd__",
                         "__idiv__", "__imul__", "__isub__", "__itruediv__", "__le__",
                         "__lt__", "__mul__", "__ne__", "__radd__", "__rdiv__", "__rmul__",
                         "__rsub__", "__rtruediv__", "__sub__", "__truediv__"]
                        + TORCH_CASTS)
TENSOR_SEQUENCE_CASTS = _methods(TORCH_SEQUENCE_CASTS)
