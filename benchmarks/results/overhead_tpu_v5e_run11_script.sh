#!/usr/bin/env bash
# TPU v5e, eleventh session, fourth call: the four-ratio benchmark at 5765d49 (the current figures): the MLP against the bare script with the split on the chip, and the language model. bash .tpurun/tpu28.sh
set -u
export PYTHONUNBUFFERED=1
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
date -u; uptime
echo "== python benchmarks/overhead.py --setups 1:fp32 --pairs 3 --bare-cache --bare-on-device"
python3 benchmarks/overhead.py --setups 1:fp32 --pairs 3 --bare-cache --bare-on-device 2>&1 | grep -v -i "warn"
date -u; uptime
echo "== python benchmarks/overhead.py --model gpt --setups 1:fp32 --pairs 3 --bare-cache"
python3 benchmarks/overhead.py --model gpt --setups 1:fp32 --pairs 3 --bare-cache 2>&1 | grep -v -i "warn"
date -u

# second call, on the same warm machine (the language model again, from the folder beside which ../shared/data/tiny_shakespeare was prepared):
# export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-}:/tmp/site XDG_CACHE_HOME=/tmp/xdg TFDS_DATA_DIR=/tmp/tfds WANDB_CONFIG_DIR=/tmp/wandb_cfg WANDB_CACHE_DIR=/tmp/wandb_cache WANDB_DATA_DIR=/tmp/wandb_data
# rm -rf /tmp/w/main && mkdir -p /tmp/w/main && tar --exclude=./.whl-tpu --exclude=./.tpudata -cf - . | (cd /tmp/w/main && tar xf -) && cd /tmp/w/main
# python3 benchmarks/overhead.py --model gpt --setups 1:fp32 --pairs 3 --bare-cache
