import os

import torch

# Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors; it must be set before triton
# is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (run with `pytest -m gpu` on a GPU machine)")
    config.addinivalue_line("markers", "slow: long-running CPU test")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="no CUDA GPU on this machine (GPU tests run with `pytest -m gpu` on one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed(request):
    # Fresh random inputs per test, reproducible from the test's name when a failure must be replayed.
    seed = int(os.environ.get("KVQ_TEST_SEED", "0")) + (hash(request.node.nodeid) & 0xFFFF)
    torch.manual_seed(seed)
