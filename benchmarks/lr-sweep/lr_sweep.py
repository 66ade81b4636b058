"""The single-process learning-rate sweep behind the workloads' default learning rates (benchmarks/lr-sweep).

``python benchmarks/lr-sweep/lr_sweep.py MODEL DATA GLOBAL_BATCH STEPS LR[,LR...]``: SGD with momentum 0.9 and the
cosine schedule over STEPS, one thread; prints the test accuracy (or perplexity) at each quarter.
"""

import math
import sys
import time

import torch

from sparsecomm_lab.data import load_dataset
from sparsecomm_lab.models import make_model


def sweep(model_name: str, data_name: str, batch: int, steps: int, lrs: list[float]) -> None:
    opts = {"train_size": 8000, "test_size": 1000} if data_name == "fashion-mnist" else {"test_size": 100}
    data = load_dataset(data_name, **opts)
    lm = data.task == "language-model"
    for lr in lrs:
        torch.manual_seed(0)
        model = make_model(model_name, data.info)
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        order = torch.randperm(len(data.x_train), generator=torch.Generator().manual_seed(0))
        start, results = time.time(), []
        for step in range(steps):
            for group in opt.param_groups:
                group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * step / steps))
            idx = order[(step * batch) % (len(order) - batch):][:batch]
            opt.zero_grad()
            out = model(data.x_train[idx])
            torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), data.y_train[idx].reshape(-1)).backward()
            opt.step()
            if (step + 1) % (steps // 4) == 0:
                with torch.no_grad():
                    logits = model(data.x_test).reshape(-1, out.shape[-1])
                    target = data.y_test.reshape(-1)
                    loss = torch.nn.functional.cross_entropy(logits, target).item()
                    acc = (logits.argmax(1) == target).float().mean().item() * 100
                results.append(f"{step + 1}: ppl {math.exp(min(loss, 50)):.0f}" if lm else f"{step + 1}: acc {acc:.1f}")
        print(model_name, data_name, "lr", lr, " | ".join(results), f"{time.time() - start:.0f}s", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    sweep(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), [float(x) for x in sys.argv[5].split(",")])
