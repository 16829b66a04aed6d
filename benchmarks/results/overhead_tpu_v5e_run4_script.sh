# The device calls of benchmarks/results/overhead_tpu_v5e_run4.txt, run from the repository root with .whl-tpu/, .tpudata/ and .tpurun/
# carried (as for overhead_tpu_v5e_run3_script.sh). tensorstore 0.1.86 is not on that machine's index; the fallback installed its 0.1.85.

# ---- .tpurun/tpu4.sh
#!/usr/bin/env bash
# Overhead on a TPU v5e host (one chip), fourth session: the code with W&B's service on one Go thread, two calls:
#   bash .tpurun/tpu4.sh mlp   # install, versions, overhead.py MLP 1:fp32 (defaults), GOMAXPROCS A/B of the main job
#   bash .tpurun/tpu4.sh gpt   # overhead.py --model gpt 1:fp32
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
  { date -u; nproc; uptime; python3 -c "import sys, jax, flax, optax, orbax.checkpoint as o, numpy, ml_dtypes, wandb, hydra; print(sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'orbax', o.__version__, 'numpy', numpy.__version__, 'ml_dtypes', ml_dtypes.__version__, 'wandb', wandb.__version__, 'hydra', hydra.__version__); d = jax.devices(); print(d, d[0].device_kind)"; } > $OUT/versions.txt 2>&1
  cat $OUT/versions.txt
  timeout 200 python3 benchmarks/overhead.py --setups 1:fp32 --pairs 3 --bare-cache > $OUT/overhead_mlp.txt 2>&1
  echo "overhead mlp rc $?" | tee -a $OUT/overhead_mlp.txt; tail -5 $OUT/overhead_mlp.txt
  # GOMAXPROCS A/B, interleaved, the order alternating: a = Go's default exported (nproc), b = unset (the code's 1)
  n=$(nproc)
  for r in 1 2 3 4 5; do
    if [ $((r % 2)) = 1 ]; then order="a b"; else order="b a"; fi
    for v in $order; do
      if [ $v = a ]; then e="GOMAXPROCS=$n"; else e="UNUSED_AB=1"; fi
      s=$(date +%s.%N)
      env $e WANDB_MODE=offline timeout 60 python3 train.py runtime.cpu_devices=1 precision=fp32 hydra.run.dir=/tmp/ab/$r$v > /tmp/ab_$r$v.log 2>&1
      rc=$?; e2=$(date +%s.%N)
      python3 -c "
import json; s = json.load(open('/tmp/ab/$r$v/summary.json'))
print('$r$v', 'rc $rc', round($e2 - $s, 2), round(s['perf/examples_per_s_median']), round(s['perf/wall_s'], 2), round(s['perf/startup_s'], 2))" | tee -a $OUT/gomaxprocs_ab.txt
    done
  done
else
  timeout 300 python3 benchmarks/overhead.py --model gpt --setups 1:fp32 --pairs 3 --bare-cache \
    > $OUT/overhead_gpt.txt 2>&1; echo "overhead gpt rc $?" | tee -a $OUT/overhead_gpt.txt
  tail -6 $OUT/overhead_gpt.txt
fi
