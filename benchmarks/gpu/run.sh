#!/bin/bash
# The GPU measurements of docs/gpu.md in one run, on a machine with one CUDA GPU whose python3 holds CUDA
# torch and Triton (no package registry needed: the tree goes on PYTHONPATH, the C extensions are not
# built, so the CPU side of the comparisons takes the torch path, which gives the same results).
#
#   OUT=/some/dir bash benchmarks/gpu/run.sh [select] [gpt] [calibrate] [test]      (default: all four)
#
#   select     benchmarks/gpu/select_table.py: every selector and the fused residual add at n = 25M and
#              64M, densities 0.001 and 0.01, against torch.topk(x.abs(), k) and one memory pass
#              (select.md, select.json), after checking each selector's indices against the CPU's at 1M
#   gpt        benchmarks/gpu/gpt_step.py: the GPT's step without synchronization, PowerSGD's figures
#              (gpt-step.json) and 8 batches' flat gradients for calibrate ($GRADS, not returned)
#   calibrate  sparsecomm calibrate --device cuda --peers 8: the local work of topka, spardl, exdyna,
#              redsync (binary search) and hitopk on the GPT's gradient at densities 0.01 and 0.001
#              (profile-d0.01.json, profile-d0.001.json)
#   test       make test-gpu: python3 -m pytest -m gpu tests/test_gpu.py (test-gpu.log)
#
# Every stage runs under its own timeout (120, 60, 2 x 60 and 180 s: 480 s at most, about 300 s expected,
# the first Triton compilations included); run.log holds the machine, each stage's command, output and exit.
# SMOKE=1 runs the select, gpt and calibrate stages' code on the CPU at tiny sizes (Triton's interpreter)
# to check the script: nothing it prints is a measurement.
set -u
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
LOG=$OUT/run.log
PY=${PY:-python3}
GRADS=${GRADS:-/tmp/sparsecomm-gpt-grads.pt}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:$PWD/lab${PYTHONPATH:+:$PYTHONPATH}
stages=${*:-select gpt calibrate test}
METHODS=topka,spardl,exdyna,redsync:large=binary_search,hitopk

if [ "${SMOKE:-0}" = 1 ]; then
    export TRITON_INTERPRET=1 SPARSECOMM_SCAN=triton
    DEVICE=cpu SIZES=80K DENSITIES=0.01 REPEAT=1
    GPT_ARGS="--cpu-smoke --width 64 --layers 2 --heads 2 --vocab 1000 --context 64 --batch 2"
else
    DEVICE=cuda SIZES=25M,64M DENSITIES=0.001,0.01 REPEAT=20
    GPT_ARGS=""
fi

{
    echo "== machine"
    nvidia-smi -L 2>/dev/null || echo "no nvidia-smi"
    $PY -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' 2>&1
    echo "tree: $(cat COMMIT 2>/dev/null || git rev-parse HEAD 2>/dev/null || echo unknown)"
    date -u
} >>"$LOG" 2>&1

stage() {  # stage NAME SECONDS command...: the command under its own timeout, its exit in the log
    local name=$1 limit=$2 start
    shift 2
    start=$(date +%s)
    echo "== $name (limit ${limit} s): $*" >>"$LOG"
    timeout "$limit" "$@"
    local rc=$?
    echo "== $name: exit $rc in $(( $(date +%s) - start )) s" >>"$LOG"
    return $rc
}

for s in $stages; do
    case $s in
        select)
            check=$([ "$DEVICE" = cuda ] && echo --check)
            stage select 120 $PY benchmarks/gpu/select_table.py $check --device "$DEVICE" --sizes "$SIZES" \
                --densities "$DENSITIES" --repeat "$REPEAT" --json "$OUT/select.json" >"$OUT/select.md" 2>>"$LOG" ;;
        gpt)
            stage gpt 60 $PY benchmarks/gpu/gpt_step.py $GPT_ARGS --peers 8 --gradients "$GRADS" \
                --json "$OUT/gpt-step.json" >>"$LOG" 2>&1 ;;
        calibrate)
            for density in 0.01 0.001; do
                stage "calibrate $density" 60 $PY -m sparsecomm calibrate --device "$DEVICE" --peers 8 \
                    --gradients "$GRADS" --step "$OUT/gpt-step.json" --methods "$METHODS" --density "$density" \
                    --repeat 5 -o "$OUT/profile-d$density.json" >>"$LOG" 2>&1
            done ;;
        test)
            if [ "$DEVICE" = cuda ]; then
                stage test 180 $PY -m pytest -q -ra -m gpu tests/test_gpu.py -p no:cacheprovider \
                    >"$OUT/test-gpu.log" 2>&1
            else
                echo "== test: skipped (no GPU: SMOKE=1)" >>"$LOG"
            fi ;;
        *) echo "== unknown stage $s" >>"$LOG" ;;
    esac
done
echo "== done $(date -u)" >>"$LOG"
