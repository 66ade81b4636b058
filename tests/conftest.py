"""Test configuration: keep the pytest parent single-threaded in torch, since workers are forked
(a parent that ran a multithreaded op makes forked children hang on their first parallel op)."""

import torch

torch.set_num_threads(1)
