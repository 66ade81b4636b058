#!/bin/bash
cd /tmp/fresh-s25
for i in 1 2 3; do
  while [ "$(awk '{print ($1 < 1.0)}' /proc/loadavg)" != 1 ]; do sleep 10; done
  t=$(date -u +%H%M)
  echo "run $i start $(date -u +%H:%M:%S) load $(cat /proc/loadavg) tree $(git rev-parse --short HEAD)" >> /tmp/s2/demos.loop
  (time make demo > /tmp/s2/demo-$t.log 2>&1) 2>> /tmp/s2/demo-$t.log
  echo "run $i end $(date -u +%H:%M:%S) log demo-$t.log" >> /tmp/s2/demos.loop
done
echo done >> /tmp/s2/demos.loop
