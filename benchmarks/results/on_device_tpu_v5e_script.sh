#!/usr/bin/env bash
# TPU v5e, sixth session: data.on_device. bash .tpurun/tpu6.sh
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
{ date -u; nproc; uptime; python3 -c "import sys, jax, flax, optax, orbax.checkpoint as o, numpy, wandb, hydra; print(sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'orbax', o.__version__, 'numpy', numpy.__version__, 'wandb', wandb.__version__, 'hydra', hydra.__version__); d = jax.devices(); print(d, d[0].device_kind, d[0].memory_stats()['bytes_limit'])"; } 2>&1 | grep -v -i warn
for od in null false; do
  python3 train.py data.on_device=$od hydra.run.dir=/tmp/runs/smoke_$od 2>&1 | grep -E "start-up|eval/acc|Error" | tail -3
done
python3 - <<'PY'
import json
rows = {}
for od in ("null", "false"):
    s = json.load(open(f"/tmp/runs/smoke_{od}/summary.json"))
    print(od, {k: s.get(k) for k in ("data/on_device", "data/on_device_bytes", "eval/accuracy", "perf/examples_per_s", "mem/peak_bytes_per_device")})
    rows[od] = [(r["step"], r.get("train/loss")) for r in map(json.loads, open(f"/tmp/runs/smoke_{od}/metrics.jsonl")) if "train/loss" in r]
print("per-step losses identical:", rows["null"] == rows["false"], len(rows["null"]))
PY
python3 benchmarks/overhead.py --setups 1:fp32 --pairs 3 --bare-cache --also data.on_device=false 2>&1 | grep -v -i "warn"
