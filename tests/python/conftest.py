import os
import sys
from pathlib import Path

import pytest
import torch

# The tests live in one folder per layer (ops/, optim/, scaler/, compat/, distributed/,
# integrations/); helpers.py and references.py stay here. This folder and the layer
# folders go on sys.path so that `from helpers import ...` and the few imports of
# another test file (`from test_amp import SyncDetector`) resolve from any folder,
# whichever file runs first. Test file names stay unique across the folders (pytest's
# default import mode imports each by its basename).
HERE = Path(__file__).resolve().parent
LAYERS = ("ops", "optim", "scaler", "compat", "distributed", "integrations")
for folder in (HERE, *(HERE / layer for layer in LAYERS)):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))


# Under pytest-xdist (make py-test: -n auto, a worker per core), each worker gets its
# share of the cores for torch's intra-op threads, so that the workers do not
# oversubscribe the machine. Tests that depend on a thread count set their own.
from forked import worker_threads  # noqa: E402  (found on the sys.path set above)

if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    torch.set_num_threads(worker_threads())


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
