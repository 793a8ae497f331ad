#!/usr/bin/env bash
# The GPU check's three calls on a bare GPU machine (tools/gpu_check.py says what each checks).
#
#   tools/gpu_check.sh call1|call2|call3|all OUT_DIR [--modes ...]
#   tools/gpu_check.sh all OUT_DIR --dry-run          # the plan on CPU, tiny settings
#
# A GPU machine may have its own torch and Python 3.12 but no DeepSpeed and no network: bring the
# wheels, made on a machine with the network, in .whl/ (never `make` there: it installs the CPU
# torch and forces the CPU accelerator):
#   pip wheel --no-deps -w .whl deepspeed==0.19.8 hjson==3.1.0
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 py-cpuinfo==9.0.0
# They are installed into a private directory, never over the machine's own packages.
set -u
call=${1:?usage: tools/gpu_check.sh call1|call2|call3|all OUT_DIR [options]}
out=${2:?usage: tools/gpu_check.sh call1|call2|call3|all OUT_DIR [options]}
shift 2
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
if ! "$python" -c "import deepspeed, hjson, pydantic" 2>/dev/null; then
  ls "$here"/.whl/*.whl >/dev/null 2>&1 || { echo "gpu_check: no DeepSpeed here and no wheels in .whl/ (see this file's header)"; exit 2; }
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/gpu_check_site "$here"/.whl/*.whl || exit 2
  export PYTHONPATH=/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$here${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/gpu_check_extensions}
mkdir -p "$out"
"$python" "$here/tools/gpu_check.py" "$call" --out "$out" "$@" 2>&1 | tee -a "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"
