#!/bin/bash
# PROJECTIONS (not measurements) from the GPU profiles that run.sh's calibrate stage writes: each method's
# step on 8 to 256 GPUs at 10, 25 and 100 Gbit/s (alpha 50 us), the measured step without synchronization
# plus the method's synchronization by the cost formulas and its measured local work, against DDP (ring
# all-reduce: `dense`) and PowerSGD ranks 2 and 4; with STEPS, the time to the target as well.
#
#   RUN=benchmarks/gpu/<run folder> bash benchmarks/gpu/project.sh [STEPS] > <run folder>/projections.md
#
# STEPS: the steps to the target quality, one number for every method or method=steps pairs (sparsecomm
# simulate --steps-to-target); without it, the step alone.
set -eu
RUN=${RUN:?set RUN to the folder holding profile-d0.01.json and profile-d0.001.json}
PY=${PY:-python3}
STEPS=${1:-}
METHODS=dense,topka,spardl,exdyna,redsync,hitopk
for density in 0.01 0.001; do
    profile=$RUN/profile-d$density.json
    n=$($PY -c "import json, sys; print(json.load(open(sys.argv[1]))['meta']['sizes'][0])" "$profile")
    for bandwidth in 10gbit 25gbit 100gbit; do
        echo "### density $density, $bandwidth, n = $n"
        echo
        $PY -m sparsecomm simulate --profile "$profile" -n "$n" --density "$density" -P 8,16,32,64,128,256 \
            --bandwidth "$bandwidth" --alpha 50us --formula-comm --methods "$METHODS" --step-compute auto \
            --powersgd 2,4 ${STEPS:+--steps-to-target "$STEPS"}
        echo
    done
done
