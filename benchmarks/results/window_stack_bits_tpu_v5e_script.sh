#!/usr/bin/env bash
# TPU v5e, eighth session, third call: window_to_host with floats stacked as their bits: bitwise check and step_host_cost.py. bash .tpurun/tpu15.sh
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
date -u
echo "== 1: bitwise check of window_to_host on the TPU"
python3 .tpurun/bits_probe.py 2>&1 | grep -v -i warn
echo "== 2: step_host_cost.py (window rows: stacked / one device_get / per step)"
python3 benchmarks/step_host_cost.py 2>&1 | grep -v -i warn
date -u
