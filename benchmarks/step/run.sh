#!/usr/bin/env bash
# The current result of `sparsecomm bench step`: three runs at P = 1 and three at P = 4 and 8 (n = 25M,
# densities 1% and 0.1%, every sparse method), each started once the 1-minute load average is below
# 1.5, and the median (min-max) of each figure over them. Writes benchmarks/step/report.md; about
# 20 minutes on a 2-core machine. RUNS=N changes the number of runs of each kind.
source "$(dirname "$0")/../lib.sh"
runs=${RUNS:-3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
quiet() { while awk '{exit !($1 >= 1.5)}' /proc/loadavg; do sleep 10; done; }
for i in $(seq "$runs"); do
  for P in "1" "4 8"; do
    quiet
    out="$work/P${P// /-}-$i.md"
    # shellcheck disable=SC2086
    { conditions sparsecomm bench step --P $P --densities 0.01 0.001 --repeat 5
      sparsecomm bench step --P $P --densities 0.01 0.001 --repeat 5 2>/dev/null; } > "$out"
  done
done
{
  echo "# Per-step work outside communication (sparsecomm bench step)"
  echo
  echo "$runs runs at P = 1 and $runs at P = 4 and 8, each started once the 1-minute load average was below 1.5."
  echo "Figures are multiples of one pass over the gradient (the fused scan's read of it); the summary"
  echo "gives the median (min-max) over the runs; every run's output follows it, with its own conditions."
  echo
  python benchmarks/step/summarize.py "$work"/*.md
  for f in "$work"/*.md; do echo; echo "## Run $(basename "$f" .md)"; echo; cat "$f"; done
} > benchmarks/step/report.md
echo "wrote benchmarks/step/report.md"
