#!/usr/bin/env bash
# Run a command that writes a campaign (`sparsecomm demo`, `sparsecomm bench time_to_accuracy`) and
# make it the folder's current result:
#
#   benchmarks/record-campaign.sh NAME COMMAND [ARG...]
#
# COMMAND is given `--out DIR` (its run records) and, unless it is `sparsecomm demo`, `--report
# DIR/report`; afterwards benchmarks/NAME holds report.md (the conditions, then the campaign's
# report), its plots, and records/ (every run's JSON record). The previous result is replaced only
# once the command succeeded; history is git's.
source "$(dirname "$0")/lib.sh"
[ $# -ge 2 ] || { echo "usage: benchmarks/record-campaign.sh NAME COMMAND [ARG...]" >&2; exit 2; }
name=$1; shift
dir="benchmarks/$name"
[ -d "$dir" ] || { echo "record-campaign.sh: no benchmark folder $dir" >&2; exit 2; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
header=$(conditions "$@")
if [ "$1" = sparsecomm ] && [ "${2:-}" = demo ]; then
  "$@" --out "$out/runs"                      # the demo writes its report into OUT/report
else
  "$@" --out "$out/runs" --report "$out/runs/report"
fi
rm -rf "$dir/records" "$dir"/*.png
{ head -n 1 "$out/runs/report/campaign.md"; echo; echo "$header"; tail -n +2 "$out/runs/report/campaign.md"; } > "$dir/report.md"
cp "$out"/runs/report/*.png "$dir/" 2>/dev/null || true
mkdir -p "$dir/records"
(cd "$out/runs" && find . -name '*.json' -not -path './report/*' | while read -r f; do
  mkdir -p "$BENCH_ROOT/$dir/records/$(dirname "$f")"; cp "$f" "$BENCH_ROOT/$dir/records/$f"; done)
echo "wrote $dir/report.md, its plots and records/"
