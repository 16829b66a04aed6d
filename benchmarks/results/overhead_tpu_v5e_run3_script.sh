# The device calls of benchmarks/results/overhead_tpu_v5e_run3.txt, run from the repository root with .whl-tpu/ (wheels:
# pip wheel of requirements.txt without jax, jaxlib, numpy, scipy, pyarrow, tensorstore, TFDS, pillow, array_record and the
# development tools), .tpudata/ (MNIST's decoded arrays compressed, TFDS dataset_info.json, Tiny Shakespeare) and .tpurun/
# carried. tensorstore 0.1.86 is not on that machine's index; the fallback installed its 0.1.85.

# ---- .tpurun/tpu.sh
#!/usr/bin/env bash
# Overhead on a TPU v5e host (one chip), third session: the current code re-measured, two device calls:
#   bash .tpurun/tpu.sh mlp   # install, versions, smoke, overhead.py MLP 1:fp32 with the knob variants
#   bash .tpurun/tpu.sh gpt   # overhead.py --model gpt 1:fp32, step_host_cost.py
# Carried: .whl-tpu/ (wheels of the pinned stack without jax, jaxlib, numpy, scipy, tensorstore, TFDS), .tpudata/
# (MNIST's decoded arrays compressed, TFDS dataset_info.json, Tiny Shakespeare). The machine's own jax stays first.
set -u
export PYTHONUNBUFFERED=1
phase=${1:-mlp}
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
  tar --exclude=./.whl-tpu -cf - . | (cd /tmp/w/main && tar xf -)
  cp .tpudata/dataset_info.json /tmp/tfds/mnist/3.0.1/
  cp .tpudata/tiny_shakespeare.txt /tmp/w/shared/data/tiny_shakespeare/input.txt
  cp .tpudata/tiny_shakespeare.txt /tmp/xdg/dp_scaling/tiny_shakespeare/input.txt
  PYTHONPATH=$PYTHONPATH:/tmp/site python3 -c "
import numpy as np
for s in ('train', 'test'):
    with np.load('.tpudata/mnist-%s-compressed.npz' % s) as f:
        np.savez('/tmp/xdg/dp_scaling/mnist-3.0.1-%s.npz' % s, images=f['images'], labels=f['labels'])
" || exit 1
  touch /tmp/site/.done
fi
export PYTHONPATH=${PYTHONPATH:-}:/tmp/site XDG_CACHE_HOME=/tmp/xdg TFDS_DATA_DIR=/tmp/tfds
export WANDB_CONFIG_DIR=/tmp/wandb_cfg WANDB_CACHE_DIR=/tmp/wandb_cache WANDB_DATA_DIR=/tmp/wandb_data
cd /tmp/w/main || exit 1
if [ "$phase" = mlp ]; then
  { date -u; nproc; uptime; python3 -c "import sys, jax, flax, optax, orbax.checkpoint as o, numpy, ml_dtypes, wandb, hydra; print(sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'orbax', o.__version__, 'numpy', numpy.__version__, 'ml_dtypes', ml_dtypes.__version__, 'wandb', wandb.__version__, 'hydra', hydra.__version__); d = jax.devices(); print(d, d[0].device_kind)"
    git -C /tmp/w/main log --oneline -1 2>/dev/null || true; } > $OUT/versions.txt 2>&1
  cat $OUT/versions.txt
  s=$(date +%s.%N)
  WANDB_MODE=offline timeout 120 python3 train.py train.epochs=1 hydra.run.dir=/tmp/smoke > $OUT/smoke.txt 2>&1
  echo "smoke rc $? wall $(python3 -c "print(round($(date +%s.%N)-$s,2))")" | tee -a $OUT/smoke.txt
  grep -E "start-up|eval/accuracy|rror" $OUT/smoke.txt | tail -4
  timeout 420 python3 benchmarks/overhead.py --setups 1:fp32 --pairs 3 --bare-cache --also data.prefetch=0 \
    --also wandb.mode=disabled checkpoint.enabled=false data.prefetch=0 > $OUT/overhead_mlp.txt 2>&1
  echo "overhead mlp rc $?" | tee -a $OUT/overhead_mlp.txt; tail -9 $OUT/overhead_mlp.txt
else
  timeout 260 python3 benchmarks/overhead.py --model gpt --setups 1:fp32 --pairs 3 --bare-cache \
    > $OUT/overhead_gpt.txt 2>&1; echo "overhead gpt rc $?" | tee -a $OUT/overhead_gpt.txt
  tail -6 $OUT/overhead_gpt.txt
  timeout 120 python3 benchmarks/step_host_cost.py > $OUT/step_host_cost.txt 2>&1
  echo "step_host_cost rc $?" | tee -a $OUT/step_host_cost.txt; tail -12 $OUT/step_host_cost.txt
fi
