import os

import pytest
import torch

# Nothing is downloaded: the models are built from configs, and the Hugging Face
# libraries are told so before they are imported (they read this once, at import).
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: more threads only fight over the cores (on a shared 2-core machine a
    Trainer step took 10x longer with torch's default threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
