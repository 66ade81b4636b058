#!/bin/bash
cd /tmp/fresh-26
for i in 1; do
  while [ "$(awk '{print ($1 < 1.0)}' /proc/loadavg)" != 1 ]; do sleep 10; done
  t=$(date -u +%H%M)
  echo "run $i start $(date -u +%H:%M:%S) load $(cat /proc/loadavg) tree $(git rev-parse --short HEAD)" >> /tmp/s26/demos.loop
  (time make demo > /tmp/s26/demo-$t.log 2>&1) 2>> /tmp/s26/demo-$t.log
  echo "run $i end $(date -u +%H:%M:%S) log demo-$t.log" >> /tmp/s26/demos.loop
done
echo done >> /tmp/s26/demos.loop
