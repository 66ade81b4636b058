"""`sparsecomm calibrate`: measure this machine and network (or a torchrun cluster) into a JSON profile.

The profile holds alpha and beta per link kind, the native all-reduce's fitted alpha/beta and rate,
each selector's time per element, the time per received sparse element, and each method's per-step
work and traffic measured at ``-P`` workers; ``sparsecomm simulate --profile`` and ``sparsecomm advise``
read it. See :mod:`sparsecomm.simulator.calibration`.

With ``--peers P --gradients FILE`` it measures one device's local work instead, in one process: each
method's calls on a saved gradient (selection, residual, packing, its own decompression) and the
decompression of P simulated ranks' messages (cut from the saved gradients by the method's selector),
with no link measured: projections take ``--alpha``/``--bandwidth`` and the formulas' traffic
(``sparsecomm simulate --formula-comm``). ``--step FILE`` records a training step's figures (the
JSON of ``benchmarks/gpu/gpt_step.py``: the step without synchronization, PowerSGD's local work and
message sizes) in the profile, for ``simulate --step-compute``/``--powersgd``.
``--out`` is checked writable before the
measurements start; a profile that still cannot be written there is saved in the temporary folder,
and the command says where.
"""

from __future__ import annotations

import json
import os
import sys
import time

from .outputs import check_writable, save_or_fallback

HELP = "measure alpha/beta, the dense all-reduce, selectors and each method's work into a JSON profile"


def add_arguments(parser) -> None:
    parser.add_argument("--out", "-o", default="profile.json", help="profile file to write (default: %(default)s)")
    parser.add_argument("--workers", "-P", type=int, default=2,
                        help="forked workers (ignored under torchrun, which sets the world size) "
                        "(default: %(default)s)")
    parser.add_argument("--net", default=None, help="emulated link rate for the forked workers, e.g. 1gbit or "
                        "100mbit (tc, needs root; default: loopback)")
    parser.add_argument("--size", "-n", default="1M", help="comma-separated gradient sizes for the methods' work "
                        "(default: %(default)s)")
    parser.add_argument("--density", type=float, default=0.01, help="density of the sparse methods "
                        "(default: %(default)s)")
    parser.add_argument("--methods", default="all", help="comma-separated methods or 'all'; a method's options "
                        "follow its name after colons, e.g. redsync:large=binary_search (default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=3, help="timed calls per measurement (default: %(default)s)")
    parser.add_argument("--peers", type=int, default=None,
                        help="measure one device's local work with this many simulated ranks' messages to "
                        "decompress (one process, no links; needs --gradients)")
    parser.add_argument("--gradients", default=None,
                        help="with --peers: a saved gradients file (torch.save of {'gradients': float32 [G, n], "
                        "'layout': [(offset, numel), ...]}), e.g. from benchmarks/gpu/gpt_step.py")
    parser.add_argument("--step", default=None,
                        help="with --peers: a JSON of a training step's figures to record in the profile's meta")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where the methods' gradients live: cuda measures the GPU's work (the forked workers "
                        "share this machine's one GPU; under torchrun each rank uses its LOCAL_RANK's GPU) "
                        "(default: %(default)s)")


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _torchrun(args, methods, sizes) -> int:
    """This process is one rank of a torchrun job: measure, gather to rank 0, rank 0 writes."""
    import torch
    import torch.distributed as dist

    from ..simulator.calibration import (
        available_cores,
        calibration_worker,
        device_name,
        measure_block_topk,
        measure_selector_fixed,
        measure_selectors,
        profile_from_records,
    )

    gpu = args.device == "cuda"
    dist.init_process_group("nccl" if gpu else "gloo")
    try:
        device = "cpu"
        if gpu:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            device = f"cuda:{torch.cuda.current_device()}"
        one_node = os.environ.get("LOCAL_WORLD_SIZE") == os.environ["WORLD_SIZE"]
        record = calibration_worker(methods, sizes, args.density, args.repeat,
                                    link_kind="intra" if one_node else "inter", device=device)
        records: list = [None] * dist.get_world_size()
        dist.all_gather_object(records, record)
        if dist.get_rank() == 0:
            n = max(sizes)
            n_sel = n if gpu else min(n, 4_000_000)
            profile = profile_from_records(
                records, density=args.density, net=f"torchrun ({dist.get_world_size()} ranks)",
                device=device_name(device), cores=available_cores(), colocated=False,
                selectors=measure_selectors(n_sel, args.density, device=device),
                selector_fixed_s=measure_selector_fixed(n_sel, args.density, device=device),
                block_topk_s=measure_block_topk(n, args.density, device=device),
                meta={"P": dist.get_world_size(), "sizes": sizes, "density": args.density,
                      "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())})
            path = save_or_fallback(profile.save, args.out, "profile")
            _summary(profile, path)
    finally:
        dist.destroy_process_group()
    return 0


def _work_line(m: dict) -> str:
    """A method's fitted work: selection per gradient element, decompression per byte of its sweep
    (per entry touched on a GPU, per element for a dense method) and the agreement per round."""
    per = {"entry": "entry", "byte": "byte swept"}.get(m["decompress_per"], "elem")
    line = f"select {m['s1'] * 1e9:.2f} ns/elem, decompress {m['d1'] * 1e9:.3f} ns/{per}, "
    if "agreement_round_s" in m:
        line += f"agreement {m['agreement_round_s'] * 1e6:.0f} us/round, "
    return line + f"traffic x{m['traffic_factor']:.2f}"


def _summary(profile, path: str) -> None:
    for kind, link in profile.links.items():
        print(f"{kind}: alpha = {link['alpha'] * 1e6:.1f} us, beta = {link['beta'] * 1e9:.3f} ns/byte "
              f"({8 / link['beta'] / 1e9 if link['beta'] else float('inf'):.2f} Gbit/s)"
              + (f"; CPU {link['cpu_round_s'] * 1e6:.0f} us/message, {link['cpu_byte_s'] * 1e9:.3f} ns/byte moved"
                 if "cpu_round_s" in link else ""))
    d = profile.dense_allreduce
    print(f"native all-reduce: {d['rate_gbit']:.2f} Gbit/s of gradient at n={d['at_n']}")
    print(json.dumps({name: _work_line(m) for name, m in profile.methods.items()}, indent=1))
    print(f"profile written to {path}")


def _option_value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def method_options(text: str) -> list[tuple[str, dict]]:
    """``name[:key=value...]`` entries, comma-separated (or 'all'): (name, options) pairs, names checked."""
    from .simulate import method_names

    if text.strip() == "all":
        return [(name, {}) for name in method_names("all")]
    out = []
    for entry in text.split(","):
        name, *pairs = entry.strip().split(":")
        options = {}
        for pair in pairs:
            key, sep, value = pair.partition("=")
            if not sep or not key:
                raise ValueError(f"--methods entry {entry!r}: options go as name:key=value")
            options[key] = _option_value(value)
        out.append((method_names(name)[0], options))
    return out


def _local(args, methods: list[tuple[str, dict]]) -> int:
    """``--peers``: one device's local work with simulated peers (:func:`~.simulator.calibration.calibrate_local`)."""
    from ..simulator.calibration import calibrate_local
    from .simulate import fail

    meta = {}
    if args.step:
        try:
            with open(args.step) as f:
                meta["step"] = json.load(f)
        except (OSError, json.JSONDecodeError) as err:
            return fail("calibrate", f"--step {args.step}: {err}")
    print(f"local work of {len(methods)} methods on {args.device} with {args.peers} simulated peers, "
          f"{args.repeat} timed calls each", file=sys.stderr, flush=True)
    try:
        profile = calibrate_local(methods, args.density, args.gradients, peers=args.peers, repeat=args.repeat,
                                  device=args.device, meta=meta)
    except (ValueError, OSError) as err:
        return fail("calibrate", str(err))
    profile.save(args.out)
    print(json.dumps({name: _work_line(m) for name, m in profile.methods.items()}, indent=1))
    print(f"profile written to {args.out}")
    return 0


def run(args) -> int:
    from ..simulator.model import UnknownMethodError
    from .options import parse_count
    from .simulate import fail

    try:
        check_writable(args.out, "--out")  # before minutes of measurement (also when called without the CLI)
        with_options = method_options(args.methods)
        methods = [name for name, _ in with_options]
        if args.peers is not None and not args.gradients:
            raise ValueError("--peers needs --gradients (a saved gradients file)")
        if args.peers is None and any(options for _, options in with_options):
            raise ValueError("method options in --methods are taken with --peers only")
        sizes = [parse_count(s) for s in args.size.split(",")]
        if not 0 < args.density <= 1:
            raise ValueError(f"--density={args.density} must lie in (0, 1]")
        if args.repeat < 1:
            raise ValueError(f"--repeat={args.repeat} must be >= 1")
        if args.device == "cuda":
            os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # ask without starting CUDA here
            import torch

            if not torch.cuda.is_available():
                raise ValueError("--device cuda: no CUDA GPU here (a CUDA build of torch and a GPU are needed)")
        from ..launch.netemu import emulated_net, parse_rate

        args.net = emulated_net(args.net)
        if args.net is not None:
            parse_rate(args.net)
    except (UnknownMethodError, ValueError) as err:
        return fail("calibrate", str(err))
    if args.peers is not None:
        return _local(args, with_options)
    if _under_torchrun():
        return _torchrun(args, methods, sizes)
    from ..simulator.calibration import calibrate

    print(f"calibrating {len(methods)} methods at P={args.workers} on {args.net or 'loopback'}, sizes "
          f"{', '.join(map(str, sizes))}, {args.repeat} timed calls each (minutes on a small machine)",
          file=sys.stderr, flush=True)
    try:
        profile = calibrate(args.workers, methods, sizes, args.density, net=args.net, repeat=args.repeat,
                            device=args.device)
    except ValueError as err:
        return fail("calibrate", str(err))
    path = save_or_fallback(profile.save, args.out, "profile")
    _summary(profile, path)
    print(f"measured on {profile.device}, {profile.cores} cores, with P={args.workers} forked workers",
          file=sys.stderr)
    return 0
