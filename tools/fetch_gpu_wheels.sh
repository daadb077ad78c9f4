#!/usr/bin/env bash
# Download the wheels KVDrive needs on the GPU machine but its image lacks, for CPython
# 3.12 on x86-64 Linux, into .whl/ (git ignores it). The image already has torch, triton,
# cupy, numba, numpy, msgpack, transformers, pyyaml, tqdm and requests.
#
#   bash tools/fetch_gpu_wheels.sh            # from the repository root
#
# On the GPU machine, with .whl carried along:
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#       --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
WHEELS=(
    pyzmq==27.3.0   # kvdrive_client / kvstored transport (no Requires-Dist)
    lmdb==3.0.0     # kvstored catalog (no Requires-Dist)
    gguf==0.19.0    # GGUF model loading (needs numpy, pyyaml, tqdm, requests: all in the image)
)
mkdir -p .whl
for spec in "${WHEELS[@]}"; do
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$spec"
done
# One version of each package: two would stop the install on the GPU machine.
for name in pyzmq lmdb gguf; do
    n=$(ls .whl | grep -ci "^${name}-" || true)
    if [ "$n" -ne 1 ]; then
        echo "fetch_gpu_wheels: .whl holds $n wheels of $name; keep exactly one" >&2
        exit 1
    fi
done
du -ch .whl/*.whl | tail -n 1
ls -l .whl
