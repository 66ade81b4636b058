#!/usr/bin/env bash
# The current result of the simulator's held-out validation: RUNS runs (default 6) of `sparsecomm
# bench simvalidate`, one after the other, each calibrating afresh at P = 2 (n = 2M and 4M, on an
# emulated 1 Gbit/s link) and measuring the held-out points P = 3 and 6, n = 5M and 7M. Writes
# benchmarks/simulator/report.md (every run's report) and simvalidate.jsonl (every measurement and
# prediction). Needs root for the emulated link; about 2 minutes a run on a 2-core machine.
source "$(dirname "$0")/../lib.sh"
runs=${RUNS:-6}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for i in $(seq "$runs"); do
  mkdir -p "$work/$i"
  sparsecomm bench simvalidate --net 1gbit -P 3,6 -n 5M,7M --calibrate-workers 2 --calibrate-sizes 2M,4M \
      --density 0.01 --methods dense,spardl,topka,exdyna,topkdsa,topk,hitopk,cltk --repeat 5 --runs 3 \
      --results "$work/$i/simvalidate.jsonl" --profile-dir "$work/$i" --report "$work/$i/report.md"
done
{
  echo "# The simulator's held-out validation"
  echo
  echo "$runs runs of benchmarks/simulator/run.sh's command, one after the other; each run's report gives"
  echo "its date, the load at its groups' starts and the command (its scratch output folder: $work)."
  for i in $(seq "$runs"); do echo; echo "## Run $i"; echo; cat "$work/$i/report.md"; done
} > benchmarks/simulator/report.md
cat "$work"/*/simvalidate.jsonl > benchmarks/simulator/simvalidate.jsonl
echo "wrote benchmarks/simulator/report.md and simvalidate.jsonl"
