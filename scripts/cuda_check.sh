#!/usr/bin/env bash
# The CUDA check on a GPU machine that has python3 with a CUDA torch (and
# numpy, pytest, rich, prometheus-client, torchvision): the missing pins come
# from .whl/ if present (grpcio, protobuf, grpcio-health-checking,
# grpcio-reflection; scripts/cuda_check.py's docstring), the C kernels are
# built in place, then every part of scripts/cuda_check.py runs.
#   bash scripts/cuda_check.sh OUT_DIR [--quick]
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUT_DIR}; shift
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD:$PWD/clients:$PWD/protos/python${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
python3 setup.py -q build_ext --inplace >"$out/build.log" 2>&1 || echo "C build failed (NumPy kernels)"
exec python3 scripts/cuda_check.py "$out" "$@"
