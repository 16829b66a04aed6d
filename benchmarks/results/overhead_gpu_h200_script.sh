# Part 1 (first device call): the overhead ratios
#!/usr/bin/env bash
# Overhead of train.py against the bare scripts on a GPU host (prepared for one device call).
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export XDG_CACHE_HOME=/tmp/xdg WANDB_MODE=disabled TFDS_DATA_DIR=/tmp/tfds
mkdir -p /tmp/xdg/dp_scaling/tiny_shakespeare /tmp/tfds/mnist/3.0.1
cp .gpudata/dataset_info.json /tmp/tfds/mnist/3.0.1/
cp .gpudata/tiny_shakespeare.txt /tmp/xdg/dp_scaling/tiny_shakespeare/input.txt
mkdir -p ../shared/data/tiny_shakespeare && cp .gpudata/tiny_shakespeare.txt ../shared/data/tiny_shakespeare/input.txt
python3 -c "
import numpy as np
for s in ('train', 'test'):
    with np.load('.gpudata/mnist-%s-compressed.npz' % s) as f:
        np.savez('/tmp/xdg/dp_scaling/mnist-3.0.1-%s.npz' % s, images=f['images'], labels=f['labels'])
"
{ date -u; nproc; uptime; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import sys, jax, flax, optax, orbax.checkpoint as o, numpy, ml_dtypes; print(sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'orbax', o.__version__, 'numpy', numpy.__version__, 'ml_dtypes', ml_dtypes.__version__, jax.devices())"
} 2>&1 | tee $OUT/versions.txt
timeout 100 python3 train.py train.epochs=1 hydra.run.dir=/tmp/smoke > $OUT/smoke.txt 2>&1; echo "smoke rc $?" | tee -a $OUT/smoke.txt
tail -6 $OUT/smoke.txt
cp /tmp/smoke/summary.json $OUT/smoke_summary.json 2>/dev/null
timeout 200 python3 benchmarks/overhead.py --setups 1:fp32 --pairs 3 --bare-cache --also checkpoint.every=0 > $OUT/overhead_gpu_mlp.txt 2>&1; echo "mlp rc $?" >> $OUT/overhead_gpu_mlp.txt
tail -12 $OUT/overhead_gpu_mlp.txt
timeout 150 python3 benchmarks/overhead.py --model gpt --setups 1:fp32 --pairs 3 --bare-cache > $OUT/overhead_gpu_gpt.txt 2>&1; echo "gpt rc $?" >> $OUT/overhead_gpu_gpt.txt
tail -8 $OUT/overhead_gpu_gpt.txt

# Part 2 (second device call): start-up pieces (pyinstrument and -X importtime outputs not kept)
#!/usr/bin/env bash
# Where train.py's start-up goes on a GPU host (importtime, pyinstrument), and the bare script's phases.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
export XDG_CACHE_HOME=/tmp/xdg WANDB_MODE=disabled TFDS_DATA_DIR=/tmp/tfds
mkdir -p /tmp/xdg/dp_scaling /tmp/tfds/mnist/3.0.1
cp .gpudata/dataset_info.json /tmp/tfds/mnist/3.0.1/
python3 -c "
import numpy as np
for s in ('train', 'test'):
    with np.load('.gpudata/mnist-%s-compressed.npz' % s) as f:
        np.savez('/tmp/xdg/dp_scaling/mnist-3.0.1-%s.npz' % s, images=f['images'], labels=f['labels'])
"
A="train.epochs=1 checkpoint.every=0"
timeout 60 python3 train.py $A hydra.run.dir=/tmp/w1 > /dev/null 2>&1; echo "warm rc $?"
for i in 1 2; do
python3 -c "
import time; t=time.perf_counter(); import jax; t1=time.perf_counter(); jax.devices(); t2=time.perf_counter(); import flax.nnx; t3=time.perf_counter(); import hydra, omegaconf; t4=time.perf_counter(); import orbax.checkpoint; t5=time.perf_counter()
print(f'import jax {t1-t:.2f} s, jax.devices() {t2-t1:.2f} s, flax.nnx {t3-t2:.2f} s, hydra+omegaconf {t4-t3:.2f} s, orbax {t5-t4:.2f} s')
" 2>&1 | tail -1 | tee -a $OUT/timings.txt
done
timeout 60 python3 -X importtime train.py $A hydra.run.dir=/tmp/w2 2> $OUT/importtime.txt > /dev/null; echo "importtime rc $?"
timeout 90 python3 -m pyinstrument -i 0.001 -o $OUT/pyinst_train.txt train.py $A hydra.run.dir=/tmp/w3 > /dev/null 2>&1; echo "pyinstrument rc $?"
cp /tmp/w3/summary.json $OUT/summary_w3.json
for i in 1 2 3; do rm -rf /tmp/w4; s=$(date +%s.%N); timeout 60 python3 train.py $A hydra.run.dir=/tmp/w4 > /tmp/w4.out 2>&1; e=$(date +%s.%N); echo "train.py wall $(python3 -c "print(round($e-$s,2))") $(grep -o 'start-up.*' /tmp/w4.out)" | tee -a $OUT/timings.txt; done
for i in 0 1 2 3; do s=$(date +%s.%N); timeout 60 python3 benchmarks/bare_train.py --devices 1 --epochs 1 --compilation-cache /tmp/bc --timings /tmp/bare.json > /dev/null 2>&1; e=$(date +%s.%N); echo "bare wall $(python3 -c "print(round($e-$s,2))") $(cat /tmp/bare.json)" | tee -a $OUT/timings.txt; done

# Part 3 (third device call): W&B offline (the defaults); the wandb wheels were carried in .whl beside the others
#!/usr/bin/env bash
# train.py with its defaults (W&B offline) against the bare script on a GPU host: W&B's cost with spare cores.
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
unset WANDB_MODE
export XDG_CACHE_HOME=/tmp/xdg TFDS_DATA_DIR=/tmp/tfds WANDB_SILENT=true
mkdir -p /tmp/xdg/dp_scaling /tmp/tfds/mnist/3.0.1
cp .gpudata/dataset_info.json /tmp/tfds/mnist/3.0.1/
python3 -c "
import numpy as np
for s in ('train', 'test'):
    with np.load('.gpudata/mnist-%s-compressed.npz' % s) as f:
        np.savez('/tmp/xdg/dp_scaling/mnist-3.0.1-%s.npz' % s, images=f['images'], labels=f['labels'])
"
python3 -c "
import time; t = time.time(); import wandb; t1 = time.time()
r = wandb.init(mode='offline', dir='/tmp/wbt', project='check'); t2 = time.time()
for i in range(2340): r.log({'train/loss': 1.0 / (i + 1)}, step=i)
t3 = time.time(); r.finish(); t4 = time.time()
print(f'wandb {wandb.__version__} ok: import {t1-t:.2f} s, init {t2-t1:.2f} s, 2340 logs {t3-t2:.2f} s, finish {t4-t3:.2f} s')
" > $OUT/wandb_check.txt 2>&1; tail -4 $OUT/wandb_check.txt
grep -q "ok: import" $OUT/wandb_check.txt || exit 3
timeout 60 python3 train.py train.epochs=1 hydra.run.dir=/tmp/s1 > $OUT/smoke_wandb.txt 2>&1; echo "smoke rc $?" >> $OUT/smoke_wandb.txt
grep -E "W&B|wandb|start-up|eval/acc|rc" $OUT/smoke_wandb.txt | cut -c1-220
timeout 230 python3 benchmarks/overhead.py --setups 1:fp32 --pairs 3 --bare-cache --also wandb.mode=disabled > $OUT/overhead_gpu_wandb.txt 2>&1; echo "rc $?" >> $OUT/overhead_gpu_wandb.txt
tail -9 $OUT/overhead_gpu_wandb.txt

# Part 4 (fourth device call): 30 epochs
#!/usr/bin/env bash
# A 3x longer run (30 epochs) on the GPU host, W&B offline (the defaults) and disabled: is the gap a fixed cost?
set -u
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
unset WANDB_MODE
export XDG_CACHE_HOME=/tmp/xdg TFDS_DATA_DIR=/tmp/tfds WANDB_SILENT=true
mkdir -p /tmp/xdg/dp_scaling /tmp/tfds/mnist/3.0.1
cp .gpudata/dataset_info.json /tmp/tfds/mnist/3.0.1/
python3 -c "
import numpy as np
for s in ('train', 'test'):
    with np.load('.gpudata/mnist-%s-compressed.npz' % s) as f:
        np.savez('/tmp/xdg/dp_scaling/mnist-3.0.1-%s.npz' % s, images=f['images'], labels=f['labels'])
"
timeout 175 python3 benchmarks/overhead.py --setups 1:fp32 --pairs 3 --epochs 30 --bare-cache --also wandb.mode=disabled > $OUT/overhead_gpu_30epochs.txt 2>&1; echo "rc $?" >> $OUT/overhead_gpu_30epochs.txt
tail -6 $OUT/overhead_gpu_30epochs.txt
