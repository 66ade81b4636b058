#!/usr/bin/env bash
# The current result of the advice check: for each network (loopback, emulated 1 Gbit/s, 100 Mbit/s) a
# profile calibrated at P = 4 (n = 2M, every method, 5 calls each), then `advise --measure` (10
# interleaved rounds of every ranked method), ranking by step time; RUNS rounds of the three (default
# 3), each network started once the 1-minute load average is below 1.0. Writes
# benchmarks/advise/report.md (every output with its date, load and code) and the profiles
# profile-NET-RUN.json beside it. Needs root for the emulated links; about 15 minutes.
source "$(dirname "$0")/../lib.sh"
out=benchmarks/advise
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for run in $(seq "${RUNS:-3}"); do
  for net in ${NETS:-loopback 1gbit 100mbit}; do
    while awk '{exit !($1 >= 1.0)}' /proc/loadavg; do sleep 10; done
    flag=(); [ "$net" != loopback ] && flag=(--net "$net")
    profile="$work/profile-$net-$run.json"
    {
      echo "### $net, run $run: $(date -u '+%Y-%m-%d %H:%M UTC'), code $(git rev-parse --short HEAD), 1-minute load $(cut -d' ' -f1 /proc/loadavg)"
      echo
      echo "    sparsecomm calibrate -P 4 ${flag[*]} -n 2M --repeat 5 -o $out/profile-$net-$run.json"
      echo "    sparsecomm advise --params 2M -P 4 --profile $out/profile-$net-$run.json --colocated --densities 0.01 --top 20 --by-step-time --measure ${flag[*]} --rounds 10"
      echo
      sparsecomm calibrate -P 4 "${flag[@]}" -n 2M --repeat 5 -o "$profile" 2>&1 | sed 's/^/    /'
      echo
      echo "advice, $(date -u '+%H:%M UTC'), 1-minute load $(cut -d' ' -f1 /proc/loadavg):"
      echo
      sparsecomm advise --params 2M -P 4 --profile "$profile" --colocated --densities 0.01 --top 20 \
          --by-step-time --measure "${flag[@]}" --rounds 10 2>&1
    } > "$work/$net-$run.md"
  done
done
rm -f "$out"/profile-*.json
cp "$work"/profile-*.json "$out/"
{
  echo "# \`sparsecomm advise\` against measurement"
  echo
  echo "Each output opens with its date, load, code and commands; the profiles are this folder's profile-NET-RUN.json."
  for f in "$work"/*.md; do echo; cat "$f"; done
} > "$out/report.md"
echo "wrote $out/report.md and the profiles"
