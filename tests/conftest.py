import gc

import pytest
import torch

# Tiny-model CPU tests are dominated by per-op overhead; multi-threaded OpenMP hand-off on a 2-core
# machine costs milliseconds per op. One thread keeps the suite fast and timings stable.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _gpu_memory_back_after_each_gpu_test(request):
    """After a GPU test has returned (its frame, and so its LLMs, gone), hand the caching allocator's blocks back:
    an LLM sizes its KV cache from the card's free memory, so a real-dims model left cached by the test before
    would make the next one's cache plan fail (it did: minimax-m3:4 three times in one file on an 80 GB card).
    A test's own cleanup runs while its locals still hold the model, so it cannot do this itself."""
    yield
    if request.node.get_closest_marker("gpu") is not None and torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()
