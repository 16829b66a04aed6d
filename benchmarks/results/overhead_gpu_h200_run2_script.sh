# The two device calls of benchmarks/results/overhead_gpu_h200_run2.txt, as run (from .gpurun/ in the repository root, with
# .whl/ (wheels), .gpudata/ (MNIST cache, compressed; TFDS dataset_info.json) and, for call 2, .before/ (a git worktree of 907671d) carried).

# ---- call 1: bash .gpurun/ckpt.sh
#!/usr/bin/env bash
# Where a checkpoint every epoch goes on a GPU host (prepared for one device call).
set -u
export PYTHONUNBUFFERED=1
[ -n "${SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${SKIP_INSTALL:+x} || exit 1
export XDG_CACHE_HOME=/tmp/xdg WANDB_MODE=disabled TFDS_DATA_DIR=/tmp/tfds
mkdir -p /tmp/xdg/dp_scaling /tmp/tfds/mnist/3.0.1
cp .gpudata/dataset_info.json /tmp/tfds/mnist/3.0.1/
python3 -c "
import numpy as np
for s in ('train', 'test'):
    with np.load('.gpudata/mnist-%s-compressed.npz' % s) as f:
        np.savez('/tmp/xdg/dp_scaling/mnist-3.0.1-%s.npz' % s, images=f['images'], labels=f['labels'])
"
{ date -u; nproc; uptime; python3 -c "import sys, jax, orbax.checkpoint as o; print(sys.version.split()[0], jax.__version__, o.__version__, jax.devices())"; } 2>&1 | tee $OUT/versions.txt
N=${EPOCHS:-30}; E="train.epochs=$N wandb.mode=disabled"
timeout 60 python3 train.py train.epochs=1 hydra.run.dir=/tmp/warm > $OUT/warm.txt 2>&1; echo "warm rc $?"
timeout 60 python3 benchmarks/bare_train.py --devices 1 --epochs 1 --compilation-cache /tmp/bc > /dev/null 2>&1; echo "bare warm rc $?"
for i in 1 2 3; do
  for v in default every0; do
    X=""; [ $v = every0 ] && X="checkpoint.every=0"
    rm -rf /tmp/r; s=$(date +%s.%N)
    TIMED_TRAIN_OUT=$OUT/tt_${v}_$i.json timeout 90 python3 .gpurun/tt.py $E $X hydra.run.dir=/tmp/r > $OUT/log_${v}_$i.txt 2>&1; rc=$?
    e=$(date +%s.%N); echo "$v $i rc $rc wall $(python3 -c "print(round($e-$s,2))") $(grep -o 'start-up [0-9.]* s' $OUT/log_${v}_$i.txt) $(grep -o 'examples/s=[0-9]* (median' $OUT/log_${v}_$i.txt)" | tee -a $OUT/walls.txt
    cp /tmp/r/summary.json $OUT/summary_${v}_$i.json 2>/dev/null
  done
  s=$(date +%s.%N); timeout 60 python3 benchmarks/bare_train.py --devices 1 --epochs $N --compilation-cache /tmp/bc --timings /tmp/bare.json > /dev/null 2>&1; e=$(date +%s.%N)
  echo "bare $i wall $(python3 -c "print(round($e-$s,2))") $(cat /tmp/bare.json)" | tee -a $OUT/walls.txt
done
python3 .gpurun/summ.py $OUT/tt_*.json | tee $OUT/regions.txt
timeout 90 python3 -m pyinstrument -i 0.001 -o $OUT/pyinst_default.txt train.py $E hydra.run.dir=/tmp/p1 > /dev/null 2>&1; echo "pyinstrument rc $?"
timeout 90 python3 -m pyinstrument -i 0.001 -o $OUT/pyinst_every0.txt train.py $E checkpoint.every=0 hydra.run.dir=/tmp/p2 > /dev/null 2>&1; echo "pyinstrument rc $?"
timeout 100 python3 benchmarks/checkpoint_save.py --saves 10 --setups mlp:1 > $OUT/checkpoint_save.txt 2>&1; echo "checkpoint_save rc $?"; tail -4 $OUT/checkpoint_save.txt

# ---- .gpurun/tt.py (the timing wrapper of call 1)
# """benchmarks/timed_train.py with the checkpoint save's pieces timed too (scratch, GPU diagnosis)."""
# import os, sys
# sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
# import timed_train as tt
# tt.TARGETS += [
#     ("training.checkpoint.store", "finite_flags", "save: NaN guard"),
#     ("training.checkpoint.store", "host_form", "save: host copy"),
#     ("orbax.checkpoint.checkpoint_manager", "CheckpointManager.save", "save: orbax manager.save"),
#     ("orbax.checkpoint.checkpoint_manager", "CheckpointManager.wait_until_finished", "orbax wait_until_finished"),
#     ("training.checkpoint.run_checkpoints", "RunCheckpoints.close", "checkpoint wait + close (end)"),
# ]
# tt.main()

# ---- .gpurun/summ.py (prints one line per wrapper JSON)
# import json, sys
# for p in sys.argv[1:]:
#     d = json.load(open(p)); r = d["regions_s"]
#     wall = d["end_epoch_s"] - d["t0_epoch_s"]
#     keys = ["training loop", "checkpoint saves (blocking part)", "save: NaN guard", "save: host copy", "save: orbax manager.save", "checkpoint wait + close (end)", "orbax wait_until_finished", "logging windows (device->host)", "evaluation", "train.py (other: hydra, loop steps, Python)"]
#     print(p.split("/")[-1], f"wall_in_process {wall:.2f}", " | ".join(f"{k.split('(')[0].strip()} {r.get(k, 0):.3f}" for k in keys),
#           "| bg", {k: round(v, 3) for k, v in d.get("background_regions_s", {}).items()})

# ---- call 2: bash .gpurun/ab.sh
#!/usr/bin/env bash
# A/B on a GPU host: the current code against .before (907671d), W&B disabled (no wandb there), 30 and 10 epochs.
set -u
export PYTHONUNBUFFERED=1
[ -n "${SKIP_INSTALL:-}" ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site${SKIP_INSTALL:+x} || exit 1
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-/tmp/xdg} WANDB_MODE=disabled TFDS_DATA_DIR=${TFDS_DATA_DIR:-/tmp/tfds}
mkdir -p $XDG_CACHE_HOME/dp_scaling /tmp/tfds/mnist/3.0.1
cp .gpudata/dataset_info.json /tmp/tfds/mnist/3.0.1/
[ -n "${SKIP_INSTALL:-}" ] || python3 -c "
import numpy as np
for s in ('train', 'test'):
    with np.load('.gpudata/mnist-%s-compressed.npz' % s) as f:
        np.savez('/tmp/xdg/dp_scaling/mnist-3.0.1-%s.npz' % s, images=f['images'], labels=f['labels'])
"
mkdir -p /tmp/o
{ date -u; nproc; uptime; git -C .before log --oneline -1 2>/dev/null || cat .before/.git; } > /tmp/o/versions.txt 2>&1
timeout 260 python3 benchmarks/overhead.py --setups 1:fp32 --pairs 3 --epochs ${EPOCHS30:-30} --bare-cache --before .before > /tmp/o/ab30.txt 2>&1; echo "ab30 rc $?" >> /tmp/o/ab30.txt
tail -5 /tmp/o/ab30.txt
timeout 200 python3 benchmarks/overhead.py --setups 1:fp32 --pairs 3 --bare-cache --before .before ${EPOCHS10:+--epochs $EPOCHS10} > /tmp/o/ab10.txt 2>&1; echo "ab10 rc $?" >> /tmp/o/ab10.txt
tail -5 /tmp/o/ab10.txt
tar czf $OUT/ab.tgz -C /tmp o
