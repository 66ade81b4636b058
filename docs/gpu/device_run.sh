#!/bin/bash
# The GPU checks of docs/gpu.md in one run on a machine with one CUDA GPU whose python3 holds CUDA
# torch and Triton (no package registry needed). Run from the repository root:
#   OUT=/some/dir bash docs/gpu/device_run.sh [tune] [profile] [select] [selectall] [test] [calibrate] [cpukernels]
# (cpukernels: the C kernels' tests on the machine's own CPU, whose AVX-512 paths an AVX2 machine cannot run)
# Each stage writes its log under $OUT; a stage that fails does not stop the next.
set -u
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
stages=${*:-profile select test}
{ nvidia-smi -L; python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)'; date -u; } \
    >"$OUT/machine.txt" 2>&1
python3 setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1 || echo "C extensions not built (see build.log)"
for stage in $stages; do
    start=$(date +%s)
    case $stage in
        tune) timeout 150 python3 docs/gpu/tune_scan.py --sizes 25M,64M >"$OUT/tune.md" 2>&1 ;;
        profile) timeout 150 python3 docs/gpu/profile_selectors.py --sizes 25M,64M >"$OUT/profile.txt" 2>&1 ;;
        select) timeout 120 python3 -m sparsecomm bench select --device cuda --repeat 20 --sizes 25M,64M \
                    >"$OUT/select.md" 2>&1 ;;
        selectall) timeout 300 python3 -m sparsecomm bench select --device cuda --repeat 20 >"$OUT/select-all.md" 2>&1 ;;
        test) timeout 300 python3 -m pytest -q -ra -m gpu tests/test_gpu.py -p no:cacheprovider >"$OUT/test-gpu.log" 2>&1 ;;
        cpukernels) { grep -o -w 'avx512[a-z]*\|avx2' /proc/cpuinfo | sort -u | tr '\n' ' '; echo
                      python3 -c 'from sparsecomm.selection import scan; from sparsecomm.transport import merge
print("scan kernels", scan.available_kernels(), "sketch variants", merge.sketch_variants())'
                      timeout 240 python3 -m pytest -q -ra -p no:cacheprovider tests/test_scan_kernel.py \
                          tests/test_select_kernel.py tests/test_block_decompress.py tests/test_s2reducer.py \
                          tests/test_decompress.py tests/test_selectors.py; } >"$OUT/cpu-kernels.log" 2>&1 ;;
        calibrate) timeout 300 python3 -m sparsecomm calibrate --device cuda -P 2 -n 4M,25M --repeat 3 \
                       -o "$OUT/profile-h100-P2.json" >"$OUT/calibrate.log" 2>&1 ;;
        *) echo "unknown stage $stage"; continue ;;
    esac
    echo "$stage: exit $? in $(( $(date +%s) - start )) s"
done
