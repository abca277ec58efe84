import os
import zlib

import torch

# Without a GPU the Triton kernels run in Triton's interpreter on CPU tensors; it must be set before triton
# is first imported. With a GPU they run compiled, on CUDA tensors only, as GPU tests (common.TRITON_DEVICE):
# compiled Triton cannot read CPU tensors.
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


# Fresh random inputs on every run; the run's seed is printed in the header, and KVQ_TEST_SEED=<seed> replays it.
BASE_SEED = int(os.environ.get("KVQ_TEST_SEED", str(int.from_bytes(os.urandom(3), "little"))))


def pytest_report_header(config):
    return f"kvq test seed: KVQ_TEST_SEED={BASE_SEED}"


def pytest_terminal_summary(terminalreporter):
    # Also at the end, where `pytest -q` (which drops the header) still prints it.
    terminalreporter.write_line(f"kvq test seed: KVQ_TEST_SEED={BASE_SEED}")


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(BASE_SEED + zlib.crc32(request.node.nodeid.encode()))
