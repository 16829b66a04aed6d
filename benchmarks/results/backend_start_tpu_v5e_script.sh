# The device scripts of benchmarks/results/backend_start_tpu_v5e.txt, run from the repository root with .whl-tpu/
# (wheels: pip download of requirements.txt without jax, jaxlib, numpy, scipy, requests, pydantic, tensorstore, TFDS,
# pillow, array_record, matplotlib and the development tools; antlr4 built as a wheel), .tpudata/ (MNIST's decoded
# arrays compressed, TFDS dataset_info.json, Tiny Shakespeare) and .tpurun/ (these files, and before.tar.gz: git
# archive of a649d9f) carried. tensorstore 0.1.86 is not on that machine's index; the fallback installed its 0.1.85.

# ---- .tpurun/tpu5.sh
#!/usr/bin/env bash
# TPU v5e, fifth session. bash .tpurun/tpu5.sh trace | ab
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
if [ "$phase" = trace ]; then
  python3 -c "import sys, jax, flax, optax, orbax.checkpoint as o, wandb, hydra; print(sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__, 'orbax', o.__version__, 'wandb', wandb.__version__, 'hydra', hydra.__version__)"
  for i in 1 2; do
    /usr/bin/time -f "wall %e s" python3 .tpurun/trace_backend.py train.py hydra.run.dir=/tmp/runs/t$i 2>&1 | grep -E "TRACE|File|^    |startup|eval/acc|wall|Error|error" | grep -v "site-packages/hydra" | tail -60
  done
fi
if [ "$phase" = mlp ] || [ "$phase" = gpt ] || [ "$phase" = stacks ]; then
  rm -rf /tmp/w/before && mkdir -p /tmp/w/before && tar xzf .tpurun/before.tar.gz -C /tmp/w/before
  { date -u; nproc; uptime; python3 -c "import sys, jax, flax, optax, orbax.checkpoint as o, numpy, wandb, hydra; print(sys.version.split()[0], 'jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, 'orbax', o.__version__, 'numpy', numpy.__version__, 'wandb', wandb.__version__, 'hydra', hydra.__version__); d = jax.devices(); print(d, d[0].device_kind)"; } 2>&1 | grep -v -i warn
fi
if [ "$phase" = mlp ]; then
  python3 train.py hydra.run.dir=/tmp/runs/smoke 2>&1 | grep -E "start-up|eval/acc" | tail -3
  python3 benchmarks/overhead.py --setups 1:fp32 --pairs 3 --bare-cache --before /tmp/w/before 2>&1 | grep -v -i "warn"
fi
if [ "$phase" = gpt ]; then
  python3 benchmarks/overhead.py --model gpt --setups 1:fp32 --pairs 3 --bare-cache --before /tmp/w/before 2>&1 | grep -v -i "warn"
fi
if [ "$phase" = stacks ]; then
  STACKS=stacks1.txt python3 .tpurun/dump_stacks.py hydra.run.dir=/tmp/runs/st1 2>&1 | grep -E "start-up|eval/acc" | tail -3
  STACKS=stacks2.txt python3 .tpurun/dump_stacks.py hydra.run.dir=/tmp/runs/st2 2>&1 | grep -E "start-up|eval/acc" | tail -3
  python3 benchmarks/overhead.py --model gpt --setups 1:fp32 --pairs 3 --bare-cache --before /tmp/w/before 2>&1 | grep -v -i "warn"
fi

# ---- .tpurun/init_overlap.py
"""Does the TPU backend's initialisation (jax.devices()) release the GIL? seq: init, then ~N s of Python work;
thr: the same work on the main thread while a thread initialises the backend."""
import sys, time, threading
T0 = time.perf_counter()
mode = sys.argv[1]
import jax
t_imp = time.perf_counter() - T0

def busy(n):
    s = 0
    for i in range(n):
        s += i * i % 7
    return s

N = int(sys.argv[2]) if len(sys.argv) > 2 else 30_000_000
if mode == "calib":
    t = time.perf_counter(); busy(N); print(f"busy {time.perf_counter() - t:.2f} s"); sys.exit()
if mode == "seq":
    t = time.perf_counter(); d = jax.devices(); t_dev = time.perf_counter() - t
    t = time.perf_counter(); busy(N); t_busy = time.perf_counter() - t
else:
    box = {}
    def init():
        t = time.perf_counter(); box["d"] = jax.devices(); box["t"] = time.perf_counter() - t
    th = threading.Thread(target=init); th.start()
    t = time.perf_counter(); busy(N); t_busy = time.perf_counter() - t
    th.join(); t_dev = box["t"]; d = box["d"]
x = jax.numpy.ones(3).sum().block_until_ready()
print(f"{mode}: import jax {t_imp:.2f} s, devices {t_dev:.2f} s, busy {t_busy:.2f} s, total {time.perf_counter() - T0:.2f} s, {d[0].device_kind}")

# ---- .tpurun/runtime_phase.py
import sys, time
T0 = time.perf_counter()
def mark(s, t=[T0]):
    now = time.perf_counter(); print(f"{s}: {now - t[0]:.2f} s", flush=True); t[0] = now
import jax
mark("import jax")
from jax._src import clusters
mark("import clusters")
found = None
for env in clusters.ClusterEnv._cluster_types:
    if env.opt_in_only_method:
        continue
    t = time.perf_counter()
    try:
        present = env.is_env_present()
    except Exception as e:
        present = f"raised {type(e).__name__}"
    print(f"  {env.__name__}.is_env_present() = {present} in {time.perf_counter() - t:.2f} s", flush=True)
    if present is True and found is None:
        found = env
mark(f"detect -> {found}")
if found is not None:
    try:
        print("process count", found.get_process_count())
    except Exception as e:
        print("get_process_count raised", type(e).__name__, str(e)[:300])
    mark("get_process_count")
d = jax.devices()
mark(f"jax.devices() {d}")

# ---- .tpurun/dump_stacks.py
"""train.py with a sampler thread: every 0.25 s for the first 20 s, each thread's innermost frames (file:line
function) with the time since start, to $OUT/$STACKS. A gap between samples means the sampler could not get the GIL."""
import sys, os, time, runpy, threading, traceback
sys.path.insert(0, '.')
out = open(os.path.join(os.environ.get("OUT", "/tmp"), os.environ.get("STACKS", "stacks.txt")), "w")
T0 = time.perf_counter()
def sampler():
    names = {}
    while time.perf_counter() - T0 < 20:
        time.sleep(0.25)
        now = time.perf_counter() - T0
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            name = names.get(ident, str(ident))
            if name == "stack-sampler":
                continue
            stack = traceback.extract_stack(frame)[-6:]
            out.write(f"{now:7.2f} {name}: " + " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(stack)) + "\n")
        out.flush()
threading.Thread(target=sampler, name="stack-sampler", daemon=True).start()
sys.argv = ['train.py'] + sys.argv[1:]
runpy.run_path("train.py", run_name="__main__")

# ---- .tpurun/dg.py
import time, statistics, sys
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import NamedSharding, Mesh, PartitionSpec as P
print(jax.__version__, jax.devices())
mesh = Mesh(np.array(jax.devices()[:1]), ("data",)); repl = NamedSharding(mesh, P())
f = jax.jit(lambda x: {"train/loss": x.sum(), "train/accuracy": x.mean()}, out_shardings=repl)
x = jax.device_put(jnp.ones((256,)), repl)
stack = jax.jit(lambda ms: jax.tree.map(lambda *xs: jnp.stack(xs), *ms))
for W in (50, 10):
    def window():
        return [f(x * 1.0) for _ in range(W)]
    def T(fn, reps=21):
        r, w = [], []
        for _ in range(reps):
            ms = window(); jax.block_until_ready(ms)
            t, t2 = time.thread_time_ns(), time.perf_counter_ns(); out = fn(ms)
            r.append((time.thread_time_ns() - t) / 1e3); w.append((time.perf_counter_ns() - t2) / 1e3)
        return statistics.median(r), statistics.median(w), out
    t0 = time.perf_counter(); jax.block_until_ready(stack(window())); first = time.perf_counter() - t0
    a, aw, oa = T(lambda ms: jax.device_get(ms))
    b, bw, ob = T(lambda ms: jax.device_get(stack(ms)))
    print(f"window {W}x2 scalars: device_get cpu {a:.0f} us wall {aw:.0f} us; jit stack + device_get cpu {b:.0f} us wall {bw:.0f} us; first stack call {first*1e3:.0f} ms")
    oa2 = {k: np.array([m[k] for m in oa]) for k in oa[0]}
    assert all((oa2[k] == ob[k]).all() and oa2[k].dtype == ob[k].dtype for k in oa2), "mismatch"
