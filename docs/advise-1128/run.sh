#!/bin/bash
# The advice check of docs/advise.md on a quiet machine: for each network, a profile calibrated at
# P = 4 (n = 2M, every method, 5 calls each), then `advise --measure` (10 interleaved rounds of every
# ranked method) ranking by step time. Run from the checkout root: RUN=1 bash docs/advise-1128/run.sh
# (RUN names the outputs: NET-RUN.md, profile-NET-P4-2M-RUN.json)
set -eu
out=docs/advise-1128
run=${RUN:-1}
for net in ${NETS:-loopback 1gbit 100mbit}; do
  while awk '{exit !($1 >= 1.0)}' /proc/loadavg; do sleep 10; done
  flag=(); [ "$net" != loopback ] && flag=(--net "$net")
  {
    echo "# $net: $(date -u '+%Y-%m-%d %H:%M UTC'), tree $(git rev-parse --short HEAD), 1-minute load $(cut -d' ' -f1 /proc/loadavg)"
    echo
    echo "    sparsecomm calibrate -P 4 ${flag[*]} -n 2M --repeat 5 -o $out/profile-$net-P4-2M-$run.json"
    echo "    sparsecomm advise --params 2M -P 4 --profile $out/profile-$net-P4-2M-$run.json --colocated --densities 0.01 --top 20 --by-step-time --measure ${flag[*]} --rounds 10"
    echo
    python -m sparsecomm calibrate -P 4 "${flag[@]}" -n 2M --repeat 5 -o "$out/profile-$net-P4-2M-$run.json" 2>&1 | sed 's/^/    /'
    echo
    echo "advice, $(date -u '+%H:%M UTC'), 1-minute load $(cut -d' ' -f1 /proc/loadavg):"
    echo
    python -m sparsecomm advise --params 2M -P 4 --profile "$out/profile-$net-P4-2M-$run.json" --colocated \
        --densities 0.01 --top 20 --by-step-time --measure "${flag[@]}" --rounds 10 2>&1
  } > "$out/$net-$run.md"
done
