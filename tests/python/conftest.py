import pytest
import torch


@pytest.fixture(params=["cpu", "cuda"])
def device(request):
    """The device under test; the CUDA twin of each test skips on a machine without
    a GPU (queried here, when the test runs, never at collection)."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("CUDA is not available")
    return request.param


@pytest.fixture
def other_device(device):
    """A device other than ``device``, for mixed-device errors: needs CUDA either way."""
    if not torch.cuda.is_available():
        pytest.skip("mixed-device checks need CUDA")
    return "cpu" if device == "cuda" else "cuda"

