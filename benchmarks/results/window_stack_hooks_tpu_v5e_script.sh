#!/usr/bin/env bash
# TPU v5e, eighth session, second call: hook times, the window stacked on the device against ae7a839, 4 interleaved rounds. bash .tpurun/tpu14.sh
set -u
export PYTHONUNBUFFERED=1
phase=${1:-trace}
if [ ! -f /tmp/site/.done ]; then
  t0=$(date +%s)
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl-tpu/*.whl || exit 1
  PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-deps --no-compile --only-binary=:all: \
    --index-url file:///opt/pypi/simple --target /tmp/site tensorstore==0.1.86 \
  || PIP_CONFIG_FILE=/dev/null python3 -m pip install --isolated -q --no-deps --no-compile --only-binary=:all: \
    --index-url file:///opt/pypi/simple --target /tmp/site tensorstore || exit 1
  echo "install $(( $(date +%s) - t0 )) s"
  mkdir -p /tmp/w/main /tmp/w/shared/data/tiny_shakespeare /tmp/xdg/dp_scaling/tiny_shakespeare /tmp/tfds/mnist/3.0.1
  cp .tpudata/dataset_info.json /tmp/tfds/mnist/3.0.1/
  cp .tpudata/tiny_shakespeare.txt /tmp/w/shared/data/tiny_shakespeare/input.txt
  cp .tpudata/tiny_shakespeare.txt /tmp/xdg/dp_scaling/tiny_shakespeare/input.txt
  PYTHONPATH=${PYTHONPATH:-}:/tmp/site python3 -c "
import numpy as np
for s in ('train', 'test'):
    with np.load('.tpudata/mnist-%s-compressed.npz' % s) as f:
        np.savez('/tmp/xdg/dp_scaling/mnist-3.0.1-%s.npz' % s, images=f['images'], labels=f['labels'])
" || exit 1
  touch /tmp/site/.done
fi
rm -rf /tmp/w/main && mkdir -p /tmp/w/main && tar --exclude=./.whl-tpu --exclude=./.tpudata -cf - . | (cd /tmp/w/main && tar xf -)
export PYTHONPATH=${PYTHONPATH:-}:/tmp/site XDG_CACHE_HOME=/tmp/xdg TFDS_DATA_DIR=/tmp/tfds
export WANDB_CONFIG_DIR=/tmp/wandb_cfg WANDB_CACHE_DIR=/tmp/wandb_cache WANDB_DATA_DIR=/tmp/wandb_data WANDB_MODE=offline
cd /tmp/w/main || exit 1
rm -rf /tmp/w/before && mkdir -p /tmp/w/before && tar xzf .tpurun/before.tar.gz -C /tmp/w/before
cp .tpurun/hook_times.py /tmp/w/before/.tpurun_hook_times.py
date -u; uptime
echo "== warm-up, not counted: one train.py run of each code (fills the compilation cache)"
python3 train.py hydra.run.dir=/tmp/runs/warm_new > /dev/null 2>&1
(cd /tmp/w/before && python3 train.py hydra.run.dir=/tmp/runs/warm_before > /dev/null 2>&1)
echo "== hook times, 4 interleaved rounds (odd rounds ae7a839 first): this code (window stacked on the device) and ae7a839 (a copy per array)"
new() { python3 .tpurun/hook_times.py hydra.run.dir=/tmp/runs/hooks_new_$1 2>&1 | grep -A12 -E "eval/accuracy=" | grep -v -i warn | sed "s/^/[this code, round $1] /"; }
old() { (cd /tmp/w/before && python3 .tpurun_hook_times.py hydra.run.dir=/tmp/runs/hooks_before_$1 2>&1 | grep -A12 -E "eval/accuracy=" | grep -v -i warn | sed "s/^/[ae7a839, round $1] /"); }
for i in 1 2 3 4; do
  if [ $((i % 2)) = 1 ]; then old $i; new $i; else new $i; old $i; fi
done
date -u
