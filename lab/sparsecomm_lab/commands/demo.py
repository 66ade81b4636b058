"""``sparsecomm demo``: the main job on a fresh machine in at most 10 minutes.

P = 4 local workers on an emulated 1 Gbit/s switch (loopback when the machine cannot emulate it,
said in the output) train the communication-heavy word-level LSTM (about 12M parameters, most
of them in the word embedding) on the fortunes with plain DDP, DDP + PowerSGD (ranks 2 and 4, one
bucket) and the sparse methods that reached the target first in the campaign
(benchmarks/campaign-methods), for a short budget of steps (one epoch), and the no-synchronization floor
(``nosync``: the same model, batch and workers, DDP with torch's no-op hook, nothing exchanged).
The sparse methods run the recommended recipe (``training.sparse_recipe``, docs/training.md): TopkA
with DGC momentum correction at lr 3.0, HiTopK and CLT-k (which do not report the indices they sent)
with the DDP hook. The report opens with the perplexity-against-time plot and the speed-up to the
target; every row gives its step as a multiple of the floor's (``x floor``) and the load average
before the run, as in the campaign; runs that started above the threshold (``--max-load-per-core``)
are named in the report. Unlike the campaign, the demo by default neither waits for a quiet machine
nor redoes a run (``--max-wait``, ``--redo``): between its own runs the 1-minute load average mostly
shows the decay of the run before, and waiting for it would take minutes of the demo's ten. The full
comparison is ``sparsecomm bench time_to_accuracy``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import shutil
import sys
import time

from sparsecomm.cli.table import markdown_table
from sparsecomm.launch.netemu import emulated_net, unavailable_reason
from sparsecomm_lab import campaign
from sparsecomm_lab.training import recipe_densities_text

HELP = "train the communication-heavy LSTM with DDP, PowerSGD and the best sparse methods; report the speed-up"

#: from the campaign (benchmarks/campaign-methods): TopkA, the fastest to the target within 3% of DDP; HiTopK
#: (Shi et al.), within 3% as well; CLT-k, the second fastest, at a larger loss of perplexity
DEMO_SPARSE = ("topka", "hitopk", "cltk")


#: evaluations per epoch: every 5 steps of the default 60 (P = 4), so that the time to the target is
#: resolved to 5 steps for every method (at 6 per epoch a method crossing the target at step 31 was
#: booked at step 40); an evaluation's time is not training time
DEMO_EVALS_PER_EPOCH = 12


#: seconds the demo waits before a run for the load average to fall to the threshold: none, since between
#: its runs the average mostly shows the decay of the run before (the campaign waits up to 300 s)
DEMO_MAX_WAIT_S = 0.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", "-P", type=int, default=4, help="worker count (default 4)")
    parser.add_argument("--net", default="1gbit", help="emulated rate, or 'loopback' (default 1gbit)")
    parser.add_argument("--workload", default="lstm", choices=sorted(campaign.WORKLOADS),
                        help="campaign workload (default lstm)")
    parser.add_argument("--methods", default=None,
                        help=f"comma-separated (default nosync,ddp,powersgd,{','.join(DEMO_SPARSE)})")
    parser.add_argument("--density", type=float, default=None,
                        help=f"density of the sparse methods (default: each method's recipe density, "
                        f"{recipe_densities_text()})")
    parser.add_argument("--train-size", type=int, default=1920,
                        help="training samples (sequences or images) per run (default 1920: 60 steps at P=4)")
    parser.add_argument("--epochs", type=int, default=1, help="epochs per run (default 1)")
    parser.add_argument("--out", default=None, help="output folder (default runs/demo-<time>)")
    parser.add_argument("--copy-to", default=None, help="also copy the report folder here (replacing it)")
    # no wait and no redo, so that the demo keeps to its 10 minutes (its report still records the load
    # before each run and names those that started above the threshold)
    campaign.add_quiet_arguments(parser, max_wait=DEMO_MAX_WAIT_S, redo=0)


def demo_workload(name: str, train_size: int, epochs: int, **model_options) -> campaign.Workload:
    """The campaign workload ``name`` cut to ``train_size`` samples and ``epochs`` epochs, evaluated
    :data:`DEMO_EVALS_PER_EPOCH` times per epoch (``model_options``: a smaller model, for tests)."""
    base = campaign.WORKLOADS[name]
    return dataclasses.replace(base, max_epochs=epochs, evals_per_epoch=DEMO_EVALS_PER_EPOCH,
                               data_options={**base.data_options, "train_size": train_size},
                               model_options=model_options)


def run_demo(workload: campaign.Workload, methods: list[str], net: str | None, out: str, workers: int,
             density: float | None = None, command: str = "sparsecomm demo",
             quiet: campaign.QuietPolicy | None = None) -> dict:
    """Train ``methods`` on ``workload`` and write the report into ``out/report``; returns the
    report's paths, rows and summary. ``density``: of every sparse method (``None``: each method's
    recipe density); ``quiet``: the campaign's quiet-machine policy (the load before each run is
    recorded and reported; a run started above it may be redone), ``None`` for none."""
    specs = campaign.plan([workload.name], [net], methods, density=density, registry={workload.name: workload})
    campaign.run_campaign(specs, out, {"workers": workers}, workloads={workload.name: workload},
                          echo=lambda line: print(line, flush=True), quiet=quiet)
    records = campaign.load_campaign(out)
    return campaign.write_campaign_report(records, os.path.join(out, "report"), command=command,
                                          title="sparsecomm demo: time to target")


def run(args: argparse.Namespace) -> int:
    methods = args.methods.split(",") if args.methods else ["nosync", "ddp", "powersgd", *DEMO_SPARSE]
    net = emulated_net(args.net)
    if net is not None and unavailable_reason() is not None:
        print(f"note: cannot emulate {net} here ({unavailable_reason()}); running on loopback")
    out = args.out or os.path.join("runs", "demo-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))
    command = "sparsecomm demo " + " ".join(sys.argv[2:])
    workload = demo_workload(args.workload, args.train_size, args.epochs)
    print(f"demo: {workload.model} on {workload.data} ({args.train_size} samples, {args.epochs} epoch), "
          f"P={args.workers}, net={net or 'loopback'}, methods: {', '.join(methods)}", flush=True)
    start = time.perf_counter()
    try:
        report = run_demo(workload, methods, net, out, args.workers, args.density, command.strip(),
                          campaign.quiet_policy(args))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print()
    print(markdown_table(report["summary"]))
    print()
    print(markdown_table(report["rows"]))
    print(f"\nreport: {report['markdown']} (total {time.perf_counter() - start:.0f} s)")
    if args.copy_to:
        if os.path.exists(args.copy_to):
            shutil.rmtree(args.copy_to)
        shutil.copytree(os.path.dirname(report["markdown"]), args.copy_to)
        print(f"copied to {args.copy_to}")
    return 0
