#!/usr/bin/env bash
# The GPU check's two calls on a bare GPU machine (tools/gpu_check.py says what each checks):
#
#   tools/gpu_check.sh call1 [--dry-run] [--modes ...]   # speed: every mode's engine in one process
#   tools/gpu_check.sh call2 [--dry-run] [--modes ...]   # correctness: CUDA tier, sanitizer, two ranks
#   tools/gpu_check.sh prepare                           # (needs the network) the wheels below
#
# Results under $OUT (default ./gpu_check_out), the log in $OUT/callN.log.
# A GPU machine may have its own torch and Python 3.12 but no DeepSpeed and no network: bring the
# wheels in .whl/ (`prepare` runs these; never `make` there: it installs the CPU torch and forces the
# CPU accelerator):
#   pip wheel --no-deps -w .whl deepspeed==0.19.8 hjson==3.1.0
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 py-cpuinfo==9.0.0
# `prepare` also unpacks them for Python 3.12 into .gpu/site, which is used as it is when carried
# (no install on the machine); else they are installed from .whl/ into /tmp/gpu_check_site (once
# per machine), never over the machine's own packages.
set -u
call=${1:?usage: tools/gpu_check.sh call1|call2|prepare [--dry-run] [--modes ...]}
shift
here=$(cd "$(dirname "$0")/.." && pwd)
python=${PYTHON:-python3}
if [ "$call" = prepare ]; then
  set -e
  pip=("$python" -m pip)
  "${pip[@]}" wheel -q --no-deps -w "$here/.whl" deepspeed==0.19.8 hjson==3.1.0
  "${pip[@]}" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$here/.whl" \
    pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 py-cpuinfo==9.0.0
  rm -rf "$here/.gpu/site"
  "${pip[@]}" install -q --no-deps --no-compile --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --target "$here/.gpu/site" "$here"/.whl/*.whl
  echo "gpu_check: wheels in .whl/, unpacked for Python 3.12 in .gpu/site (copy both to the GPU machine with the checkout)"
  exit 0
fi
out=${OUT:-$here/gpu_check_out}
mkdir -p "$out"
has="import importlib.util as u, sys; sys.exit(not all(map(u.find_spec, ('deepspeed', 'hjson', 'pydantic', 'cpuinfo'))))"
if ! "$python" -c "$has" 2>/dev/null; then
  site=/tmp/gpu_check_site
  if [ -d "$here/.gpu/site/deepspeed" ]; then
    site=$here/.gpu/site
  elif ! PYTHONPATH=$site "$python" -c "$has" 2>/dev/null; then
    ls "$here"/.whl/*.whl >/dev/null 2>&1 || { echo "gpu_check: no DeepSpeed here and no wheels in .whl/ (see this file's header)"; exit 2; }
    "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$site" "$here"/.whl/*.whl || exit 2
  fi
  export PYTHONPATH=$site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$here${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/gpu_check_extensions}
"$python" "$here/tools/gpu_check.py" "$call" --out "$out" "$@" 2>&1 | tee -a "$out/$call.log"
exit "${PIPESTATUS[0]}"
