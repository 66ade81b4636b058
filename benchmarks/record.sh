#!/usr/bin/env bash
# Run one benchmark command and make its output the folder's current result:
#
#   benchmarks/record.sh NAME COMMAND [ARG...]
#
# writes benchmarks/NAME/report.md: the conditions (benchmarks/lib.sh) and the command, then the
# command's standard output. The previous report is replaced only once the command succeeded;
# history is git's.
source "$(dirname "$0")/lib.sh"
[ $# -ge 2 ] || { echo "usage: benchmarks/record.sh NAME COMMAND [ARG...]" >&2; exit 2; }
name=$1; shift
dir="benchmarks/$name"
[ -d "$dir" ] || { echo "record.sh: no benchmark folder $dir" >&2; exit 2; }
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
{ conditions "$@"; "$@"; } > "$tmp"
mv "$tmp" "$dir/report.md"
trap - EXIT
echo "wrote $dir/report.md"
