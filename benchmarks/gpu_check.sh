#!/usr/bin/env bash
# One prepared check for the day a GPU is lent: runs the main job (train.py) in bf16 with the largest model
# the repository has (ResNet-18, model=resnet, width 64, 11.2M parameters) on one device and prints
# examples/s, MFU and peak memory per device from the run's summary.json.
#
#   benchmarks/gpu_check.sh [extra Hydra overrides ...]
#
# Sizes (chosen from the backend JAX reports, or forced with GPU_CHECK_SIZE=full|small):
#   full  (GPU/TPU): global batch 512, 300 steps, profile of steps 101-105; well under 8 minutes on one H200
#                    (train.py is stopped by `timeout` after GPU_CHECK_TIMEOUT_S, default 420 s).
#   small (CPU):     model.width=8, global batch 16, 6 steps, 1 device; minutes on a 2-core CPU. MFU and
#                    peak memory are then "n/a" (no peak FLOP/s or memory statistics for CPU).
# Data: full: MNIST when $TFDS_DATA_DIR/mnist exists, else data=synthetic (generated on the device);
# small: synthetic.
# Output: the run folder is GPU_CHECK_DIR, else $OUT/gpu_check (device machines), else
# outputs/gpu_check/<date>_<time>. W&B runs offline into it. Exit status: train.py's (124 on timeout).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-$(command -v python || command -v python3)}

backend=$("$PY" -c 'import jax; print(jax.default_backend())' 2>/dev/null | tail -n 1) || backend=unknown
size=${GPU_CHECK_SIZE:-auto}
if [[ "$size" == auto ]]; then
  if [[ "$backend" == cpu ]]; then size=small; else size=full; fi
fi
case "$size" in
  full)  settings=(train.global_batch=512 train.steps=300 train.log_every=50 profile.start_step=100
                   profile.num_steps=5) ;;
  small) settings=(model.width=8 train.global_batch=16 train.steps=6 train.log_every=3 train.eval_batch=64
                   runtime.cpu_devices=1 profile.start_step=2 profile.num_steps=2) ;;
  *) echo "error: GPU_CHECK_SIZE=$size is unknown; use full, small or auto" >&2; exit 2 ;;
esac
if [[ "$size" == small ]]; then
  data=(data=synthetic data.eval_size=64)  # evaluating 10000 MNIST images would dominate on a CPU
elif [[ -n "${TFDS_DATA_DIR:-}" && -d "${TFDS_DATA_DIR}/mnist" ]]; then
  data=(data=mnist)
else
  data=(data=synthetic)
fi
if [[ -n "${GPU_CHECK_DIR:-}" ]]; then run_dir=$GPU_CHECK_DIR
elif [[ -n "${OUT:-}" ]]; then run_dir=$OUT/gpu_check
else run_dir=outputs/gpu_check/$(date +%Y-%m-%d_%H-%M-%S)
fi

echo "gpu_check: backend=$backend size=$size ${data[*]} run folder=$run_dir"
set +e
timeout "${GPU_CHECK_TIMEOUT_S:-420}" "$PY" train.py model=resnet precision=bf16 parallel=jit_sharding \
  mesh.devices=1 "${data[@]}" profile.enabled=true checkpoint.enabled=false wandb.mode=offline \
  "hydra.run.dir=$run_dir" "${settings[@]}" "$@"
status=$?
set -e

"$PY" - "$run_dir/summary.json" "$status" <<'EOF'
import json, sys
path, status = sys.argv[1], int(sys.argv[2])
try:
    s = json.load(open(path))
except (OSError, ValueError) as e:
    print(f"gpu_check: no summary ({e}); train.py exit status {status}")
    sys.exit(0)
def fmt(key, scale=1.0, unit="", why=""):
    v = s.get(key)
    return f"{v * scale:.4g}{unit}" if isinstance(v, (int, float)) else f"n/a{why}"
print(f"gpu_check: status={s.get('status')} {s.get('error') or ''}".rstrip())
print(f"gpu_check: device={s.get('device_kind')} platform={s.get('platform')} model={s.get('model')} "
      f"precision={s.get('precision')} devices={s.get('mesh/devices')} global batch={s.get('train/global_batch')} "
      f"steps={s.get('train/steps')}")
print(f"gpu_check: examples/s={fmt('perf/examples_per_s')} step time={fmt('perf/step_time_s', 1e3, ' ms')} "
      f"compile={fmt('perf/compile_time_s', 1, ' s')}")
print(f"gpu_check: MFU={fmt('perf/mfu', 100, '%', ' (no peak FLOP/s known for this device)')} "
      f"(FLOPs/step/device={fmt('perf/flops_per_step_per_device')})")
print(f"gpu_check: peak memory/device={fmt('mem/peak_bytes_per_device', 2**-30, ' GiB', ' (no memory statistics)')} "
      f"state={fmt('mem/state_bytes_per_device', 2**-20, ' MiB')} temp={fmt('mem/temp_bytes_per_device', 2**-20, ' MiB')}")
print(f"gpu_check: comm/ratio_measured={fmt('comm/ratio_measured')} valid={s.get('comm/ratio_measured_valid')} "
      f"{s.get('profile/error') or ''}".rstrip())
print(f"gpu_check: eval/accuracy={fmt('eval/accuracy')}")
EOF

# The language model (model=gpt): GPT-2 small (124M parameters, context 1024) in bf16 on one device, random
# tokens (data=synthetic), once without and once with rematerialisation (model.remat=none|full): tokens/s, MFU
# (model FLOPs 6N + 12·L·d·T per token, PaLM appendix B) and memory. small (CPU): model.size=tiny, 6 steps.
# GPU_CHECK_GPT=0 skips it; each job is stopped after GPU_CHECK_GPT_TIMEOUT_S (default 240 s).
if [[ "${GPU_CHECK_GPT:-1}" != 0 ]]; then
  case "$size" in
    full)  gpt=(model.size=gpt2_small train.global_batch=8 train.steps=60 train.log_every=10 train.eval_batch=8
                data.train_size=1000000 data.eval_size=8200) ;;
    small) gpt=(model.size=tiny train.global_batch=8 train.steps=6 train.log_every=2 train.eval_batch=8
                runtime.cpu_devices=1 data.eval_size=2000) ;;
  esac
  for remat in none full; do
    set +e
    timeout "${GPU_CHECK_GPT_TIMEOUT_S:-240}" "$PY" train.py model=gpt data=synthetic precision=bf16 \
      parallel=jit_sharding mesh.devices=1 model.remat=$remat checkpoint.enabled=false wandb.mode=offline \
      "hydra.run.dir=${run_dir}_gpt_remat_$remat" "${gpt[@]}" "$@"
    gpt_status=$?
    set -e
    "$PY" - "${run_dir}_gpt_remat_$remat/summary.json" "$gpt_status" "$remat" <<'EOF'
import json, sys
path, status, remat = sys.argv[1], int(sys.argv[2]), sys.argv[3]
try:
    s = json.load(open(path))
except (OSError, ValueError) as e:
    print(f"gpu_check gpt remat={remat}: no summary ({e}); train.py exit status {status}")
    sys.exit(0)
def fmt(key, scale=1.0, unit="", why=""):
    v = s.get(key)
    return f"{v * scale:.4g}{unit}" if isinstance(v, (int, float)) else f"n/a{why}"
print(f"gpu_check gpt remat={remat}: status={s.get('status')} {s.get('error') or ''}".rstrip())
print(f"gpu_check gpt remat={remat}: device={s.get('device_kind')} params={s.get('model/param_count')} "
      f"context={s.get('model/context')} global batch={s.get('train/global_batch')} "
      f"tokens/step={s.get('train/tokens_per_step')}")
print(f"gpu_check gpt remat={remat}: tokens/s={fmt('perf/tokens_per_s')} "
      f"step time={fmt('perf/step_time_s', 1e3, ' ms')} compile={fmt('perf/compile_time_s', 1, ' s')}")
print(f"gpu_check gpt remat={remat}: MFU={fmt('perf/mfu', 100, '%', ' (no peak FLOP/s known for this device)')} "
      f"(model FLOPs/token={fmt('perf/flops_per_token')}; XLA's FLOPs/step={fmt('perf/flops_per_step_per_device_xla')})")
print(f"gpu_check gpt remat={remat}: peak memory/device="
      f"{fmt('mem/peak_bytes_per_device', 2**-30, ' GiB', ' (no memory statistics)')} "
      f"temp={fmt('mem/temp_bytes_per_device', 2**-20, ' MiB')} eval/loss={fmt('eval/loss')}")
EOF
  done
fi
exit "$status"
