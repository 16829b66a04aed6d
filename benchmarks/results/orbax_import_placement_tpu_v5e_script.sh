#!/usr/bin/env bash
# TPU v5e, eleventh session, third device call: A/B/C of where orbax's import starts (A HEAD: before the data read; B: after it; C: beside the chip start), with the bare script (split on the chip) in each round. bash .tpurun/tpu27.sh
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
for v in a c; do rm -rf /tmp/w/$v && mkdir -p /tmp/w/$v && tar xzf .tpurun/ab_$v.tar.gz -C /tmp/w/$v; done
rm -rf /tmp/w/b && mkdir -p /tmp/w/b && cp -r /tmp/w/main/. /tmp/w/b/
grep -n "preload_orbax()" /tmp/w/a/training/prepare.py /tmp/w/b/training/prepare.py; grep -c "EXPERIMENT C" /tmp/w/c/train.py
date -u; uptime
mkdir -p /tmp/runs
for v in a b c; do (cd /tmp/w/$v && python3 train.py hydra.run.dir=/tmp/runs/warm_$v > /dev/null 2>&1; echo "warm $v rc $?"); done
python3 benchmarks/bare_train.py --devices 1 --on-device --compilation-cache /tmp/bare_cache > /dev/null 2>&1; echo "bare warm rc $?"
one() {  # variant round
  v=$1; i=$2
  if [ $v = bare ]; then
    s=$(date +%s.%N)
    python3 benchmarks/bare_train.py --devices 1 --on-device --compilation-cache /tmp/bare_cache --timings /tmp/runs/bare_$i.json > /dev/null 2>&1
    e=$(date +%s.%N)
    python3 -c "import json; t=json.load(open('/tmp/runs/bare_$i.json')); print('[bare, round $i] wall %.2f s, first step %.2f s (from its T0), end %.2f s, steady %.0f' % ($e-$s, t['first_step'], t['end'], t['window_examples_per_s_median']))"
  else
    s=$(date +%s.%N)
    (cd /tmp/w/$v && python3 train.py hydra.run.dir=/tmp/runs/${v}_$i 2>&1 | grep "start-up" | sed "s/.*start-up/[$v, round $i] start-up/")
    e=$(date +%s.%N)
    python3 -c "import json; t=json.load(open('/tmp/runs/${v}_$i/summary.json')); print('[$v, round $i] wall %.2f s, startup_s %.2f, wall_s %.2f, first step to end %.2f, steady %.0f' % ($e-$s, t['perf/startup_s'], t['perf/wall_s'], t['perf/wall_s']-t['perf/startup_s'], t['perf/examples_per_s']))"
  fi
}
for i in 1 2 3 4; do
  if [ $((i % 2)) = 1 ]; then order="a b c bare"; else order="bare c b a"; fi
  for v in $order; do one $v $i; done
done
date -u
