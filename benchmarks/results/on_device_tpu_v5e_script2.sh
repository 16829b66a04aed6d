#!/usr/bin/env bash
# TPU v5e, sixth session, second call: the split's layout padding, every mode with the split on the chip. bash .tpurun/tpu7.sh
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
date -u
python3 - <<'PY'
import jax, numpy as np
d = jax.devices()[0]
def used():
    return d.memory_stats()["bytes_in_use"]
x = np.zeros((60000, 28, 28, 1), np.uint8)
for shape in ((60000, 784), (60000, 28, 28, 1)):
    before = used()
    a = jax.device_put(x.reshape(shape), d); a.block_until_ready()
    print("uint8", shape, "logical bytes", a.nbytes, "device bytes in use added", used() - before)
    del a
PY
for par in jit_sharding pmap fsdp; do
  python3 train.py parallel=$par train.steps=600 checkpoint.enabled=false wandb.mode=disabled hydra.run.dir=/tmp/runs/$par 2>&1 | grep -E "eval/acc|Error|error" | tail -2
  python3 -c "import json; s = json.load(open('/tmp/runs/$par/summary.json')); print('$par', {k: s.get(k) for k in ('status', 'data/on_device', 'data/on_device_bytes', 'eval/accuracy', 'train/loss', 'perf/examples_per_s', 'mem/peak_bytes_per_device')})"
done
