#!/usr/bin/env bash
# The current result of the per-call comparison with the public codes (compare_per_call.py): RUNS
# runs (default 3) one after the other, each started once the 1-minute load average is below 1.0,
# and the median over the runs of each row's time ratio. Writes benchmarks/peers/report.md (the
# summary, then every run's output with its own date, load and command) and records.json (every
# measurement of every run). Needs the public codes: benchmarks/peers/setup_baselines.sh DIR first.
#
#   benchmarks/peers/run.sh DIR [compare_per_call.py options, e.g. --sizes 1M]
source "$(dirname "$0")/../lib.sh"
baselines=${1:?usage: benchmarks/peers/run.sh DIR [options]}; shift
runs=${RUNS:-3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
for i in $(seq "$runs"); do
  while awk '{exit !($1 >= 1.0)}' /proc/loadavg; do sleep 10; done
  OMP_NUM_THREADS=1 python benchmarks/peers/compare_per_call.py --baselines "$baselines" \
      --json "$work/run-$i.json" "$@" > "$work/run-$i.md"
done
python - "$work" "$runs" > "$work/summary.md" <<'PY'
import json, statistics, sys
from pathlib import Path
work, runs = Path(sys.argv[1]), int(sys.argv[2])
rows = {}
for i in range(1, runs + 1):
    for line in (work / f"run-{i}.md").read_text().splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 7 and cells[5].endswith("x") and cells[0] != "n":
            rows.setdefault(tuple(cells[:3]), []).append((float(cells[3]), float(cells[4]), float(cells[5][:-1])))
print(f"Median over {runs} runs (least-most) of each row's medians:\n")
print("| n | ours | theirs | ours (ms) | theirs (ms) | ours / theirs |")
print("| --- | --- | --- | --- | --- | --- |")
for (n, ours, theirs), values in rows.items():
    cols = [[v[j] for v in values] for j in range(3)]
    fmt = [f"{statistics.median(c):.2f} ({min(c):.2f}-{max(c):.2f})" for c in cols]
    print(f"| {n} | {ours} | {theirs} | {fmt[0]} | {fmt[1]} | {fmt[2].replace(' (', 'x (')} |")
PY
{
  echo "# Per call against the official SparDL code and GRACE's topk"
  echo
  cat "$work/summary.md"
  for i in $(seq "$runs"); do echo; echo "## Run $i"; echo; cat "$work/run-$i.md"; done
} > benchmarks/peers/report.md
python -c "import json,sys; json.dump([json.load(open(p)) for p in sys.argv[1:]], open('benchmarks/peers/records.json','w'))" \
    $(for i in $(seq "$runs"); do echo "$work/run-$i.json"; done)
echo "wrote benchmarks/peers/report.md and records.json"
