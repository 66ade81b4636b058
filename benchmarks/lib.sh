# Sourced by benchmarks/record.sh and the run.sh of each benchmark folder.
# After `source benchmarks/lib.sh`: the working directory is the checkout root, .venv/bin is on PATH
# (when it exists), and `conditions COMMAND...` prints the header every report opens with: when and
# where it ran (UTC date, CPU model, cores, 1-minute load average, torch, the code's commit) and the
# command, so that a report states its own conditions (folders and files are never named after them).
set -euo pipefail
BENCH_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$BENCH_ROOT"
if [ -x .venv/bin/python ]; then export PATH="$BENCH_ROOT/.venv/bin:$PATH"; fi

conditions() {
  local cpu code
  cpu=$(lscpu 2>/dev/null | sed -n 's/^Model name: *//p' | head -n 1)
  code=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  git diff --quiet HEAD 2>/dev/null || code="$code with uncommitted changes"
  echo "Measured $(date -u '+%Y-%m-%d %H:%M UTC') on ${cpu:-an unknown CPU}, $(nproc) cores, 1-minute load"
  echo "average $(cut -d' ' -f1 /proc/loadavg) at the start; torch $(python -c 'import torch; print(torch.__version__)'), code $code."
  echo "Command (from the checkout root):"
  echo
  echo "    $*"
  echo
}
