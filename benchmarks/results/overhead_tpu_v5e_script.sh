# The device calls of benchmarks/results/overhead_tpu_v5e.txt, as run from the repository root with .whl-tpu/ (wheels),
# .tpudata/ (MNIST cache compressed, TFDS dataset_info.json, Tiny Shakespeare) and .tpurun/ (these scripts) carried.
# call 1: bash .tpurun/tpu.sh mlp; call 2: bash .tpurun/tpu.sh gpt (the in-process lines added after call 1);
# call 3: bash .tpurun/tpu.sh diag; calls 4 and 5: the inline commands at the end.
# Second session: call 6 bash .tpurun/tpu.sh fix; call 7 mlpdiag; call 8 knobs.

# ---- .tpurun/tpu.sh (as of the second session: phases fix, mlpdiag, knobs added)
#!/usr/bin/env bash
# Overhead and the prepared accelerator check on a TPU v5e host (one chip), prepared for two device calls:
#   bash .tpurun/tpu.sh mlp   # install, versions, smoke, benchmarks/overhead.py for the MLP
#   bash .tpurun/tpu.sh gpt   # benchmarks/overhead.py --model gpt, then benchmarks/gpu_check.sh
# Carried: .whl-tpu/ (wheels of the pinned stack, no jax/numpy), .tpudata/ (MNIST cache compressed, TFDS
# dataset_info.json, Tiny Shakespeare). The machine's own jax 0.10.2 stays first on PYTHONPATH.
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
  # the working tree beside a shared/ folder (../shared/data/tiny_shakespeare/input.txt), data in place
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
export PYTHONPATH=$PYTHONPATH:/tmp/site XDG_CACHE_HOME=/tmp/xdg TFDS_DATA_DIR=/tmp/tfds
export WANDB_CONFIG_DIR=/tmp/wandb_cfg WANDB_CACHE_DIR=/tmp/wandb_cache WANDB_DATA_DIR=/tmp/wandb_data
cd /tmp/w/main || exit 1
if [ "$phase" = diag ]; then
  mkdir -p $HOME/.cache && ln -sfn /tmp/xdg/dp_scaling $HOME/.cache/dp_scaling
  D=$OUT/diag.txt
  tr() {  # name, overrides...: one train.py run; prints wall, median window rate, start-up
    local name=$1; shift; local s=$(date +%s.%N)
    WANDB_MODE=offline timeout 90 python3 train.py hydra.run.dir=/tmp/d_$name runtime.compilation_cache_dir=/tmp/jc "$@" > /tmp/d_$name.log 2>&1
    local rc=$? w=$(python3 -c "print(round($(date +%s.%N)-$s,2))")
    echo "$name rc $rc wall $w $(python3 -c "import json; s=json.load(open('/tmp/d_$name/summary.json')); print('examples/s', round(s['perf/examples_per_s']), 'startup', round(s['perf/startup_s'], 2), 'p25-p75', round(s['perf/examples_per_s_p25']), round(s['perf/examples_per_s_p75']))" 2>&1 | tail -1)" | tee -a $D
  }
  br() {  # name, script, args...: one bare run
    local name=$1 script=$2; shift 2; local s=$(date +%s.%N)
    timeout 90 python3 benchmarks/$script --devices=1 --precision=fp32 --compilation-cache=/tmp/bjc --timings=/tmp/$name.json "$@" > /tmp/$name.log 2>&1
    local rc=$? w=$(python3 -c "print(round($(date +%s.%N)-$s,2))")
    echo "$name rc $rc wall $w $(python3 -c "import json; s=json.load(open('/tmp/$name.json')); print('examples/s', round(s['window_examples_per_s_median']), 'first_step', round(s['first_step'], 2))" 2>&1 | tail -1)" | tee -a $D
  }
  G="model=gpt data=tiny_shakespeare train.global_batch=8 train.log_every=5 train.steps=300"
  echo "## GPT tiny, 300 steps, batch 8 x 128, windows of 5 steps (examples/s = windows/s; x128 for tokens/s)" >> $D
  tr gpt_warm $G; br bgpt_warm bare_gpt.py --steps=300 --batch=8 --window=5
  for i in 1 2; do
    if [ $i = 1 ]; then order="bare def pf0 nowb"; else order="nowb pf0 def bare"; fi
    for v in $order; do case $v in
      bare) br bgpt_$i bare_gpt.py --steps=300 --batch=8 --window=5 ;;
      def) tr gpt_def_$i $G ;;
      pf0) tr gpt_pf0_$i $G data.prefetch=0 ;;
      nowb) tr gpt_nowb_$i $G wandb.mode=disabled checkpoint.enabled=false ;;
    esac; done
  done
  echo "## MLP, 10 epochs MNIST, batch 256, windows of 50" >> $D
  br bmlp_warm bare_train.py --epochs=10 --batch=256 --window=50
  br bmlp_1 bare_train.py --epochs=10 --batch=256 --window=50; tr mlp_pf0 data.prefetch=0 runtime.cpu_devices=1 precision=fp32
  tr mlp_def runtime.cpu_devices=1 precision=fp32; tr mlp_pf0_nowb data.prefetch=0 wandb.mode=disabled checkpoint.every=0
  br bmlp_2 bare_train.py --epochs=10 --batch=256 --window=50
  echo "## in-process step comparison (GPT)" >> $D
  TRIALS=5 timeout 120 python3 /tmp/w/main/.tpurun/gpt_step.py 2>&1 | grep -v -i warn | tee -a $D
elif [ "$phase" = knobs ]; then  # MLP: 3 pairs with the knobs that give steady state back; GPT 300 steps as in diag
  timeout 330 python3 benchmarks/overhead.py --setups 1:fp32 --pairs 3 --bare-cache --also data.prefetch=0 \
    --also wandb.mode=disabled checkpoint.enabled=false data.prefetch=0 > $OUT/overhead_mlp_knobs.txt 2>&1
  echo "overhead mlp knobs rc $?" | tee -a $OUT/overhead_mlp_knobs.txt; tail -7 $OUT/overhead_mlp_knobs.txt
  D=$OUT/gpt300.txt
  echo "## GPT tiny, 300 steps, batch 8 x 128, windows of 5 steps (examples/s = windows/s; x128 for tokens/s)" >> $D
  for i in 1 2; do
    s=$(date +%s.%N); timeout 60 python3 benchmarks/bare_gpt.py --devices=1 --precision=fp32 --compilation-cache=/tmp/bjc \
      --timings=/tmp/bg$i.json --steps=300 --batch=8 --window=5 > /tmp/bg$i.log 2>&1
    echo "bare_gpt rc $? wall $(python3 -c "print(round($(date +%s.%N)-$s,2))") $(python3 -c "import json; s=json.load(open('/tmp/bg$i.json')); print('examples/s', round(s['window_examples_per_s_median']))" 2>&1 | tail -1)" | tee -a $D
    s=$(date +%s.%N); WANDB_MODE=offline timeout 60 python3 train.py hydra.run.dir=/tmp/g$i runtime.compilation_cache_dir=/tmp/jc \
      model=gpt data=tiny_shakespeare train.global_batch=8 train.log_every=5 train.steps=300 > /tmp/g$i.log 2>&1
    echo "train.py defaults rc $? wall $(python3 -c "print(round($(date +%s.%N)-$s,2))") $(python3 -c "import json; s=json.load(open('/tmp/g$i/summary.json')); print('examples/s', round(s['perf/examples_per_s']), 'p25-p75', round(s['perf/examples_per_s_p25']), round(s['perf/examples_per_s_p75']), 'startup', round(s['perf/startup_s'], 2))" 2>&1 | tail -1)" | tee -a $D
  done
elif [ "$phase" = mlpdiag ]; then  # MLP: which part of train.py's defaults costs steady state on the TPU
  mkdir -p $HOME/.cache && ln -sfn /tmp/xdg/dp_scaling $HOME/.cache/dp_scaling
  D=$OUT/mlpdiag.txt
  tr() { local name=$1; shift; local s=$(date +%s.%N)
    WANDB_MODE=offline timeout 60 python3 train.py hydra.run.dir=/tmp/d_$name runtime.compilation_cache_dir=/tmp/jc runtime.cpu_devices=1 precision=fp32 "$@" > /tmp/d_$name.log 2>&1
    local rc=$? w=$(python3 -c "print(round($(date +%s.%N)-$s,2))")
    echo "$name $* rc $rc wall $w $(python3 -c "import json; s=json.load(open('/tmp/d_$name/summary.json')); print('examples/s', round(s['perf/examples_per_s']), 'p25-p75', round(s['perf/examples_per_s_p25']), round(s['perf/examples_per_s_p75']), 'startup', round(s['perf/startup_s'], 2))" 2>&1 | tail -1)" | tee -a $D; }
  br() { local name=$1; local s=$(date +%s.%N)
    timeout 60 python3 benchmarks/bare_train.py --devices=1 --precision=fp32 --compilation-cache=/tmp/bjc --timings=/tmp/$name.json --epochs=10 --batch=256 --window=50 > /tmp/$name.log 2>&1
    local rc=$? w=$(python3 -c "print(round($(date +%s.%N)-$s,2))")
    echo "$name bare rc $rc wall $w $(python3 -c "import json; s=json.load(open('/tmp/$name.json')); print('examples/s', round(s['window_examples_per_s_median']))" 2>&1 | tail -1)" | tee -a $D; }
  br b0; tr t0; br b1; tr def; tr nowb wandb.mode=disabled; tr nock checkpoint.enabled=false; tr pf0 data.prefetch=0
  tr off3 wandb.mode=disabled checkpoint.enabled=false data.prefetch=0; br b2
  timeout 100 python3 benchmarks/step_host_cost.py > $OUT/step_host_cost.txt 2>&1
  echo "step_host_cost rc $?" | tee -a $OUT/step_host_cost.txt; tail -14 $OUT/step_host_cost.txt
elif [ "$phase" = fix ]; then  # the orbax-import and runtime-phase changes re-measured: MLP and GPT, 3 pairs each
  { date -u; nproc; python3 -c "import jax; d = jax.devices(); print(jax.__version__, d, d[0].device_kind)"
    git -C /tmp/w/main log --oneline -1 2>/dev/null || true; } > $OUT/versions.txt 2>&1
  cat $OUT/versions.txt
  s=$(date +%s.%N)
  WANDB_MODE=offline timeout 120 python3 train.py train.epochs=1 hydra.run.dir=/tmp/smoke > $OUT/smoke.txt 2>&1
  echo "smoke rc $? wall $(python3 -c "print(round($(date +%s.%N)-$s,2))")" | tee -a $OUT/smoke.txt
  grep -E "start-up|eval/accuracy" $OUT/smoke.txt | tail -3
  timeout 250 python3 benchmarks/overhead.py --setups 1:fp32 --pairs 3 --bare-cache > $OUT/overhead_mlp.txt 2>&1
  echo "overhead mlp rc $?" | tee -a $OUT/overhead_mlp.txt; tail -5 $OUT/overhead_mlp.txt
  timeout 200 python3 benchmarks/overhead.py --model gpt --setups 1:fp32 --pairs 3 --bare-cache \
    > $OUT/overhead_gpt.txt 2>&1; echo "overhead gpt rc $?" | tee -a $OUT/overhead_gpt.txt
  tail -5 $OUT/overhead_gpt.txt
elif [ "$phase" = mlp ]; then
  { date -u; nproc; uptime; python3 -c 'import platform; print(platform.libc_ver())'
    python3 -c "import sys, jax, flax, optax, orbax.checkpoint as o, numpy, ml_dtypes, wandb, hydra; print(sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'orbax', o.__version__, 'numpy', numpy.__version__, 'ml_dtypes', ml_dtypes.__version__, 'wandb', wandb.__version__, 'hydra', hydra.__version__); d = jax.devices(); print(d, d[0].device_kind)"
    git -C /tmp/w/main log --oneline -1 2>/dev/null || true
  } > $OUT/versions.txt 2>&1
  cat $OUT/versions.txt
  s=$(date +%s.%N)
  WANDB_MODE=offline timeout 150 python3 train.py train.epochs=1 hydra.run.dir=/tmp/smoke > $OUT/smoke.txt 2>&1
  echo "smoke rc $? wall $(python3 -c "print(round($(date +%s.%N)-$s,2))")" | tee -a $OUT/smoke.txt
  grep -E "start-up|W&B|eval/accuracy" $OUT/smoke.txt | tail -5
  timeout 380 python3 benchmarks/overhead.py --setups 1:fp32,1:bf16 --pairs 3 --bare-cache --also wandb.mode=disabled \
    > $OUT/overhead_mlp.txt 2>&1; echo "overhead mlp rc $?" | tee -a $OUT/overhead_mlp.txt
  tail -8 $OUT/overhead_mlp.txt
else
  timeout 80 python3 benchmarks/overhead.py --mode in-process --setups 1:fp32 --pairs 21 > $OUT/in_process.txt 2>&1
  echo "in-process rc $?" | tee -a $OUT/in_process.txt; tail -4 $OUT/in_process.txt
  timeout 90 python3 benchmarks/step_host_cost.py > $OUT/step_host_cost.txt 2>&1
  echo "step_host_cost rc $?" | tee -a $OUT/step_host_cost.txt; tail -12 $OUT/step_host_cost.txt
  timeout 200 python3 benchmarks/overhead.py --model gpt --setups 1:fp32 --pairs 3 --bare-cache \
    > $OUT/overhead_gpt.txt 2>&1; echo "overhead gpt rc $?" | tee -a $OUT/overhead_gpt.txt
  tail -6 $OUT/overhead_gpt.txt
  GPU_CHECK_DIR=/tmp/gc GPU_CHECK_TIMEOUT_S=100 GPU_CHECK_GPT_TIMEOUT_S=70 timeout 200 bash benchmarks/gpu_check.sh \
    > $OUT/gpu_check.txt 2>&1; echo "gpu_check rc $?" | tee -a $OUT/gpu_check.txt
  grep "^gpu_check" $OUT/gpu_check.txt
  for d in /tmp/gc /tmp/gc_gpt_remat_none /tmp/gc_gpt_remat_full; do
    [ -f $d/summary.json ] && cp $d/summary.json $OUT/summary_$(basename $d).json
  done
fi

# ---- .tpurun/gpt_step.py (call 3's in-process step comparison)
# """Scratch (TPU diagnosis): the repository's GPT tiny step against bare_gpt.py's, one process, pre-placed batch."""
# import importlib.util, os, re, statistics, sys, time
# sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
# import jax, jax.numpy as jnp, numpy as np, optax
# from jax.sharding import NamedSharding, PartitionSpec as P
# from data.text import WindowSource, load_text_splits
# from training.build import build, plan
# from utils import make_cfg
# 
# B = 8
# spec = importlib.util.spec_from_file_location("bare_gpt", "benchmarks/bare_gpt.py")
# bare = importlib.util.module_from_spec(spec); spec.loader.exec_module(bare)
# cfg = make_cfg({"model": {"name": "gpt", "size": "tiny"}, "data": {"name": "tiny_shakespeare"}},
#                mesh__devices=1, train__global_batch=B)
# exp = build(plan(cfg))
# train_tokens, _ = load_text_splits("tiny_shakespeare", None, cfg.data.cache_dir, False)
# source = WindowSource(train_tokens, 128, B, 0, with_index=False)
# layout = exp.mode.batch_layout()
# batch = layout.place(source.local_batch(0, slice(0, B)), B)
# print("repo batch leaves", {k: (v.shape, v.dtype) for k, v in batch.items()})
# step_repo = exp.steps.train.lower(exp.state, batch).compile()
# mesh = exp.mode.mesh
# repl, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(("data", "fsdp")))
# tx = optax.adam(1e-3)
# params = jax.device_put(bare.init_params(jax.random.key(0)), repl)
# opt = jax.device_put(tx.init(params), repl)
# x, y = jax.device_put(bare.batch_of(train_tokens, 0, 0, B), split)
# step_bare = jax.jit(bare.make_train_step(tx, jnp.float32), in_shardings=(repl, repl, split, split),
#                     out_shardings=(repl, repl, repl), donate_argnums=(0, 1)).lower(params, opt, x, y).compile()
# print("leaves: repo state", len(jax.tree.leaves(exp.state)), "bare", len(jax.tree.leaves((params, opt))))
# for name, c in (("repo", step_repo), ("bare", step_bare)):
#     txt = c.as_text()
#     entry = txt[txt.rfind("ENTRY"):]
#     ops = [l for l in entry.splitlines()[1:] if "=" in l]
#     kinds = {}
#     for l in ops:
#         m = re.search(r"=\s*\S+\s+([\w.-]+)\(", l)
#         op = m.group(1) if m else "?"
#         kinds[op] = kinds.get(op, 0) + 1
#     cost = c.cost_analysis(); cost = cost[0] if isinstance(cost, list) else cost
#     print(f"{name}: ENTRY ops {len(ops)}; top kinds {sorted(kinds.items(), key=lambda kv: -kv[1])[:8]}; flops {cost.get('flops', 0):.3g} bytes {cost.get('bytes accessed', 0):.3g}")
#     with open(os.path.join(os.environ.get("OUT", "/tmp"), f"hlo_{name}.txt"), "w") as f:
#         f.write(txt)
# st = {"repo": exp.state, "bare": (params, opt)}
# def run(name, n):
#     s = st[name]
#     t0, c0 = time.perf_counter(), time.thread_time()
#     for _ in range(n):
#         if name == "repo":
#             s, m = step_repo(s, batch)
#         else:
#             p, o, l = step_bare(*s, x, y); s = (p, o)
#     cpu = time.thread_time() - c0
#     jax.block_until_ready(s)
#     st[name] = s
#     return cpu / n * 1e6, (time.perf_counter() - t0) / n * 1e3
# def place_repo(n):
#     c0, t0 = time.thread_time(), time.perf_counter()
#     for s in range(n):
#         jax.block_until_ready(layout.place(source.local_batch(s, slice(0, B)), B))
#     return (time.thread_time() - c0) / n * 1e6, (time.perf_counter() - t0) / n * 1e3
# def place_bare(n):
#     c0, t0 = time.thread_time(), time.perf_counter()
#     for s in range(n):
#         jax.block_until_ready(jax.device_put(bare.batch_of(train_tokens, 0, s, B), split))
#     return (time.thread_time() - c0) / n * 1e6, (time.perf_counter() - t0) / n * 1e3
# runs = {"step repo": lambda n: run("repo", n), "step bare": lambda n: run("bare", n),
#         "place repo": place_repo, "place bare": place_bare}
# for r in runs.values(): r(10)
# res = {k: [] for k in runs}
# names = list(runs)
# for i in range(int(os.environ.get("TRIALS", 7))):
#     for k in names[i % 4:] + names[:i % 4]:
#         res[k].append(runs[k](100))
# for k, v in res.items():
#     print(f"{k:<12} main-thread CPU per call median {statistics.median(a for a, _ in v):.0f} us (min {min(a for a, _ in v):.0f}); wall per call median {statistics.median(b for _, b in v):.3f} ms (min {min(b for _, b in v):.3f})")

# ---- call 4
# export PYTHONPATH=$PYTHONPATH:/tmp/site XDG_CACHE_HOME=/tmp/xdg TFDS_DATA_DIR=/tmp/tfds WANDB_CONFIG_DIR=/tmp/wandb_cfg WANDB_CACHE_DIR=/tmp/wandb_cache WANDB_DATA_DIR=/tmp/wandb_data WANDB_MODE=offline; cd /tmp/w/main; G="model=gpt data=tiny_shakespeare train.global_batch=8 train.log_every=5 train.steps=300 runtime.compilation_cache_dir=/tmp/jc"; for v in "wandb.mode=disabled" "checkpoint.enabled=false" "checkpoint.enabled=false" "wandb.mode=disabled"; do n=$((n+1)); timeout 60 python3 train.py hydra.run.dir=/tmp/e$n $G $v > /tmp/e$n.log 2>&1; echo "$v rc $? $(python3 -c "import json; s=json.load(open('/tmp/e$n/summary.json')); print('examples/s', round(s['perf/examples_per_s']), 'p25-p75', round(s['perf/examples_per_s_p25']), round(s['perf/examples_per_s_p75']))")" | tee -a $OUT/e.txt; done
# ---- call 5: the same environment and G; then
# mkdir -p /tmp/sc && echo "import orbax.checkpoint" > /tmp/sc/sitecustomize.py; for n in 1 2; do PYTHONPATH=/tmp/sc:$PYTHONPATH timeout 60 python3 train.py hydra.run.dir=/tmp/f$n $G > /tmp/f$n.log 2>&1; ...summary fields as in call 4, plus perf/startup_s and its phases...; done
