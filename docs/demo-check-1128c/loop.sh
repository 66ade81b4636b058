#!/bin/bash
cd /tmp/fresh-s27
for i in 1 2 3; do
  while [ "$(awk '{print ($1 < 1.0)}' /proc/loadavg)" != 1 ]; do sleep 10; done
  t=$(date -u +%H%M)
  echo "run $i start $(date -u +%H:%M:%S) load $(cat /proc/loadavg) tree $(git rev-parse --short HEAD)" >> /tmp/s27/demos.loop
  (time make demo > /tmp/s27/demo-$t.log 2>&1) 2>> /tmp/s27/demo-$t.log
  cp -r "$(ls -td runs/demo-* | head -1)" /tmp/s27/ 2>/dev/null
  echo "run $i end $(date -u +%H:%M:%S) log demo-$t.log" >> /tmp/s27/demos.loop
done
echo done >> /tmp/s27/demos.loop
