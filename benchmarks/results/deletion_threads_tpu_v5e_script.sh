# The device scripts and helpers behind deletion_threads_tpu_v5e.txt (kept as records; they ran from the repository root
# on the device machine, with .whl-tpu/ (wheels), .tpudata/ (MNIST and Tiny Shakespeare) and .tpurun/ carried).
# In call 2 benchmarks/checkpoint_delete.py's mlp_state() had shapes [(784, 512), (512,), (512, 512), (512,), (512, 10),
# (10,)] (8.0 MB with the two moments); call 4 ran it as committed (784-256-10, 2.44 MB).
# save_probe.py's docstring below says 2.4 MB: its state is that same 8.0 MB one.

########## .tpurun/tpu22.sh ##########
#!/usr/bin/env bash
# TPU v5e, tenth session, first call: the checkpoint every epoch with the run folder on the host's 9p root against a
# tmpfs (/dev/shm), the code of 4a835dc. bash .tpurun/tpu22.sh
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
export WANDB_CONFIG_DIR=/tmp/wandb_cfg WANDB_CACHE_DIR=/tmp/wandb_cache WANDB_DATA_DIR=/tmp/wandb_data WANDB_MODE=offline
cd /tmp/w/main || exit 1
echo "code 4a835dc, working tree clean but for .tpurun"
date -u; uptime
df -hT / /tmp /dev/shm 2>&1 | sed 's/^/[df] /'; mount | grep -E " / | /dev/shm | /tmp " | sed 's/^/[mount] /'
SHM=/dev/shm/dp; mkdir -p $SHM || exit 1
echo "== 0: save probe (save then wait, 12 saves of the MLP's 2.4 MB state, keep=3): 9p root against tmpfs"
for r in 1 2; do
  SV_DIR=/tmp/sv python3 .tpurun/save_probe.py sync async 2>&1 | grep "ms per" | sed "s/^/[9p, round $r] /"
  SV_DIR=$SHM/sv python3 .tpurun/save_probe.py sync async 2>&1 | grep "ms per" | sed "s/^/[tmpfs, round $r] /"
done
span() { python3 -c "
import json,sys; s=json.load(open(sys.argv[1]+'/summary.json'))
print(f\"first step to end {s['perf/wall_s']-s['perf/startup_s']:.3f} s, wall {s['perf/wall_s']:.3f} s, startup {s['perf/startup_s']:.3f} s, {s.get('status')}\")" "$1"; }
echo "== 1: train.py defaults (1 TPU, fp32, 10 epochs, W&B offline) with the run folder on 9p / tmpfs, and checkpoint.every=0 on 9p, interleaved"
python3 train.py hydra.run.dir=/tmp/runs/warm > /dev/null 2>&1
for i in 1 2 3; do
  for v in 9p tmpfs 9p_ckpt0; do
    case $v in 9p) d=/tmp/runs/a_$i; x=;; tmpfs) d=$SHM/runs/a_$i; x=;; 9p_ckpt0) d=/tmp/runs/c_$i; x=checkpoint.every=0;; esac
    SPLIT_SAVE_WAIT=1 python3 .tpurun/hook_times2.py hydra.run.dir=$d $x 2>&1 | grep -E "eval/accuracy=|Saver.save|WindowLog|CheckpointHook" | grep -v -i warn | sed "s/^/[$v, round $i] /"
    echo "[$v, round $i] $(span $d)"
  done
done
date -u; uptime
echo "== 2: overhead.py with every run folder and cache on tmpfs (TMPDIR=$SHM/oh)"
mkdir -p $SHM/oh
TMPDIR=$SHM/oh python3 benchmarks/overhead.py --setups 1:fp32 --pairs 3 --bare-cache --bare-on-device --also checkpoint.every=0 2>&1 | grep -v -i "warn"
date -u; uptime

########## .tpurun/tpu23.sh ##########
#!/usr/bin/env bash
# TPU v5e, tenth session, second call: Saver with one deletion thread (orbax's num_deletion_threads=1; the working tree)
# against 4a835dc (orbax's default: min(16, 13 // 2) = 6 threads on this host). bash .tpurun/tpu23.sh
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
export WANDB_CONFIG_DIR=/tmp/wandb_cfg WANDB_CACHE_DIR=/tmp/wandb_cache WANDB_DATA_DIR=/tmp/wandb_data WANDB_MODE=offline
cd /tmp/w/main || exit 1
echo "code: the working tree of 4a835dc + num_deletion_threads=1 in training/checkpoint/store.py; before: 4a835dc"
rm -rf /tmp/w/before && mkdir -p /tmp/w/before && tar xzf .tpurun/before_4a835dc.tar.gz -C /tmp/w/before
cp .tpurun/hook_times2.py /tmp/w/before/.tpurun_hook_times2.py
grep -c "num_deletion_threads=1" training/checkpoint/store.py /tmp/w/before/training/checkpoint/store.py
date -u; uptime
SHM=/dev/shm/dp; mkdir -p $SHM/cd
echo "== 1: python benchmarks/checkpoint_delete.py --rounds 3, on the 9p root (/tmp) and on tmpfs (/dev/shm)"
python3 benchmarks/checkpoint_delete.py --rounds 3 --dir /tmp/cd 2>&1 | grep -v -i warn | sed "s/^/[9p] /"
python3 benchmarks/checkpoint_delete.py --rounds 3 --dir $SHM/cd 2>&1 | grep -v -i warn | sed "s/^/[tmpfs] /"
span() { python3 -c "
import json,sys; s=json.load(open(sys.argv[1]+'/summary.json'))
print(f\"first step to end {s['perf/wall_s']-s['perf/startup_s']:.3f} s, wall {s['perf/wall_s']:.3f} s, startup {s['perf/startup_s']:.3f} s, {s.get('status')}\")" "$1"; }
echo "== 2: train.py defaults (1 TPU, fp32, 10 epochs, W&B offline, a checkpoint every epoch), this code and 4a835dc interleaved"
python3 train.py hydra.run.dir=/tmp/runs/warm_new > /dev/null 2>&1
(cd /tmp/w/before && python3 train.py hydra.run.dir=/tmp/runs/warm_before > /dev/null 2>&1)
for i in 1 2 3; do
  for v in new before; do
    d=/tmp/runs/${v}_$i
    if [ $v = new ]; then SPLIT_SAVE_WAIT=1 python3 .tpurun/hook_times2.py hydra.run.dir=$d > /tmp/runs/${v}_$i.log 2>&1
    else (cd /tmp/w/before && SPLIT_SAVE_WAIT=1 python3 .tpurun_hook_times2.py hydra.run.dir=$d > /tmp/runs/${v}_$i.log 2>&1); fi
    grep -E "eval/accuracy=|Saver.save|WindowLog|CheckpointHook" /tmp/runs/${v}_$i.log | grep -v -i warn | sed "s/^/[$v, round $i] /"
    echo "[$v, round $i] $(span $d); step folders left: $(ls $d/checkpoints | tr '\n' ' ')"
  done
done
date -u; uptime
echo "== 3: python benchmarks/overhead.py --setups 1:fp32 --pairs 3 --bare-cache --bare-on-device --before /tmp/w/before (run folders on the 9p root)"
python3 benchmarks/overhead.py --setups 1:fp32 --pairs 3 --bare-cache --bare-on-device --before /tmp/w/before 2>&1 | grep -v -i "warn"
date -u; uptime

########## .tpurun/tpu24.sh ##########
#!/usr/bin/env bash
# TPU v5e, tenth session, third call: what the periodic checkpoints still cost with one deletion thread (the working tree): defaults against checkpoint.every=0, interleaved. bash .tpurun/tpu24.sh
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
export WANDB_CONFIG_DIR=/tmp/wandb_cfg WANDB_CACHE_DIR=/tmp/wandb_cache WANDB_DATA_DIR=/tmp/wandb_data WANDB_MODE=offline
cd /tmp/w/main || exit 1
echo "code: the working tree of 4a835dc + num_deletion_threads=1 in training/checkpoint/store.py"
date -u; uptime
span() { python3 -c "
import json,sys; s=json.load(open(sys.argv[1]+'/summary.json'))
print(f\"first step to end {s['perf/wall_s']-s['perf/startup_s']:.3f} s, wall {s['perf/wall_s']:.3f} s, startup {s['perf/startup_s']:.3f} s, {s.get('status')}\")" "$1"; }
echo "== train.py defaults and checkpoint.every=0 (1 TPU, fp32, 10 epochs, W&B offline), interleaved, run folders on the 9p root"
mkdir -p /tmp/runs3; python3 train.py hydra.run.dir=/tmp/runs3/warm > /dev/null 2>&1
for i in 1 2 3; do
  for v in defaults ckpt0; do
    d=/tmp/runs3/${v}_$i; x=; [ $v = ckpt0 ] && x=checkpoint.every=0
    SPLIT_SAVE_WAIT=1 python3 .tpurun/hook_times2.py hydra.run.dir=$d $x > $d.log 2>&1
    grep -E "eval/accuracy=|Saver.save|WindowLog|CheckpointHook" $d.log | grep -v -i warn | sed "s/^/[$v, round $i] /"
    echo "[$v, round $i] $(span $d); step folders left: $(ls $d/checkpoints | tr '\n' ' ')"
  done
done
date -u; uptime

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
    d = os.path.join(os.environ.get("SV_DIR", "/tmp/sv"), f"ck_{mode}"); shutil.rmtree(d, ignore_errors=True)
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

########## .tpurun/tpu25.sh ##########
#!/usr/bin/env bash
# TPU v5e, tenth session, fourth call: benchmarks/checkpoint_delete.py again with the main job's real state (784-256-10 MLP and two Adam moments, 2.44 MB; the second call saved an 8.0 MB 784-512-512-10 state). bash .tpurun/tpu25.sh
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
export WANDB_CONFIG_DIR=/tmp/wandb_cfg WANDB_CACHE_DIR=/tmp/wandb_cache WANDB_DATA_DIR=/tmp/wandb_data WANDB_MODE=offline
cd /tmp/w/main || exit 1
echo "code: the working tree of 870d9d2.. (Saver with num_deletion_threads=1; checkpoint_delete.py with the 2.44 MB state)"
date -u; uptime
SHM=/dev/shm/dp; mkdir -p $SHM/cd
echo "== python benchmarks/checkpoint_delete.py --rounds 3, on the 9p root (/tmp) and on tmpfs (/dev/shm)"
python3 benchmarks/checkpoint_delete.py --rounds 3 --dir /tmp/cd 2>&1 | grep -v -i warn | sed "s/^/[9p] /"
python3 benchmarks/checkpoint_delete.py --rounds 3 --dir $SHM/cd 2>&1 | grep -v -i warn | sed "s/^/[tmpfs] /"
date -u
