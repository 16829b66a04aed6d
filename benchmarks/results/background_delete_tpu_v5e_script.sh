# Erratum (2026-12-06, tenth session): the state save_probe.py saves is 8.0 MB (784-512-512-10 parameters and two Adam
# moments: 669,706 x 3 x 4 bytes), not 2.4 MB as written below; the main job's state (784-256-10) is 2.44 MB.
# The device scripts and helpers behind background_delete_tpu_v5e.txt (kept as records; they ran from the repository root
# on the device machine, with .whl-tpu/ (wheels), .tpudata/ (MNIST and Tiny Shakespeare) and .tpurun/ carried).
# save_probe.py printed no process-CPU column in calls 3-4; that column was added afterwards for the CPU machine's run
# (background_delete_cpu.txt).

########## .tpurun/tpu17.sh ##########
#!/usr/bin/env bash
# TPU v5e, ninth session: hook times of b560bb5 (windows shorter than 8 steps copied array by array), the save split into its wait for the previous background write and the rest, and checkpoint.every=0 beside. bash .tpurun/tpu17.sh
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
python3 train.py hydra.run.dir=/tmp/runs/warm > /dev/null 2>&1
for i in 1 2 3; do
  for v in split plain ckpt0; do
    case $v in
      split) env SPLIT_SAVE_WAIT=1 python3 .tpurun/hook_times2.py hydra.run.dir=/tmp/runs/h_${v}_$i ;;
      plain) python3 .tpurun/hook_times2.py hydra.run.dir=/tmp/runs/h_${v}_$i ;;
      ckpt0) python3 .tpurun/hook_times2.py checkpoint.every=0 hydra.run.dir=/tmp/runs/h_${v}_$i ;;
    esac 2>&1 | grep -A14 -E "eval/accuracy=" | grep -v -i warn | sed "s/^/[b560bb5 $v, round $i] /"
  done
done
date -u

########## .tpurun/tpu18.sh ##########
#!/usr/bin/env bash
# TPU v5e, ninth session, second call: orbax saving synchronously (SYNC_SAVE=1: enable_async_checkpointing=False) against the default background write and checkpoint.every=0. bash .tpurun/tpu18.sh
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
python3 train.py hydra.run.dir=/tmp/runs/warm > /dev/null 2>&1
for i in 1 2 3; do
  for v in async sync ckpt0; do
    case $v in
      async) python3 .tpurun/hook_times3.py hydra.run.dir=/tmp/runs/s_${v}_$i ;;
      sync) env SYNC_SAVE=1 python3 .tpurun/hook_times3.py hydra.run.dir=/tmp/runs/s_${v}_$i ;;
      ckpt0) python3 .tpurun/hook_times3.py checkpoint.every=0 hydra.run.dir=/tmp/runs/s_${v}_$i ;;
    esac 2>&1 | grep -A14 -E "eval/accuracy=" | grep -v -i warn | sed "s/^/[b560bb5 $v, round $i] /"
  done
done
date -u

########## .tpurun/tpu19.sh ##########
#!/usr/bin/env bash
# TPU v5e, ninth session, third call: orbax saves of the MLP state alone (sync, async, each without fsync), and where the run folder lives. bash .tpurun/tpu19.sh
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
df -hT /tmp | tail -1; mount | grep -E " /tmp | / " | head -3
python3 .tpurun/save_probe.py sync async sync_nofsync async_nofsync 2>&1 | grep "ms per"
python3 .tpurun/save_probe.py sync_nofsync sync async_nofsync async 2>&1 | grep "ms per"
which strace && strace -f -c -e trace=fsync,fdatasync python3 .tpurun/save_probe.py sync 2>&1 | grep -E "fsync|ms per"
date -u

########## .tpurun/tpu20.sh ##########
#!/usr/bin/env bash
# TPU v5e, ninth session, fourth call: orbax deleting old checkpoints in the background (enable_background_delete=True) against the default, in the save probe and in train.py. bash .tpurun/tpu20.sh
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
python3 .tpurun/save_probe.py async async_bgdel sync sync_bgdel 2>&1 | grep "ms per"
python3 .tpurun/save_probe.py async_bgdel async sync_bgdel sync 2>&1 | grep "ms per"
python3 train.py hydra.run.dir=/tmp/runs/warm > /dev/null 2>&1
for i in 1 2 3; do
  for v in default bgdel ckpt0; do
    case $v in
      default) python3 .tpurun/hook_times4.py hydra.run.dir=/tmp/runs/d_${v}_$i ;;
      bgdel) env BG_DELETE=1 python3 .tpurun/hook_times4.py hydra.run.dir=/tmp/runs/d_${v}_$i ;;
      ckpt0) python3 .tpurun/hook_times4.py checkpoint.every=0 hydra.run.dir=/tmp/runs/d_${v}_$i ;;
    esac 2>&1 | grep -A14 -E "eval/accuracy=" | grep -v -i warn | sed "s/^/[b560bb5 $v, round $i] /"
    ls /tmp/runs/d_${v}_$i/checkpoints | tr '\n' ' '; echo "<- checkpoints kept ($v, round $i)"
  done
done
date -u

########## .tpurun/tpu21.sh ##########
#!/usr/bin/env bash
# TPU v5e, ninth session, fifth call: orbax deleting old steps on its deleter thread (the working tree: enable_background_delete=True) against b560bb5, hook times and whole processes. bash .tpurun/tpu21.sh
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
rm -rf /tmp/w/before && mkdir -p /tmp/w/before && tar xzf .tpurun/before_b560bb5.tar.gz -C /tmp/w/before
cp .tpurun/hook_times2.py /tmp/w/before/.tpurun_hook_times2.py
date -u; uptime
grep -c "enable_background_delete=True" training/checkpoint/store.py /tmp/w/before/training/checkpoint/store.py
echo "== 1: hook times, interleaved: this code (background delete), b560bb5"
python3 train.py hydra.run.dir=/tmp/runs/warm_new > /dev/null 2>&1
for i in 1 2 3; do
  python3 .tpurun/hook_times2.py hydra.run.dir=/tmp/runs/hooks_new_$i 2>&1 | grep -A12 -E "eval/accuracy=" | grep -v -i warn | sed "s/^/[background delete, round $i] /"
  (cd /tmp/w/before && python3 .tpurun_hook_times2.py hydra.run.dir=/tmp/runs/hooks_before_$i 2>&1 | grep -A12 -E "eval/accuracy=" | grep -v -i warn | sed "s/^/[b560bb5, round $i] /")
  ls /tmp/runs/hooks_new_$i/checkpoints /tmp/runs/hooks_before_$i/checkpoints | tr '\n' ' '; echo
done
date -u; uptime
echo "== 2: train.py (background delete) and train.py at b560bb5 against bare with the split on the chip"
python3 benchmarks/overhead.py --setups 1:fp32 --pairs 3 --bare-cache --bare-on-device --before /tmp/w/before 2>&1 | grep -v -i "warn"
date -u

########## .tpurun/hook_times2.py ##########
"""python hook_times2.py <train.py overrides>: train.py with each hook's run() and the timer's pause timed; with
SPLIT_SAVE_WAIT=1 the part of Saver.save spent waiting for the previous save's background write is timed apart."""
import atexit, collections, os, runpy, sys, time

sys.path.insert(0, os.getcwd())

import training.hooks as H

acc = collections.defaultdict(lambda: [0, 0.0])
for cls in (H.WindowLog, H.CheckpointHook, H.FinalEvaluation, H.Evaluation, H.SyncCheck, H.ProfilerHook):
    def run(self, loop, step, _orig=cls.run, _name=cls.__name__):
        t = time.perf_counter()
        try:
            _orig(self, loop, step)
        finally:
            a = acc[_name]; a[0] += 1; a[1] += time.perf_counter() - t
    cls.run = run
_pause = H.StepTimer.pause
def pause(self, last, _orig=_pause):
    t = time.perf_counter(); _orig(self, last); a = acc["StepTimer.pause (wait for the last step)"]; a[0] += 1; a[1] += time.perf_counter() - t
H.StepTimer.pause = pause
import training.checkpoint.store as S
_save = S.Saver.save
def save(self, *a, _orig=_save, **k):
    t = time.perf_counter()
    if os.environ.get("SPLIT_SAVE_WAIT"):  # the wait for the previous save's background write, timed apart
        self.manager.wait_until_finished()
        w = acc["Saver.save: wait for the previous save"]; w[0] += 1; w[1] += time.perf_counter() - t
    try:
        return _orig(self, *a, **k)
    finally:
        x = acc["Saver.save"]; x[0] += 1; x[1] += time.perf_counter() - t
S.Saver.save = save
import training.report as R
_log = R.Reporter.log
def rlog(self, *a, _orig=_log, **k):
    t = time.perf_counter()
    try:
        return _orig(self, *a, **k)
    finally:
        x = acc["Reporter.log"]; x[0] += 1; x[1] += time.perf_counter() - t
R.Reporter.log = rlog

@atexit.register
def report():
    print("hook times (calls, total s, ms per call):", file=sys.stderr)
    for k, (n, t) in acc.items():
        print(f"  {k:<45} {n:5d} {t:8.3f} {1e3 * t / max(n, 1):8.2f}", file=sys.stderr)

sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")

########## .tpurun/hook_times3.py ##########
"""python hook_times2.py <train.py overrides>: train.py with each hook's run() and the timer's pause timed; with
SPLIT_SAVE_WAIT=1 the part of Saver.save spent waiting for the previous save's background write is timed apart; with
SYNC_SAVE=1 orbax saves synchronously (enable_async_checkpointing=False)."""
import atexit, collections, os, runpy, sys, time

sys.path.insert(0, os.getcwd())

import training.hooks as H

acc = collections.defaultdict(lambda: [0, 0.0])
for cls in (H.WindowLog, H.CheckpointHook, H.FinalEvaluation, H.Evaluation, H.SyncCheck, H.ProfilerHook):
    def run(self, loop, step, _orig=cls.run, _name=cls.__name__):
        t = time.perf_counter()
        try:
            _orig(self, loop, step)
        finally:
            a = acc[_name]; a[0] += 1; a[1] += time.perf_counter() - t
    cls.run = run
_pause = H.StepTimer.pause
def pause(self, last, _orig=_pause):
    t = time.perf_counter(); _orig(self, last); a = acc["StepTimer.pause (wait for the last step)"]; a[0] += 1; a[1] += time.perf_counter() - t
H.StepTimer.pause = pause
import training.checkpoint.store as S
_save = S.Saver.save
def save(self, *a, _orig=_save, **k):
    t = time.perf_counter()
    if os.environ.get("SPLIT_SAVE_WAIT"):  # the wait for the previous save's background write, timed apart
        self.manager.wait_until_finished()
        w = acc["Saver.save: wait for the previous save"]; w[0] += 1; w[1] += time.perf_counter() - t
    try:
        return _orig(self, *a, **k)
    finally:
        x = acc["Saver.save"]; x[0] += 1; x[1] += time.perf_counter() - t
S.Saver.save = save
if os.environ.get("SYNC_SAVE"):  # orbax saves synchronously (no background write)
    _init = S.Saver.__init__
    def init(self, directory, keep, async_save=True, _orig=_init):
        _orig(self, directory, keep, async_save=False)
    S.Saver.__init__ = init
import training.report as R
_log = R.Reporter.log
def rlog(self, *a, _orig=_log, **k):
    t = time.perf_counter()
    try:
        return _orig(self, *a, **k)
    finally:
        x = acc["Reporter.log"]; x[0] += 1; x[1] += time.perf_counter() - t
R.Reporter.log = rlog

@atexit.register
def report():
    print("hook times (calls, total s, ms per call):", file=sys.stderr)
    for k, (n, t) in acc.items():
        print(f"  {k:<45} {n:5d} {t:8.3f} {1e3 * t / max(n, 1):8.2f}", file=sys.stderr)

sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")

########## .tpurun/hook_times4.py ##########
"""python hook_times2.py <train.py overrides>: train.py with each hook's run() and the timer's pause timed; with
SPLIT_SAVE_WAIT=1 the part of Saver.save spent waiting for the previous save's background write is timed apart; with
SYNC_SAVE=1 orbax saves synchronously (enable_async_checkpointing=False); with
BG_DELETE=1 orbax deletes old checkpoints in the background (enable_background_delete=True)."""
import atexit, collections, os, runpy, sys, time

sys.path.insert(0, os.getcwd())

import training.hooks as H

acc = collections.defaultdict(lambda: [0, 0.0])
for cls in (H.WindowLog, H.CheckpointHook, H.FinalEvaluation, H.Evaluation, H.SyncCheck, H.ProfilerHook):
    def run(self, loop, step, _orig=cls.run, _name=cls.__name__):
        t = time.perf_counter()
        try:
            _orig(self, loop, step)
        finally:
            a = acc[_name]; a[0] += 1; a[1] += time.perf_counter() - t
    cls.run = run
_pause = H.StepTimer.pause
def pause(self, last, _orig=_pause):
    t = time.perf_counter(); _orig(self, last); a = acc["StepTimer.pause (wait for the last step)"]; a[0] += 1; a[1] += time.perf_counter() - t
H.StepTimer.pause = pause
import training.checkpoint.store as S
_save = S.Saver.save
def save(self, *a, _orig=_save, **k):
    t = time.perf_counter()
    if os.environ.get("SPLIT_SAVE_WAIT"):  # the wait for the previous save's background write, timed apart
        self.manager.wait_until_finished()
        w = acc["Saver.save: wait for the previous save"]; w[0] += 1; w[1] += time.perf_counter() - t
    try:
        return _orig(self, *a, **k)
    finally:
        x = acc["Saver.save"]; x[0] += 1; x[1] += time.perf_counter() - t
S.Saver.save = save
if os.environ.get("SYNC_SAVE"):  # orbax saves synchronously (no background write)
    _init = S.Saver.__init__
    def init(self, directory, keep, async_save=True, _orig=_init):
        _orig(self, directory, keep, async_save=False)
    S.Saver.__init__ = init
if os.environ.get("BG_DELETE"):  # orbax deletes checkpoints beyond max_to_keep on a thread of its own
    import functools
    import orbax.checkpoint as _ocp_mod
    _ocp_mod.CheckpointManagerOptions = functools.partial(_ocp_mod.CheckpointManagerOptions, enable_background_delete=True)
import training.report as R
_log = R.Reporter.log
def rlog(self, *a, _orig=_log, **k):
    t = time.perf_counter()
    try:
        return _orig(self, *a, **k)
    finally:
        x = acc["Reporter.log"]; x[0] += 1; x[1] += time.perf_counter() - t
R.Reporter.log = rlog

@atexit.register
def report():
    print("hook times (calls, total s, ms per call):", file=sys.stderr)
    for k, (n, t) in acc.items():
        print(f"  {k:<45} {n:5d} {t:8.3f} {1e3 * t / max(n, 1):8.2f}", file=sys.stderr)

sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")

########## .tpurun/save_probe.py ##########
"""Times orbax saves of an MLP-sized host state (2.4 MB: 784-512-512-10 params, two Adam moments) through the
repository's Saver: variants sync, async (each save followed by wait_until_finished), and sync_nofsync / async_nofsync
(TensorStore's file_io_sync context option off: its writes are not fsynced), sync_bgdel / async_bgdel (orbax's enable_background_delete). python save_probe.py [variants]"""
import os, sys, time, resource, cProfile, pstats, shutil
sys.path.insert(0, os.getcwd())
import numpy as np
import jax
from training.checkpoint import store as S
from training.checkpoint.store import Saver
class St:  # minimal TrainState-like pytree
    pass
rng = np.random.default_rng(0)
shapes = [(784, 512), (512,), (512, 512), (512,), (512, 10), (10,)]
params = {f"l{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(shapes)}
state = {"params": params, "mu": {k: v * 0 for k, v in params.items()}, "nu": {k: v * 0 for k, v in params.items()}, "step": np.int32(0)}
S._ocp()
from orbax.checkpoint._src.serialization import tensorstore_utils as TU
import tensorstore as ts
_get = TU.get_ts_context
def _nofsync(*a, **k):
    spec = _get(*a, **k).spec.to_json()
    spec["file_io_sync"] = False
    return ts.Context(ts.Context.Spec(spec))
for mode in sys.argv[1:] or ["sync", "async", "sync_nofsync", "async_nofsync"]:
    TU.get_ts_context = _nofsync if mode.endswith("nofsync") else _get
    d = f"/tmp/sv/ck_{mode}"; shutil.rmtree(d, ignore_errors=True)
    sv = Saver(d, keep=3, async_save=not mode.startswith("sync"))
    ocp = S._ocp()
    if "bgdel" in mode:  # orbax's enable_background_delete: old steps deleted on a thread of its own
        sv.manager.close()
        sv.manager = ocp.CheckpointManager(d, item_handlers=S._handlers(), options=ocp.CheckpointManagerOptions(
            max_to_keep=3, create=True, enable_async_checkpointing=not mode.startswith("sync"),
            cleanup_tmp_directories=True, enable_background_delete=True))
    times = []
    cpu0 = time.process_time()
    prof = cProfile.Profile() if os.environ.get("PROF") else None
    for i in range(12):
        t = time.perf_counter()
        if prof and i >= 2: prof.enable()
        sv.manager.save(i, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave({"step": i})), force=True)
        if not mode.startswith("sync"): sv.manager.wait_until_finished()
        if prof and i >= 2: prof.disable()
        times.append(time.perf_counter() - t)
    sv.close()
    cpu_ms = 1e3 * (time.process_time() - cpu0) / len(times)  # every thread, the deletions finished by close included
    print(mode, "ms per save (incl. wait):", " ".join(f"{1e3*x:.0f}" for x in times), "median",
          f"{1e3*sorted(times[2:])[5]:.1f}; process CPU per save, close included: {cpu_ms:.1f} ms")
    if prof:
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
