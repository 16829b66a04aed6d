#!/usr/bin/env bash
# Runs one benchmark, or train.py, on a borrowed TPU machine (one TPU v5e chip), from the repository root copy there:
#
#   bash benchmarks/device/run.sh <benchmark> [args...]     # benchmarks/<benchmark>.py
#   bash benchmarks/device/run.sh benchmarks/foo.py [args...] | train.py [overrides...]
#
# First, here: bash benchmarks/device/prepare.sh (fills the git-ignored .whl-tpu/ and .device-data/). Then the
# device tool, e.g.:
#   run(command="bash benchmarks/device/run.sh accelerator --part steps", carry=[".whl-tpu", ".device-data"])
#
# What it does there: installs the carried wheels (and tensorstore, from that machine's own index) into /tmp/site
# once per wheel set (a warm machine's next call skips it) and adds it to PYTHONPATH; puts Tiny Shakespeare where
# data/text.py and benchmarks/bare_gpt.py look (../shared/data/tiny_shakespeare/input.txt beside the repository;
# when that folder cannot be written, the run happens in a copy at /tmp/w/main) and in the data cache, and MNIST's
# decoded arrays in the data cache ($XDG_CACHE_HOME/dp_scaling, TFDS_DATA_DIR for their version); W&B disabled
# (WANDB_MODE=disabled; no sockets there). Output, stdout and stderr together, goes to the terminal and to
# $OUT/<name>_<kind>.txt (kind: $DEVICE_KIND, default tpu_v5e; without $OUT: $DEVICE_OUT, default ./device_out;
# a name already there gets _2, _3, ...).
# Exits with the benchmark's status. Environment: DEVICE_SITE (/tmp/site), DEVICE_KIND, DEVICE_OUT.
set -euo pipefail
[ $# -ge 1 ] || { sed -n '2,5p' "$0" >&2; exit 2; }
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd "$REPO"
case $1 in
  *.py) script=$1 ;;
  *) script=benchmarks/$1.py ;;
esac
shift
[ -f "$script" ] || { echo "error: $script not found in $REPO" >&2; exit 2; }
out=${OUT:-${DEVICE_OUT:-$REPO/device_out}}
mkdir -p "$out" && out=$(cd "$out" && pwd)
base=$out/$(basename "$script" .py)_${DEVICE_KIND:-tpu_v5e}
log=$base.txt n=1
while [ -e "$log" ]; do n=$((n + 1)) && log=${base}_$n.txt; done
[ -d .whl-tpu ] || { echo "error: no .whl-tpu/: run benchmarks/device/prepare.sh here, carry it" >&2; exit 2; }

main() {  # (not indented) the steps below, in a subshell whose output is logged
set -euo pipefail
# ---- packages, once per wheel set (the marker names the set's hash)
SITE=${DEVICE_SITE:-/tmp/site}
marker=$SITE/.installed-$(printf '%s\n' .whl-tpu/*.whl | sha256sum | cut -c1-16)
if [ ! -f "$marker" ]; then
  t0=$SECONDS
  rm -rf "$SITE"
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target "$SITE" .whl-tpu/*.whl
  ok=1
  if ! ls .whl-tpu/tensorstore-*.whl > /dev/null 2>&1; then  # not carried (~20 MB): from that machine's index
    ts() { PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-deps --no-compile --no-cache-dir \
      --upgrade --only-binary=:all: --index-url file:///opt/pypi/simple --target "$SITE" "$@"; }
    ts tensorstore==0.1.86 2> /dev/null || ts tensorstore \
      || { ok=0; echo "run.sh: warning: no tensorstore; orbax checkpoints fail (checkpoint.enabled=false)"; }
  fi
  [ $ok = 1 ] && touch "$marker"
  dists=("$SITE"/*.dist-info) && dists=("${dists[@]##*/}")
  echo "run.sh: installed ${#dists[@]} packages into $SITE in $((SECONDS - t0)) s:" "${dists[@]%.dist-info}"
else
  echo "run.sh: packages already in $SITE ($(basename "$marker"))"
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$SITE

# ---- data
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/xdg}
cache=$XDG_CACHE_HOME/dp_scaling
text=.device-data/tiny_shakespeare/input.txt
[ -d .device-data ] || echo "run.sh: note: no .device-data/ carried: no Tiny Shakespeare, no MNIST"
if [ -f "$text" ]; then
  mkdir -p "$cache/tiny_shakespeare"
  [ -s "$cache/tiny_shakespeare/input.txt" ] || cp -f "$text" "$cache/tiny_shakespeare/input.txt"
  workdir=$REPO
  if [ ! -f ../shared/data/tiny_shakespeare/input.txt ]; then
    if mkdir -p ../shared/data/tiny_shakespeare 2> /dev/null && cp -f "$text" ../shared/data/tiny_shakespeare/; then
      echo "run.sh: Tiny Shakespeare at $(cd .. && pwd)/shared/data/tiny_shakespeare/input.txt"
    else  # the parent folder is not writable: run in a copy beside a shared/ of its own
      workdir=/tmp/w/main
      rm -rf /tmp/w/main && mkdir -p /tmp/w/main /tmp/w/shared/data/tiny_shakespeare
      cp -f "$text" /tmp/w/shared/data/tiny_shakespeare/
      tar --exclude=./.whl-tpu --exclude=./.device-data --exclude=./.git --exclude=./device_out -cf - . \
        | tar -xf - -C /tmp/w/main
      echo "run.sh: $(cd .. && pwd) is not writable; running in a copy at /tmp/w/main"
    fi
  fi
fi
if [ -f .device-data/mnist-3.0.1-train.npz ]; then
  export TFDS_DATA_DIR=${TFDS_DATA_DIR:-$REPO/.device-data/tensorflow_datasets}
  for split in train test; do
    [ -s "$cache/mnist-3.0.1-$split.npz" ] || python3 -c "
import os, sys, numpy as np
src, dst = sys.argv[1:]
with np.load(src) as f:  # stored uncompressed, as train.py writes it (its load time is then the usual one)
    np.savez(dst + '.tmp.npz', images=f['images'], labels=f['labels'])
os.replace(dst + '.tmp.npz', dst)" ".device-data/mnist-3.0.1-$split.npz" "$cache/mnist-3.0.1-$split.npz"
  done
fi
cd "${workdir:-$REPO}"

# ---- run
export PYTHONUNBUFFERED=1 WANDB_MODE=disabled WANDB_SILENT=true WANDB_DIR=/tmp/wandb
export WANDB_CONFIG_DIR=/tmp/wandb/config WANDB_CACHE_DIR=/tmp/wandb/cache WANDB_DATA_DIR=/tmp/wandb/data
echo "run.sh: $(date -u +%FT%TZ) ${HOSTNAME:-} in $PWD: python3 $script $*"
python3 "$script" "$@"
}

set +e
main "$@" 2>&1 | tee "$log"  # stdout and stderr together, to the terminal and the log
status=${PIPESTATUS[0]}
echo "run.sh: exit status $status; log $log" | tee -a "$log"
exit "$status"
