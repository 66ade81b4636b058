"""Test configuration: keep the pytest parent single-threaded in torch, since workers are forked
(a parent that ran a multithreaded op makes forked children hang on their first parallel op)."""

import torch
import torch._dynamo  # noqa: F401  # an optimizer's first step imports it: once here, not in every forked worker

torch.set_num_threads(1)
