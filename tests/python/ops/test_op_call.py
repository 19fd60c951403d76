"""An op call through torch.ops holds no reference after it returns, and releases the
ones it took holding Python's GIL once (csrc/ops/kernel.h): every kernel is registered
that way, a call leaves each tensor's reference counts (Python's, and C++'s: a list's
tensors reach the entry borrowed) and lifetime as it found them (after an error too),
and calls from several Python threads at once give the same results as one at a
time."""

import sys
import threading
import weakref

import pytest
import torch
from helpers import randn, scalar
from test_registration import expected_dispatch_keys, registered_ops

from mixedprec import ops


@pytest.mark.parametrize("op", registered_ops())
def test_every_kernel_is_registered_through_ops_kernel_h(op):
    # kernel<fn>() registers a boxed function; m.impl(name, fn) would register fn's
    # unboxed wrapper too ("[ boxed unboxed ]"), whose call releases each Python-owned
    # tensor's reference taking the GIL again.
    dump = torch._C._dispatch_dump(op)
    for key in expected_dispatch_keys():
        if key == "Meta":
            continue  # (mixedprec/ops.py's fake kernels, Python)
        lines = [line for line in dump.splitlines()
                 if line.startswith((f"{key}: ", f"{key}[alias]: "))]
        assert len(lines) == 1, f"{op}: no {key} kernel in\n{dump}"
        assert lines[0].endswith("[ boxed ]"), f"{op} on {key}: {lines[0]}"


def sgd_lists(seed, device, n=6):
    params = [randn((3 + i, 2), torch.float32, device, seed + i) for i in range(n)]
    grads = [randn(p.shape, torch.float16, device, seed + 100 + i, 0.1)
             for i, p in enumerate(params)]
    buffers = [torch.zeros_like(p) for p in params]
    model = [p.half() for p in params]
    return params, grads, buffers, model


def sgd(lists, **kwargs):
    device = lists[0][0].device
    ops.fused_sgd_(*lists, lr=0.1, momentum=0.9, inv_scale=scalar(0.5, device),
                   found_inf=scalar(0.0, device), **kwargs)


def test_a_call_leaves_reference_counts_and_lifetimes_as_it_found_them(device):
    lists = sgd_lists(0, device)
    tensors = [t for lst in lists for t in lst]
    counts = [sys.getrefcount(t) for t in tensors]
    uses = [t._use_count() for t in tensors]  # (C++ references: the lists are borrowed)
    for _ in range(3):
        sgd(lists)
    with pytest.raises(ValueError, match="lr_tensor"):
        sgd(lists, lr_tensor=torch.ones(2, device=device))  # refused after the lists were taken
    assert [sys.getrefcount(t) for t in tensors] == counts
    assert [t._use_count() for t in tensors] == uses
    refs = [weakref.ref(t) for t in tensors]
    del tensors, lists, counts
    assert all(ref() is None for ref in refs), "a tensor outlived its last Python owner"


def test_a_call_whose_tensors_have_other_cpp_owners(device):
    # Gradients that autograd wrote have a C++ owner (their parameter) besides their
    # Python object: releasing the call's references gives back no Python object.
    params, grads, buffers, model = sgd_lists(1, device)
    owners = [torch.zeros_like(g, requires_grad=True) for g in grads]
    for owner, g in zip(owners, grads):
        owner.grad = g
    expected = [p.clone() for p in params]
    sgd((expected, [g.clone() for g in grads], [b.clone() for b in buffers],
         [m.clone() for m in model]))
    sgd((params, [o.grad for o in owners], buffers, model))
    assert all(torch.equal(p, e) for p, e in zip(params, expected))
    assert all(o.grad is g for o, g in zip(owners, grads))


def test_calls_from_several_threads_at_once(device):
    steps = 20
    expected = sgd_lists(2, device)
    for _ in range(steps):
        sgd(expected)
    runs = [sgd_lists(2, device) for _ in range(4)]
    errors = []

    def run(lists):
        try:
            for _ in range(steps):
                sgd(lists)
        except Exception as error:  # noqa: BLE001 (reported below)
            errors.append(error)

    threads = [threading.Thread(target=run, args=(lists,)) for lists in runs]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):  # (Python runs here meanwhile)
        threads[0].join(0.001)
    for thread in threads:
        thread.join(60)
        assert not thread.is_alive()
    assert not errors, errors
    for lists in runs:
        for got, want in zip(lists, expected):
            assert all(torch.equal(g, w) for g, w in zip(got, want))
