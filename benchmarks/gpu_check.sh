#!/usr/bin/env bash
# benchmarks/gpu_check.py on a fresh GPU machine with no network (the device tool's lent GPU):
#   bash benchmarks/gpu_check.sh OUT_DIR [gpu_check.py options]
# Installs the wheels carried in .whl/ (megatron-core, pyzmq, pydantic and its parts, downloaded beforehand for
# that machine's Python with `pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl ...`)
# into /tmp/site, builds realloc._C in place with that machine's compiler, then runs the check.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: gpu_check.sh OUT_DIR [options]}
shift
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
t0=$(date +%s)
python3 setup.py -q build_ext --inplace 2>&1 | grep -v -i warning || true
python3 -c "import realloc._C" || { echo "gpu_check.sh: realloc._C did not build" >&2; exit 1; }
echo "gpu_check.sh: installed and built in $(( $(date +%s) - t0 )) s"
export PYTHONUNBUFFERED=1
exec python3 benchmarks/gpu_check.py --out "$out" "$@"
