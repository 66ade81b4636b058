#!/usr/bin/env bash
# Per-step work (bench step, P = 1, n = 25M, 1%) and per-call time (bench methods, P = 4, n = 1M, 1%) of two
# checkouts, interleaved, each call started once the 1-minute load average is below 1.0:
#
#   git worktree add ../before <commit> && (cd ../before && make venv)
#   benchmarks/step/compare_trees.sh ../before .  > benchmarks/step/against-previous.md
set -eu
before=$1 after=$2 rounds=${ROUNDS:-3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
quiet() { while awk '{exit !($1 >= 1.0)}' /proc/loadavg; do sleep 5; done; }
for i in $(seq "$rounds"); do
  for side in before after; do
    dir=$([ $side = before ] && echo "$before" || echo "$after")
    quiet; (cd "$dir" && .venv/bin/sparsecomm bench step --P 1 --densities 0.01 --repeat 5 2>/dev/null) > "$work/step-$side-$i.md"
    quiet; (cd "$dir" && .venv/bin/sparsecomm bench methods -P 4 -n 1M --density 0.01 --repeat 27 2>/dev/null) \
      > "$work/methods-$side-$i.md"
  done
done
echo "# Against the previous code: bench step and bench methods, $rounds interleaved rounds"
echo
echo "$(date -u '+%Y-%m-%d %H:%M UTC'), before: $(git -C "$before" rev-parse --short HEAD), after: $(git -C "$after" rev-parse --short HEAD), $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
echo
python3 "$(dirname "$0")/compare_trees.py" "$work"
