"""``apex.multi_tensor_apply`` on mixedprec: :data:`multi_tensor_applier` and
:class:`MultiTensorApply`.

Legacy code calls ``multi_tensor_applier(amp_C.multi_tensor_scale, noop_flag,
[src, dst], scale)``; the applier adds the chunk size and calls the function. With
mixedprec the functions are those of :mod:`mixedprec.amp_C`, which run on CPU and
CUDA tensors alike.
"""

from typing import Any, Callable, List, Sequence

from torch import Tensor

from .. import ops

__all__ = ["MultiTensorApply", "multi_tensor_applier"]


class MultiTensorApply:
    """Calls ``op(chunk_size, noop_flag_buffer, tensor_lists, *args)``, as Apex's class
    of the same name does.

    ``available`` is always True: the functions it applies (:mod:`mixedprec.amp_C`)
    are part of mixedprec, not an optional build of it. ``chunk_size`` is passed to
    ``op`` for Apex's calling convention; mixedprec's operators choose their own
    chunking (:data:`mixedprec.ops.CHUNK_SIZE`) and ignore it.
    """

    available = True
    warned = False

    def __init__(self, chunk_size: int):
        self.chunk_size = chunk_size

    def check_avail(self) -> None:
        """Apex raises here when its extension is missing; mixedprec's never is."""

    def __call__(
        self,
        op: Callable[..., Any],
        noop_flag_buffer: Tensor,
        tensor_lists: Sequence[List[Tensor]],
        *args: Any,
    ) -> Any:
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)


#: The applier legacy code imports. Apex used a chunk size of 2048 * 32 elements,
#: which is also mixedprec's :data:`mixedprec.ops.CHUNK_SIZE`.
multi_tensor_applier = MultiTensorApply(ops.CHUNK_SIZE)
