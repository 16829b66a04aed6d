"""What the repository costs over a bare JAX script: four ratios (1 and 8 devices x whole process and steady state).

Default (``--mode processes``), one command for the four ratios: for each setup (``--setups``, default 1 device
fp32 and 8 simulated devices bf16) the main job ``python train.py runtime.cpu_devices=N precision=P`` (10 epochs
MNIST MLP, its defaults otherwise: W&B offline, a checkpoint every epoch, the persistent compilation cache)
against ``benchmarks/bare_train.py`` (the same model, data, order, optimizer and batch as a bare JAX script:
raw arrays, one jitted step, no framework), as whole processes in ``--pairs`` interleaved pairs, the order
alternating (train bare, bare train, ...; with ``--also`` or ``--before``, odd rounds run every variant in the
reverse order too) so that a drift of the shared machine favours neither. One
``train.py`` and one bare run first, not counted, fill the compilation cache (``train.py``'s own, in a
temporary folder: a user's second run) and the OS file cache. Per pair:

- whole process: wall seconds from ``Popen`` to exit, ``train.py`` / bare (goal <= 1.05);
- steady state: examples/s, the median of 50-step windows (``train.py``'s ``perf/examples_per_s``; the bare
  script times the same windows, ``--window``), ``train.py`` / bare (goal >= 0.98).

Printed: every pair (with both sides' start-up to the first step), then per setup the median with min-max over
the pairs, and ``train.py``'s start-up phases (``perf/startup/*_s``, median over the pairs). ``--also OVERRIDES``
adds ``train.py OVERRIDES`` to every round (e.g. ``--also wandb.mode=disabled`` prices W&B), with its own ratios
to the same bare runs. ``--before DIR`` adds every ``train.py`` variant again, run in the checkout ``DIR`` (``git
worktree add DIR <commit>``), to the same rounds: a change measured against the code before it under the same
drift of the machine. ``--bare-cache``: the bare script uses JAX's persistent compilation cache too (its own
folder, warmed by its uncounted run), so that neither side compiles in the counted runs; without it the bare
script compiles every run, as a bare script does, while ``train.py`` loads its programs from its cache.
``--bare-on-device``: the bare script keeps the training split on the devices and gathers each batch inside its
step (``bare_train.py --on-device``), and every ``train.py`` variant gets ``data.on_device=true`` (its default on
a GPU or TPU; off by default on the CPU backend): the like-for-like comparison for the split on the devices.

``--model gpt``: the same four ratios for the language model: ``python train.py model=gpt data=tiny_shakespeare
train.steps=S train.global_batch=B train.log_every=W`` (size tiny: 4 layers, 128 wide, context 128 bytes;
defaults S=30, B=8 windows, W=5; W&B offline, a final checkpoint, the final evaluation over the validation
split) against ``benchmarks/bare_gpt.py`` (the same transformer, Adam, batches and evaluation as raw arrays and
one jitted step; ``tests/test_bare_gpt.py`` checks that it is the same computation). Steady state in tokens/s
(examples/s x 128; the ratio is the same).

``--mode in-process``: the steady-state step loop alone, in one process per setup:

A: the repository's path: typed config -> ``training.build`` (mode, LocalGrads, Updater, donated state) ->
   the data pipeline (global permutation, per-process slice, ``make_array_from_process_local_data``,
   background prefetch) -> the AOT-compiled step, dispatched as ``train.py``'s loop does, with at most
   ``--repo-bound`` (``train.max_in_flight``, 2) steps in flight (0: unbounded).
B: a minimal loop written by hand: the same 784-256-10 tanh MLP as plain ``jnp`` code, ``optax.adam``,
   ``jax.jit`` with the same shardings (params replicated, batch split over the devices), the same host
   batches put on the devices with ``jax.device_put``; at most 2 steps in flight with several devices (on
   XLA:CPU a long queue of simulated-device collectives aborts the process), unbounded on one device, as a
   bare script would be (``benchmarks/bare_train.py``).

Both run in one process, interleaved over ``--pairs`` pairs of ``--steps`` steps each (order alternating).
Printed: each pair's examples/s and ratio (A / B), the median and the interquartile range. On a shared 2-core
machine single pairs range over +-15%: use many short pairs (``--pairs 21``).

    python benchmarks/overhead.py [--setups 1:fp32,8:bf16] [--pairs 3] [--epochs 10] [--also wandb.mode=disabled]
    python benchmarks/overhead.py --model gpt [--pairs 3] [--steps 30] [--batch 8] [--window 5] [--bare-cache]
    python benchmarks/overhead.py --mode in-process [--pairs 21] [--steps 100] [--repo-bound 2]

Needs MNIST prepared (``TFDS_DATA_DIR``); the first ``train.py`` run writes the decoded cache the bare script
reads. ``--model gpt`` needs ``../shared/data/tiny_shakespeare/input.txt`` beside the repository.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STARTUP_PHASES = ("imports", "config", "runtime", "checkpoint", "data", "build", "compile", "reporting", "first_step")


def timed_process(cmd: list[str], env: dict, cwd: str = REPO) -> float:
    """Runs ``cmd`` in ``cwd`` (the repository); returns its wall seconds (``Popen`` to exit). Raises RuntimeError."""
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}): {proc.stderr[-1500:]}")
    return wall


def spread(values: list[float]) -> str:
    """``median (min-max, n=...)`` of ``values``."""
    return f"{statistics.median(values):.3f} (min-max {min(values):.3f}-{max(values):.3f}, n={len(values)})"


def processes(args) -> None:
    """``--mode processes``: whole-process and steady-state ratios of ``train.py`` to the bare script."""
    import json
    import shutil
    import tempfile

    work = tempfile.mkdtemp(prefix="overhead_")
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "PYTHONUNBUFFERED": "1"}
    for var in ("WANDB_API_KEY", "JAX_COMPILATION_CACHE_DIR", "JAX_NUM_CPU_DEVICES", "XLA_FLAGS"):
        env.pop(var, None)
    if env.get("TFDS_DATA_DIR"):  # the same folder from another checkout (--before)
        env["TFDS_DATA_DIR"] = os.path.abspath(env["TFDS_DATA_DIR"])
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        env[var] = os.path.join(work, "wandb_aux")
    # --bare-on-device: every train.py variant keeps the split on the devices too (its default on a GPU or TPU, off on
    # the CPU backend), so that the comparison is like for like; an --also variant may still set it back
    first = ["data.on_device=true"] if args.bare_on_device else []
    variants = [("train.py", first)] + [(f"train.py {' '.join(a)}", first + list(a)) for a in (args.also or [])]
    where = {name: REPO for name, _ in variants}  # the checkout each variant's train.py runs in
    if args.before:  # every variant again, from the other checkout
        where.update({f"before: {name}": os.path.abspath(args.before) for name, _ in variants})
        variants += [(f"before: {name}", extra) for name, extra in variants]
    table = []
    bare_script = "bare_train.py" if args.model == "mlp" else "bare_gpt.py"
    rate = "examples/s" if args.model == "mlp" else "tokens/s"
    per_example = 1 if args.model == "mlp" else 128  # tokens per example (window): model.context of size tiny
    print(
        f"overhead (whole processes): {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start, "
        f"{args.pairs} interleaved pairs per setup, "
        + (
            f"{args.epochs} epochs MNIST MLP, global batch {args.batch}"
            if args.model == "mlp"
            else f"{args.steps} steps GPT size tiny on Tiny Shakespeare, global batch {args.batch} x 128 tokens"
        )
        + f", windows of {args.window} steps (train.log_every), bare script benchmarks/{bare_script} "
        + ("with its own persistent compilation cache (--bare-cache)" if args.bare_cache else "compiling every run")
        + (
            ", the training split on the devices (--bare-on-device; every train.py variant with data.on_device=true)"
            if args.bare_on_device
            else ""
        )
        + (f"; 'before:' variants run in {os.path.abspath(args.before)}" if args.before else ""),
        flush=True,
    )
    try:
        for item in args.setups.split(","):
            devices, precision = item.split(":")
            runs = [0]

            def train(extra: list[str]) -> tuple[list[str], str]:
                runs[0] += 1
                run_dir = os.path.join(work, item.replace(":", "_"), f"run{runs[0]}")
                length = (
                    [f"train.epochs={args.epochs}"]
                    if args.model == "mlp"
                    else ["model=gpt", "data=tiny_shakespeare", f"train.steps={args.steps}"]
                )
                return [
                    sys.executable,
                    "train.py",
                    f"hydra.run.dir={run_dir}",
                    f"runtime.cpu_devices={devices}",
                    f"precision={precision}",
                    *length,
                    f"train.global_batch={args.batch}",
                    f"train.log_every={args.window}",
                    f"runtime.compilation_cache_dir={os.path.join(work, item.replace(':', '_'), 'jax_cache')}",
                    *extra,
                ], run_dir

            def bare() -> tuple[list[str], str]:
                runs[0] += 1
                out = os.path.join(work, item.replace(":", "_"), f"bare{runs[0]}.json")
                script, length = (
                    ("bare_train.py", f"--epochs={args.epochs}")
                    if args.model == "mlp"
                    else ("bare_gpt.py", f"--steps={args.steps}")
                )
                cmd = [
                    sys.executable,
                    os.path.join("benchmarks", script),
                    f"--devices={devices}",
                    f"--precision={precision}",
                    length,
                    f"--batch={args.batch}",
                    f"--window={args.window}",
                    *(
                        [f"--compilation-cache={os.path.join(work, item.replace(':', '_'), 'bare_jax_cache')}"]
                        if args.bare_cache
                        else []
                    ),
                    *(["--on-device"] if args.bare_on_device else []),
                    f"--timings={out}",
                ]
                return cmd, out

            print(f"\n=== {args.model}: {devices} device(s), {precision} ===", flush=True)
            timed_process(train(first)[0], env)  # not counted: compilation cache, OS file cache
            if args.before:
                timed_process(train(first)[0], env, cwd=os.path.abspath(args.before))
            timed_process(bare()[0], env)
            whole: dict[str, list[float]] = {name: [] for name, _ in variants}
            steady: dict[str, list[float]] = {name: [] for name, _ in variants}
            phases: dict[str, list[float]] = {p: [] for p in STARTUP_PHASES}
            cache = []
            for i in range(args.pairs):
                members = [("bare", None)] + variants
                order = round_order(members, i)
                walls, results = {}, {}
                for name, extra in order:
                    cmd, out = bare() if extra is None else train(extra)
                    walls[name] = timed_process(cmd, env, cwd=where.get(name, REPO))
                    with open(out if extra is None else os.path.join(out, "summary.json")) as f:
                        results[name] = json.load(f)
                bare_eps = results["bare"]["window_examples_per_s_median"]
                for name, _ in variants:
                    whole[name].append(walls[name] / walls["bare"])
                    steady[name].append(results[name]["perf/examples_per_s"] / bare_eps)
                s = results["train.py"]
                for p in STARTUP_PHASES:
                    phases[p].append(s.get(f"perf/startup/{p}_s", float("nan")))
                cache.append(s.get("perf/startup/compile_cache"))
                print(
                    f"pair {i} ({' -> '.join(n for n, _ in order)}): "
                    + ", ".join(f"{n} {walls[n]:.2f} s" for n, _ in order)
                    + f"; {rate} (median of windows) train.py {s['perf/examples_per_s'] * per_example:.0f}, "
                    f"bare {bare_eps * per_example:.0f}"
                    + f"; start-up to the first step train.py {s.get('perf/startup_s', float('nan')):.2f} s, "
                    f"bare {results['bare']['first_step']:.2f} s"
                    + "; ratios whole / steady "
                    + ", ".join(f"{n}: {whole[n][-1]:.3f} / {steady[n][-1]:.3f}" for n, _ in variants),
                    flush=True,
                )
            for name, _ in variants:
                print(f"{args.model}, {devices} device(s) {precision}, {name} / bare:")
                print(f"  whole process (goal <= 1.05): {spread(whole[name])}")
                print(f"  steady state, {rate} median of windows (goal >= 0.98): {spread(steady[name])}")
                table.append((f"{args.model} {devices} device(s) {precision}", name, whole[name], steady[name]))
            print(
                f"  train.py start-up phases, median s (compile cache {', '.join(map(str, cache))}): "
                + ", ".join(f"{p} {statistics.median(v):.2f}" for p, v in phases.items())
            )
        print(
            f"\nsummary (median, min-max over {args.pairs} interleaved pairs; load average now "
            f"{os.getloadavg()[0]:.1f}; ratios train.py / bare, steady state in {rate}):"
        )
        for setup, name, w, st in table:
            print(f"  {setup:<24} {name:<40} whole process {spread(w)}   steady state {spread(st)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


PRECISIONS = ("fp32", "bf16")  # what both bare scripts implement


def round_order(members: list, i: int) -> list:
    """The order of round ``i``'s processes, ``members`` = [bare, variant 1, variant 2, ...]: even rounds run the
    variants in order, then bare; odd rounds the reverse (bare, then the variants last to first), so that neither
    bare nor any variant (a ``--before`` one included) always runs first among them."""
    return members[1:] + members[:1] if i % 2 == 0 else members[:1] + members[:0:-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="processes", choices=["processes", "in-process"])
    ap.add_argument(
        "--model",
        default="mlp",
        choices=["mlp", "gpt"],
        help="processes: mlp (MNIST, bare_train.py) or gpt (size tiny, Tiny Shakespeare, bare_gpt.py)",
    )
    ap.add_argument("--setups", default="1:fp32,8:bf16", help="devices:precision, comma-separated")
    ap.add_argument("--devices", type=int, default=None, help="one setup in this process (with --precision)")
    ap.add_argument("--pairs", type=int, default=None, help="default: 3 (processes), 21 (in-process)")
    ap.add_argument("--epochs", type=int, default=10, help="processes: epochs of every run")
    ap.add_argument(
        "--window", type=int, default=None, help="processes: steps per window, train.log_every (mlp 50, gpt 5)"
    )
    ap.add_argument(
        "--also", nargs="+", action="append", help="processes: another train.py variant in every round (overrides)"
    )
    ap.add_argument(
        "--before",
        default=None,
        metavar="DIR",
        help="processes: every train.py variant also from this checkout (e.g. a git worktree of the previous commit), "
        "in the same rounds",
    )
    ap.add_argument(
        "--bare-cache",
        action="store_true",
        help="processes: the bare script uses JAX's persistent compilation cache too (warmed by its uncounted run)",
    )
    ap.add_argument(
        "--bare-on-device",
        action="store_true",
        help="processes, mlp: the bare script keeps the training split on the devices and gathers each batch in its "
        "step (bare_train.py --on-device), and every train.py variant gets data.on_device=true: like for like",
    )
    ap.add_argument("--steps", type=int, default=None, help="in-process: steps per trial (100); gpt: steps (30)")
    ap.add_argument("--batch", type=int, default=None, help="global batch (mlp 256, gpt 8 windows)")
    ap.add_argument("--precision", default="fp32", choices=PRECISIONS)
    ap.add_argument(
        "--repo-bound",
        type=int,
        default=None,
        help="A's steps in flight (default: train.max_in_flight of the schema; 0: unbounded)",
    )
    args = ap.parse_args()
    gpt = args.model == "gpt"
    args.window = args.window or (5 if gpt else 50)
    args.batch = args.batch or (8 if gpt else 256)
    args.steps = args.steps or (30 if gpt else 100)
    if gpt and args.mode != "processes":
        ap.error("--model gpt is measured with --mode processes")
    if args.pairs is not None and args.pairs < 1:
        ap.error(f"--pairs {args.pairs}: must be >= 1")
    for item in args.setups.split(","):
        devices, _, precision = item.partition(":")
        if not devices.isdigit() or int(devices) < 1 or precision not in PRECISIONS:
            ap.error(f"--setups: {item!r} is not devices:precision (devices >= 1, precision fp32 or bf16), e.g. 8:bf16")
    if (args.also or args.before is not None) and (args.mode != "processes" or args.devices is not None):
        ap.error("--also and --before apply to --mode processes without --devices")
    if args.bare_on_device and (gpt or args.mode != "processes"):
        ap.error("--bare-on-device applies to --model mlp with --mode processes")
    if args.before is not None and not os.path.isfile(os.path.join(args.before, "train.py")):
        ap.error(f"--before {args.before}: no train.py there; give a checkout of this repository")
    if args.mode == "processes" and args.devices is None:
        args.pairs = args.pairs or 3
        processes(args)
        return
    args.pairs = args.pairs or 21
    if args.devices is None:  # one child process per setup
        for item in args.setups.split(","):
            devices, precision = item.split(":")
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--mode=in-process",
                f"--devices={devices}",
                f"--precision={precision}",
                f"--pairs={args.pairs}",
                f"--steps={args.steps}",
                f"--batch={args.batch}",
            ]
            if args.repo_bound is not None:
                cmd.append(f"--repo-bound={args.repo_bound}")
            subprocess.run(cmd, check=True)
        return

    import jax

    jax.config.update("jax_num_cpu_devices", args.devices)
    import collections

    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from conf.schema import from_dict
    from data.pipeline import TrainSource, train_batches
    from data.sources import HostDataset, load_tfds_split, resolve_data_dir
    from training.build import build, plan
    from training.build import batches_need_index

    dtype = {"fp32": jnp.float32, "bf16": jnp.bfloat16}[args.precision]
    cfg = from_dict(
        {
            "mesh": {"devices": args.devices},
            "train": {"global_batch": args.batch},
            "precision": {"name": args.precision, "compute_dtype": jnp.dtype(dtype).name},
        }
    )
    tfds_dir = resolve_data_dir(None)
    if tfds_dir and os.path.isdir(os.path.join(tfds_dir, "mnist")):
        # the decoded cache where train.py keeps it (data.cache_dir: $XDG_CACHE_HOME or ~/.cache, then dp_scaling)
        train = load_tfds_split("mnist", "train", tfds_dir, cfg.data.cache_dir)
        data_name = "MNIST"
    else:
        rng = np.random.default_rng(0)
        train = HostDataset(
            rng.integers(0, 256, (60000, 28, 28, 1), dtype=np.uint8), rng.integers(0, 10, 60000).astype(np.int32)
        )
        data_name = "random host data (set TFDS_DATA_DIR for MNIST)"

    # ---- A: the repository -------------------------------------------------------------------------
    p = plan(cfg)
    exp = build(p)
    layout = exp.mode.batch_layout()
    source = TrainSource(train, p.global_batch, cfg.train.seed, with_index=batches_need_index(cfg))
    first = next(train_batches(source, layout, 0, 1, 2))
    step_a = exp.steps.train.lower(exp.state, first).compile()
    state_a = {"s": exp.state, "next": 0}
    bound_a = cfg.train.max_in_flight if args.repo_bound is None else args.repo_bound
    bound_b = 2 if args.devices > 1 else 0

    def run_a(n: int) -> float:
        batches = train_batches(source, layout, state_a["next"], state_a["next"] + n, cfg.data.prefetch)
        state, in_flight = state_a["s"], collections.deque()
        t0 = time.perf_counter()
        for batch in batches:
            state, metrics = step_a(state, batch)
            in_flight.append(metrics)
            if bound_a and len(in_flight) > bound_a:
                jax.block_until_ready(in_flight.popleft())
        jax.block_until_ready(state)
        dt = time.perf_counter() - t0
        state_a["s"], state_a["next"] = state, state_a["next"] + n
        return dt / n

    # ---- B: minimal hand-written loop ----------------------------------------------------------------
    mesh = exp.mode.mesh
    repl, data_sh = NamedSharding(mesh, P()), NamedSharding(mesh, P(("data", "fsdp")))
    key = jax.random.key(0)
    k1, k2 = jax.random.split(key)
    params = {
        "w1": 0.01 * jax.random.normal(k1, (784, 256)),
        "b1": jnp.zeros(256),
        "w2": 0.01 * jax.random.normal(k2, (256, 10)),
        "b2": jnp.zeros(10),
    }
    tx = optax.adam(1e-3)
    params = jax.device_put(params, repl)
    opt_state = jax.device_put(tx.init(params), repl)

    def loss_fn(params, x, y):
        c = jax.tree.map(lambda a: a.astype(dtype), params)
        x = (x.astype(jnp.float32) / 255.0).reshape(x.shape[0], -1).astype(dtype)
        logits = (jnp.tanh(x @ c["w1"] + c["b1"]) @ c["w2"] + c["b2"]).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    @jax.jit
    def step_b(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step_b = jax.jit(
        step_b, in_shardings=(repl, repl, data_sh, data_sh), out_shardings=(repl, repl, repl), donate_argnums=(0, 1)
    )
    state_b = {"p": params, "o": opt_state, "next": 0}

    def run_b(n: int) -> float:
        params, opt_state, in_flight = state_b["p"], state_b["o"], collections.deque()
        t0 = time.perf_counter()
        for s in range(state_b["next"], state_b["next"] + n):
            idx = source.global_indices(s)
            x = jax.device_put(train.images[idx], data_sh)
            y = jax.device_put(train.labels[idx], data_sh)
            params, opt_state, loss = step_b(params, opt_state, x, y)
            if bound_b:
                in_flight.append(loss)
                if len(in_flight) > bound_b:
                    jax.block_until_ready(in_flight.popleft())
        jax.block_until_ready(params)
        dt = time.perf_counter() - t0
        state_b.update(p=params, o=opt_state, next=state_b["next"] + n)
        return dt / n

    run_a(20), run_b(20)  # warm up (compile, caches)
    ratios = []
    print(
        f"overhead: {args.devices} device(s), global batch {args.batch}, {args.precision}, {data_name}, "
        f"{args.steps} steps per trial, platform {jax.devices()[0].platform}, steps in flight: repo "
        f"{bound_a or 'unbounded'}, hand-written {bound_b or 'unbounded'}, load average {os.getloadavg()[0]:.1f}",
        flush=True,
    )
    for i in range(args.pairs):
        if i % 2 == 0:
            a, b = run_a(args.steps), run_b(args.steps)
        else:
            b, a = run_b(args.steps), run_a(args.steps)
        ratios.append(b / a)  # examples/s ratio = inverse step-time ratio
        print(
            f"pair {i}: repo {args.batch / a:.0f} examples/s  hand-written {args.batch / b:.0f} examples/s  "
            f"ratio {b / a:.3f}",
            flush=True,
        )
    med = statistics.median(ratios)
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else (med, med, med)
    print(
        f"{args.devices} device(s) {args.precision}: median examples/s ratio (repo / hand-written) {med:.3f}, "
        f"interquartile range {q1:.3f}-{q3:.3f} (goal >= 0.98: {'met' if med >= 0.98 else 'NOT met'})",
        flush=True,
    )


if __name__ == "__main__":
    main()
