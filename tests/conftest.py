import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
torch_threads = os.environ.get("RESTKV_TEST_THREADS")
if torch_threads:
    import torch

    torch.set_num_threads(int(torch_threads))
