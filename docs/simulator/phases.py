"""A held-out point's measured parts against the model's: where a prediction misses.

Runs the methods at one (P, n) under an emulated rate, as ``bench simvalidate`` does (forked
workers, 5 timed calls each after one untimed), and splits each method's time with the calibration's
own estimators (``sparsecomm.simulator.calibration``): total (least over calls of the slowest rank),
work (per rank the least over calls of wall less ``time_comm``, then the largest over ranks), comm
(total less work), decompression and agreement; beside each, the model's figure from ``--profile``
(a profile of ``bench simvalidate`` or ``sparsecomm calibrate``), its work split the same way.

    .venv/bin/python docs/simulator/phases.py -P 6 -n 5M \
        --profile docs/simulator/heldout-model10/profile-1gbit-1000000-2000000-P2-r10.json
"""

from __future__ import annotations

import argparse
import datetime
import os


def main() -> None:
    from sparsecomm import run_workers
    from sparsecomm.experiments.bench.common import parse_count
    from sparsecomm.experiments.bench.simvalidate import _validate_worker
    from sparsecomm.methods.base import selection_count
    from sparsecomm.simulator.calibration import slowest_best
    from sparsecomm.simulator.model import Profile, agreement_rounds, decompress_bytes, layout_options, predict

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", required=True)
    parser.add_argument("-P", type=int, default=6)
    parser.add_argument("-n", default="5M")
    parser.add_argument("--methods", default="topk,topka,spardl,cltk,exdyna,hitopk,topkdsa")
    parser.add_argument("--density", type=float, default=0.01)
    args = parser.parse_args()
    profile = Profile.load(args.profile)
    n, P, d = parse_count(args.n), args.P, args.density
    methods = args.methods.split(",")
    print(f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, load average {os.getloadavg()[0]:.2f}, "
          f"net {profile.net}, P = {P}, n = {n}, density {d}; ms, measured / predicted")
    records = run_workers(P, _validate_worker, methods, [n], d, 5, net=profile.net, timeout=600)
    print("| method | total | comm | work | of which decompression | agreement | the rest |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for i, run in enumerate(records[0]["runs"]):
        name = run["method"]
        total = slowest_best(records, i)
        work = max(min(t - c for t, c in zip(r["runs"][i]["times"], r["runs"][i]["time_comm"], strict=True))
                   for r in records)
        decompress = max(min(r["runs"][i]["time_decompress"]) for r in records)
        agreement = min(min(r["runs"][i]["time_agreement"]) for r in records)
        p = predict(name, P, n, d, profile=profile)
        calib = profile.methods[name]
        scale = max(1.0, P / profile.cores) / max(1.0, calib["P"] / profile.cores)
        options = layout_options(name, P, profile.net, True)
        p_decompress = (calib["d1"] * decompress_bytes(name, P, n, selection_count(d, n), d, options)
                        + calib["d0"]) * scale
        p_agreement = calib.get("agreement_round_s", 0.0) * agreement_rounds(P, calib.get("agreement_ride", "")) * scale
        p_rest = (calib["s1"] * n + calib["s0"]) * scale

        def pair(measured: float, predicted: float) -> str:
            return f"{1e3 * measured:.1f} / {1e3 * predicted:.1f}"

        print(f"| {name} | {pair(total, p.total_s)} | {pair(total - work, p.comm_s)} | {pair(work, p.work_s)} | "
              f"{pair(decompress, p_decompress)} | {pair(agreement, p_agreement)} | "
              f"{pair(work - decompress - agreement, p_rest)} |")


if __name__ == "__main__":
    main()
