"""Fixtures of the amp tests (compat/test_amp*.py), which name them in their
``pytestmark``; their helpers are in amp_common.py."""

import pytest
import torch

from mixedprec import amp


@pytest.fixture(scope="module")
def one_thread():
    """The tensors of the amp tests are tiny: intra-op threads only add contention (a
    loaded 2-core machine runs them several times slower with them)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def forget_pending_registrations():
    """Function-cast registrations a test leaves pending must not reach another test's
    O1 initialize."""
    yield
    amp._registered_casts.clear()
