#!/bin/bash
# Restart under torchrun (issue 23, item 4): a kill -9 of one worker mid-epoch, torchrun's
# --max-restarts re-runs the same command line, --resume auto resumes from the last checkpoint.
# usage: torchrun_restart.sh DIR PORT KILL   (KILL=1: kill rank 1 a tenth of a second into the epoch after
# the first committed checkpoint, epoch 1; KILL=0: the uninterrupted run). An epoch takes about a quarter of a second here on a
# quiet machine: a kill a second after the checkpoint had come after the last epoch. Prints "killed PID at TIME" and torchrun's exit status.
set -u
D=$1; PORT=$2; KILL=$3
PY=${PYTHON:-python}
rm -rf "$D"; mkdir -p "$D"
"$PY" -m torch.distributed.run --nproc-per-node 2 --max-restarts 2 --rdzv-backend c10d \
  --rdzv-endpoint "localhost:$PORT" -m sparsecomm train --model mlp --data digits --method topk --density 0.1 \
  --epochs 4 --batch-size 8 --checkpoint-dir "$D/ck" --resume auto --runs-dir "$D/runs" \
  --collective-timeout 20 > "$D/out.log" 2>&1 &
AGENT=$!
if [ "$KILL" = 1 ]; then
  while [ ! -f "$D/ck/step-000000000001/rank-00001-of-00002.done" ] && kill -0 $AGENT 2>/dev/null; do sleep 0.1; done
  sleep 0.1
  WORKER=$(pgrep -P $AGENT | tail -1)
  echo "killed $WORKER at $(date +%T.%N)"
  kill -9 "$WORKER"
fi
wait $AGENT
echo "torchrun exit $?"
