"""The transformer's step on one GPU: the step without synchronization, the model's flat gradients
for ``sparsecomm calibrate --peers``, and PowerSGD's local work and message sizes.

    python3 benchmarks/gpu/gpt_step.py --json gpt-step.json --gradients /tmp/gpt-grads.pt

The model is the lab's GPT (``sparsecomm_lab.models.GPT``: decoder-only, pre-LayerNorm, tied input and
output embeddings, learned positions), by default at the width and depth of GPT-2 small (768 wide,
12 layers, 12 heads, a 50,304-token vocabulary, 1,024-token context: 124M parameters), trained with
AdamW (fused, lr 3e-4, betas 0.9/0.95, weight decay 0.1) under bf16 autocast on random tokens (the
step's time does not depend on the text; the gradients are those of the untrained model on them).

* ``step_s``: the median of ``--steps`` full steps (forward, backward, AdamW) after ``--warmup``,
  the device synchronized around each: the step with no synchronization at all (one GPU);
  ``forward_s``, ``backward_s``: the same for the forward alone and the backward alone;
* ``--gradients``: the flat float32 gradients of ``--peers`` batches (the parameters' ``.grad``
  concatenated in ``model.parameters()`` order, with that layout), for ``sparsecomm calibrate
  --device cuda --peers P --gradients FILE``;
* ``powersgd``: for each rank of ``--powersgd-ranks``, the elements torch's ``powerSGD_hook``
  all-reduces per step (uncompressed tensors, then the P factors, then the Q factors; a matrix is
  compressed only where ``(m + n) r < m n / 2``, the hook's default ``min_compression_rate``) and
  its local work on this model's gradients (error feedback, ``P = M Q``, orthogonalization, ``Q =
  M^T P``, the approximation ``P Q^T`` and the new error), timed as the step is.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from torch import nn


def _median(fn, steps: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _once(fn, steps: int, warmup: int) -> float:
    """``--cpu-smoke``: run once, time nothing."""
    fn()
    return 0.0


def powersgd_elements(shapes: list[torch.Size], rank: int, min_compression_rate: float = 2.0) -> dict[str, int]:
    """Elements torch's PowerSGD hook all-reduces per step for gradients of these shapes: those it
    sends uncompressed (vectors, and matrices too small to gain), and its P and Q factors."""
    out = {"uncompressed": 0, "p": 0, "q": 0}
    for shape in shapes:
        if len(shape) < 2:
            out["uncompressed"] += shape.numel()
            continue
        m, n = shape[0], shape[1:].numel()
        r = min(rank, m, n)
        if (m + n) * r < m * n / min_compression_rate:
            out["p"] += m * r
            out["q"] += n * r
        else:
            out["uncompressed"] += m * n
    return out


def powersgd_local(grads: list[torch.Tensor], rank: int, steps: int, warmup: int) -> float:
    """Seconds of PowerSGD's local work per step on these gradients (what the hook computes between
    its all-reduces, with error feedback), the matrices it compresses only."""
    mats, qs, errors = [], [], []
    gen = torch.Generator(device=grads[0].device).manual_seed(0)
    for g in grads:
        if g.dim() < 2:
            continue
        m = g.reshape(g.shape[0], -1)
        r = min(rank, *m.shape)
        if (m.shape[0] + m.shape[1]) * r >= m.numel() / 2:
            continue
        mats.append(m)
        qs.append(torch.randn(m.shape[1], r, generator=gen, device=m.device))
        errors.append(torch.zeros_like(m))

    def step() -> None:
        for m, q, e in zip(mats, qs, errors, strict=True):
            m = m + e
            p = m @ q
            p, _ = torch.linalg.qr(p)
            q.copy_(m.t() @ p)
            e.copy_(m - p @ q.t())
    return _median(step, steps, warmup)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--peers", type=int, default=8, help="gradients saved (batches) for --gradients")
    parser.add_argument("--gradients", default=None, help="file for the flat gradients (torch.save)")
    parser.add_argument("--powersgd-ranks", default="2,4")
    parser.add_argument("--json", default=None)
    parser.add_argument("--cpu-smoke", action="store_true", help="run tiny on the CPU (no timing meaning)")
    args = parser.parse_args(argv)
    from sparsecomm_lab.models import GPT

    device = "cpu" if args.cpu_smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("gpt_step: needs a CUDA GPU (or --cpu-smoke)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    model = GPT(args.vocab, args.context, width=args.width, layers=args.layers, heads=args.heads).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    count = sum(p.numel() for p in params)
    optimizer = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=device == "cuda")
    gen = torch.Generator(device=device).manual_seed(1)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        tokens = torch.randint(0, args.vocab, (args.batch, args.context + 1), generator=gen, device=device)
        return tokens[:, :-1], tokens[:, 1:]

    def loss_of(tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            logits = model(tokens)
            return nn.functional.cross_entropy(logits.reshape(-1, args.vocab), targets.reshape(-1))

    fixed = batch()

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_of(*fixed).backward()
        optimizer.step()

    def forward() -> None:
        with torch.no_grad():
            loss_of(*fixed)

    def forward_backward() -> None:
        model.zero_grad(set_to_none=True)
        loss_of(*fixed).backward()

    timed = _median if device == "cuda" else _once
    step_s = timed(step, args.steps, args.warmup)
    forward_s = timed(forward, args.steps, args.warmup)
    forward_backward_s = timed(forward_backward, args.steps, args.warmup)
    layout, offset = [], 0
    for p in params:
        layout.append((offset, p.numel()))
        offset += p.numel()
    flats = []
    for _ in range(args.peers):
        model.zero_grad(set_to_none=False)
        loss_of(*batch()).backward()
        flats.append(torch.cat([p.grad.reshape(-1).float() for p in params]).cpu())
    if args.gradients:
        torch.save({"gradients": torch.stack(flats), "layout": layout,
                    "source": f"GPT {args.width}x{args.layers}, random tokens, {args.peers} batches"}, args.gradients)
    grads = [p.grad for p in params]
    powersgd = {}
    for rank in (int(r) for r in args.powersgd_ranks.split(",") if r):
        local = 0.0 if args.cpu_smoke else powersgd_local([g.float() for g in grads], rank, args.steps, args.warmup)
        powersgd[str(rank)] = {**powersgd_elements([g.shape for g in grads], rank), "local_s": local}
    result = {"model": {"kind": "GPT (sparsecomm_lab.models.GPT)", "width": args.width, "layers": args.layers,
                        "heads": args.heads, "vocab": args.vocab, "context": args.context},
              "parameters": count, "n": offset, "batch": args.batch, "tokens_per_step": args.batch * args.context,
              "optimizer": "AdamW (fused), bf16 autocast", "step_s": step_s, "forward_s": forward_s,
              "backward_s": max(0.0, forward_backward_s - forward_s), "forward_backward_s": forward_backward_s,
              "powersgd": powersgd, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
              "torch": torch.__version__, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    print(json.dumps(result, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
