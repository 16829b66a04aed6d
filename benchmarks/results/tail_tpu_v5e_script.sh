#!/usr/bin/env bash
# TPU v5e, seventh session, third call: where the time after the first step goes (train.log timestamps). bash .tpurun/tpu11.sh
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
date -u; uptime
cat > /tmp/tail.py <<'PY'
import datetime, json, re, sys
run, t0, t1 = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
def ts(line):
    m = re.match(r"\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]", line)
    return datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").replace(tzinfo=datetime.timezone.utc).timestamp() if m else None
lines = open(f"{run}/train.log").read().splitlines()
s = json.load(open(f"{run}/summary.json"))
marks = {}
for line in lines:
    t = ts(line)
    if t is None: continue
    if "start-up" in line and "first_step" in line: marks.setdefault("first step dispatched (start-up line)", t)
    if "checkpoint of step" in line and "(periodic)" in line: marks.setdefault("periodic checkpoints", []).append(t)
    if re.search(r"step (\d+)/\1 ", line): marks["last window line"] = t
    if "(final)" in line: marks["final checkpoint line"] = t
    if "eval/accuracy=" in line: marks["final line"] = t
print(f"{run}: wall {t1 - t0:.2f} s, startup_s {s.get('perf/startup_s'):.2f}, examples/s {s.get('perf/examples_per_s'):.0f}, eval {s.get('eval/accuracy')}")
prev = t0
for k, v in marks.items():
    if isinstance(v, list):
        print(f"  {k}: {len(v)} at +{', +'.join(f'{x - t0:.2f}' for x in v)}")
        continue
    print(f"  {k}: +{v - t0:.3f} s (since the previous mark {v - prev:.3f} s)"); prev = v
print(f"  exit: +{t1 - t0:.3f} s (since the previous mark {t1 - prev:.3f} s)")
if "last window line" in marks and "first step dispatched (start-up line)" in marks:
    loop_s = marks["last window line"] - marks["first step dispatched (start-up line)"]
    steps_s = s["train/steps"] * s["train/global_batch"] / s["perf/examples_per_s"]
    print(f"  first step -> last window {loop_s:.2f} s, of which the steps at the median window rate {steps_s:.2f} s: {loop_s - steps_s:.2f} s else (logging windows, checkpoints, the first window's wait)")
PY
python3 train.py hydra.run.dir=/tmp/runs/warm > /dev/null 2>&1
for v in "a" "b"; do
  for extra in "" "wandb.mode=disabled checkpoint.every=0"; do
    name=/tmp/runs/tail_${v}_$(echo "$extra" | tr -c 'a-z0-9' '_')
    t0=$(date +%s.%N); python3 train.py hydra.run.dir=$name $extra > /dev/null 2>&1; t1=$(date +%s.%N)
    python3 /tmp/tail.py $name $t0 $t1
  done
  t0=$(date +%s.%N); python3 benchmarks/bare_train.py --devices 1 --on-device --compilation-cache /tmp/bare_cc --timings /tmp/bare_$v.json > /dev/null 2>&1; t1=$(date +%s.%N)
  python3 -c "
import json; m = json.load(open('/tmp/bare_$v.json')); t0 = $t0
print('bare --on-device: wall %.2f s; marks since the script started:' % ($t1 - t0), ', '.join('%s %.2f' % (k, v) for k, v in m.items() if not k.startswith('epoch_') and isinstance(v, float) and v < 1e6))"
done
date -u
