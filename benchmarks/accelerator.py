"""train.py against a bare JAX script of the same model on whatever accelerator is present, and the GPT's limits
there.

    python benchmarks/accelerator.py                     # every part (on a TPU: more than one device call)
    python benchmarks/accelerator.py --part steps        # one part: steps, startup, levers, init, memory, profile
    python benchmarks/accelerator.py --quick             # tiny sizes on the CPU, in under a minute (CI runs it)
    python benchmarks/accelerator.py --part steps --workloads resnet18_b256,vit_s_b256 --pairs 1
    python benchmarks/accelerator.py --report A.jsonl B.jsonl   # the parts' records as one table

Workloads (``WORKLOADS``): ``char``, nanoGPT's Shakespeare-char size (6 layers x 384, 6 heads, context 256, byte
vocabulary, global batch 64), and ``gpt2_small`` (``model.size=gpt2_small``: 124M parameters, context 1024,
vocabulary 50,257, global batch 16), on Tiny Shakespeare's bytes; the image models on ``data=synthetic`` of
32x32x3 images, 10 classes (``--part steps`` only): ``resnet18_b256`` and ``resnet18_b1024`` (``model=resnet``,
ResNet-18 width 64, 11.2M parameters, global batch 256 or 1,024), ``vit_s_b256`` and ``vit_s_b1024``
(``model=vit``, 384 x 12, 6 heads, patch 4: 64 patches and the class token, 21.3M parameters). bf16 on one
device, W&B off.

Parts:
- ``steps``: ``train.py`` and ``benchmarks/bare_gpt.py`` (the same model, optimizer, batches, dropout scheme and
  kernels, as a plain script) as separate processes, interleaved (``--pairs`` rounds, the order alternating),
  each workload without and with dropout (``--dropouts``). Steady state: tokens/s, the median of windows of
  ``train.log_every`` steps (the first dropped) in both; the ratio train.py / bare per round, then the median and
  min-max over rounds. MFU: ``(6 N + 12 L d T)`` FLOPs per token (``models.gpt.flops_per_token``; N without the
  vocabulary's padding rows) x tokens/s / the chip's peak. Start-up: the first round runs with empty compilation
  caches (cold), the rest warm; train.py's time to its first step (``perf/startup_s``) and its phases, against the
  bare script's. An image workload runs against ``benchmarks/bare_resnet.py`` or ``bare_vit.py`` (no dropout, no
  levers): examples/s, MFU from the counted FLOPs per example (``models.resnet.flops_per_example``,
  ``models.vit.flops_per_example``: 6 x the multiply-adds of the convolutions and matmuls) and, beside it, from
  XLA's count (train.py's ``perf/mfu``), and each side's peak device memory.
- ``startup``: each step of a start-up in a fresh process, cold (empty compilation cache) then warm: JAX's import,
  the backend's start, the product's imports, the plan, the state's creation on the host's CPU backend (lower,
  compile, run, placing) and op by op on the device, the product's build, the train step's lowering, compilation
  (a cache load when warm), compiled-program metrics and first run, and the bare script's op-by-op creation.
- ``levers``: in one process, the bare script's step and the product's step (``training.build``) on the same
  device-resident batch, with each speed lever on or off (attention kernel, fused chunked loss, padded
  vocabulary, per-example vs per-step dropout keys): step time, tokens/s, MFU, compile time, compiled memory.
- ``init``: the product's state creation (``ParallelMode.init_state``): trace, compile and run time, op by op on
  the device then placed (the default for a replicated state on an accelerator), and as one program on the
  device.
- ``profile``: the two compiled steps side by side under ``jax.profiler``: device time per step by kind of op
  (matmuls, Pallas kernels, other fusions, collectives, copies; ``hlo_categories``) and the top ops of each.
- ``memory``: GPT-2 small and medium, every ``model.remat`` policy x global batch: whether the step fits in the
  chip's memory (XLA's compiled memory analysis; a program that does not fit fails to compile), and where it
  fits, tokens/s, MFU and the compiled peak bytes.

Each part prints its table and appends JSON records to ``--record`` (default ``accelerator_records.jsonl`` in
``$OUT`` when set, else the current folder); ``--report`` prints all records as one table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# name -> (model dims for train.py's model.* and the bare script's flags, global batch, steps, window); an image
# model's dict names it (model=resnet|vit, trained on data=synthetic of IMAGE_SHAPE), a GPT's has a size preset
RESNET18 = {"name": "resnet", "width": 64}
VIT_S = {"name": "vit", "width": 384, "depth": 12, "heads": 6, "patch": 4, "mlp_ratio": 4}
WORKLOADS = {
    "char": ({"size": "tiny", "vocab": 256, "context": 256, "width": 384, "depth": 6, "heads": 6}, 64, 160, 20),
    "gpt2_small": ({"size": "gpt2_small"}, 16, 40, 5),
    "resnet18_b256": (RESNET18, 256, 300, 50),
    "resnet18_b1024": (RESNET18, 1024, 120, 20),
    "vit_s_b256": (VIT_S, 256, 120, 20),
    "vit_s_b1024": (VIT_S, 1024, 60, 10),
}
TINY_RESNET = {"name": "resnet", "width": 8}
TINY_VIT = {"name": "vit", "width": 32, "depth": 2, "heads": 2, "patch": 4, "mlp_ratio": 4}
QUICK = {
    "char": ({"size": "tiny", "vocab": 256, "context": 128, "width": 64, "depth": 2, "heads": 2}, 8, 12, 3),
    "gpt2_small": ({"size": "tiny", "vocab": 512, "context": 128, "width": 64, "depth": 2, "heads": 2}, 4, 12, 3),
    "resnet18_b256": (TINY_RESNET, 16, 9, 3),
    "resnet18_b1024": (TINY_RESNET, 32, 9, 3),
    "vit_s_b256": (TINY_VIT, 16, 9, 3),
    "vit_s_b1024": (TINY_VIT, 32, 9, 3),
}
IMAGE_SHAPE, CLASSES = (32, 32, 3), 10
BARE_IMAGE = {"resnet": "benchmarks/bare_resnet.py", "vit": "benchmarks/bare_vit.py"}


def is_image(model: dict) -> bool:
    """Whether a workload's model is an image classifier (``model=resnet|vit``), not the GPT."""
    return model.get("name", "gpt") != "gpt"


def image_flops_per_example(model: dict) -> float:
    """Counted training FLOPs per example of an image workload (``models.resnet.flops_per_example``,
    ``models.vit.flops_per_example``: 6 x the multiply-adds of the convolutions and matmuls)."""
    from models.resnet import flops_per_example as resnet_flops
    from models.vit import flops_per_example as vit_flops

    if model["name"] == "resnet":
        return resnet_flops(IMAGE_SHAPE, CLASSES, model["width"])
    dims = {k: model[k] for k in ("width", "depth", "patch", "mlp_ratio")}
    return vit_flops(IMAGE_SHAPE, CLASSES, **dims)


def image_train_args(model: dict, batch: int, steps: int, window: int) -> list[str]:
    """train.py overrides of an image workload: ``model=<name> data=synthetic data.image_shape=[32,32,3]``, one
    device, bf16, W&B off, no checkpoint."""
    return [
        f"model={model['name']}",
        "data=synthetic",
        f"data.image_shape=[{','.join(map(str, IMAGE_SHAPE))}]",
        f"data.num_classes={CLASSES}",
        "precision=bf16",
        "mesh.devices=1",
        *[f"model.{k}={v}" for k, v in model.items() if k != "name"],
        f"train.global_batch={batch}",
        f"train.steps={steps}",
        f"train.log_every={window}",
        "wandb.mode=disabled",
        "checkpoint.enabled=false",
    ]


def image_bare_args(model: dict, batch: int, steps: int, window: int) -> list[str]:
    """``benchmarks/bare_resnet.py`` / ``bare_vit.py`` and its flags for the same workload."""
    return [
        BARE_IMAGE[model["name"]],
        "--devices=1",
        "--precision=bf16",
        f"--image-shape={','.join(map(str, IMAGE_SHAPE))}",
        f"--classes={CLASSES}",
        f"--batch={batch}",
        f"--steps={steps}",
        f"--window={window}",
        *[f"--{k.replace('_', '-')}={v}" for k, v in model.items() if k != "name"],
    ]


def gpt_workloads(names: list[str], workloads: dict, part: str) -> list[str]:
    """The GPT workloads of ``names`` (the parts other than ``steps`` measure the GPT); says which it leaves out."""
    images = [n for n in names if is_image(workloads[n][0])]
    if images:
        print(f"{part}: {', '.join(images)} left out (this part measures the GPT workloads)", flush=True)
    return [n for n in names if n not in images]


def dims_of(model: dict) -> dict:
    """Resolved (vocab, context, width, depth, heads) of a workload's model dict."""
    from models.gpt import SIZES

    v, t, w, d, h = SIZES[model["size"]]
    return {
        "vocab": model.get("vocab", v),
        "context": model.get("context", t),
        "width": model.get("width", w),
        "depth": model.get("depth", d),
        "heads": model.get("heads", h),
    }


def flops_per_token(model: dict) -> float:
    """``6 N + 12 L d T`` (``models.gpt.flops_per_token``), N the parameters without padding rows."""
    from models.gpt import flops_per_token as fpt, param_count_of, resolve_dims

    d = dims_of(model)
    dims = resolve_dims(
        model["size"], vocab_size=d["vocab"], context=d["context"], width=d["width"], depth=d["depth"], heads=d["heads"]
    )
    return fpt(param_count_of(dims), dims.depth, dims.width, dims.context)


def peak_flops(device_kind: str) -> float | None:
    """The chip's bf16 peak FLOP/s from its hardware profile (``measure.compiled.lookup_peak_flops_per_s``), None
    where none is known (CPU)."""
    from measure.compiled import lookup_peak_flops_per_s

    found = lookup_peak_flops_per_s(device_kind, "bfloat16")
    return float(found) if found else None


def train_args(model: dict, batch: int, steps: int, window: int, extra: dict) -> list[str]:
    """train.py overrides of a workload (one device, bf16, W&B off, no periodic checkpoint, no sample)."""
    d = dims_of(model)
    args = [
        "model=gpt",
        "data=tiny_shakespeare",
        "precision=bf16",
        "mesh.devices=1",
        f"model.size={model['size']}",
        f"model.vocab_size={d['vocab']}",
        f"model.context={d['context']}",
        f"model.width={d['width']}",
        f"model.depth={d['depth']}",
        f"model.heads={d['heads']}",
        f"train.global_batch={batch}",
        f"train.steps={steps}",
        f"train.log_every={window}",
        "train.sample_tokens=0",
        "wandb.mode=disabled",
        "checkpoint.enabled=false",
    ]
    return args + [f"model.{k}={v}" for k, v in extra.items()]


def bare_args(model: dict, batch: int, steps: int, window: int, extra: dict) -> list[str]:
    """benchmarks/bare_gpt.py flags of the same workload; ``extra`` in train.py's model.* names."""
    d = dims_of(model)
    names = {
        "attention": "--attention",
        "loss_chunk": "--loss-chunk",
        "vocab_multiple": "--vocab-multiple",
        "dropout": "--dropout",
        "attention_dropout": "--attention-dropout",
        "remat": "--remat",
    }
    args = [
        "--devices=1",
        "--precision=bf16",
        f"--size={model['size']}",
        f"--batch={batch}",
        f"--steps={steps}",
        f"--window={window}",
        "--no-eval",
    ] + [f"--{k}={v}" for k, v in d.items()]
    extra = {"attention": "auto", **extra}  # train.py's default kernel choice, resolved the same way
    return args + [f"{names[k]}={v}" for k, v in extra.items()]


def spread(values: list[float]) -> str:
    """``median (min-max)``."""
    if not values:
        return "n/a"
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def record(path: str, part: str, **fields) -> None:
    """Appends one JSON record to ``path``."""
    with open(path, "a") as f:
        f.write(json.dumps({"part": part, **fields}) + "\n")


def run(cmd: list[str], env: dict, cwd: Path = REPO, timeout: float = 900) -> float:
    """Runs ``cmd``; returns its wall time (s). Raises RuntimeError with the output's tail when it fails."""
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if p.returncode:
        raise RuntimeError(f"{' '.join(cmd[:3])} ... exited {p.returncode}:\n{(p.stdout + p.stderr)[-3000:]}")
    return time.perf_counter() - t0


# ---- part: steps -----------------------------------------------------------------------------------------------
def part_steps(args, workloads: dict, out: str) -> None:
    """train.py against its bare script (bare_gpt.py, bare_resnet.py, bare_vit.py), interleaved; start-up cold
    (first round) and warm."""
    # no jax device in this process: the accelerator is the subprocesses' (a TPU admits one process at a time)
    kind, peak = "?", None
    levers = dict(kv.split("=", 1) for kv in args.levers) if args.levers else {}
    work = Path(tempfile.mkdtemp(prefix="accelerator_"))
    env = {**os.environ, "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
    print(f"== steps: {args.pairs} interleaved rounds, levers {levers or 'the defaults'}", flush=True)
    try:
        for name in args.workloads:
            model, batch, steps, window = workloads[name]
            image = is_image(model)
            # FLOPs per unit of work: an example of an image model, a token of the GPT
            per_unit = image_flops_per_example(model) if image else flops_per_token(model)
            tokens = 1 if image else dims_of(model)["context"]
            unit = "examples" if image else "tokens"
            rates = [0.0] if image else args.dropouts  # the bare image scripts have no dropout (ResNet-18 has none)
            if image and (levers or args.dropouts != [0.0]):
                print(f"{name}: dropout 0 and the defaults (--dropouts and --levers are the GPT's)", flush=True)
            for rate in rates:
                extra = {} if image else {**levers, **({"dropout": rate} if rate else {})}
                tag = name if image else f"{name} dropout={rate}"
                caches = work / f"{name}_dropout{rate:g}"
                ratios, prod_rate, bare_rate, starts, kernel, mems, xla_mfu = [], [], [], [], None, [], []
                for i in range(args.pairs):
                    res: dict = {}
                    for who in ("train", "bare") if i % 2 == 0 else ("bare", "train"):
                        if who == "train":
                            rd = caches / f"run{i}"
                            overrides = (
                                image_train_args(model, batch, steps, window)
                                if image
                                else train_args(model, batch, steps, window, extra)
                            )
                            cmd = [
                                sys.executable,
                                "train.py",
                                *overrides,
                                f"hydra.run.dir={rd}",
                                f"runtime.compilation_cache_dir={caches / 'cache_train'}",
                            ]
                            wall = run(cmd, env)
                            s = json.loads((rd / "summary.json").read_text())
                            res["train"] = (s["perf/examples_per_s"] * tokens, s.get("perf/startup_s"), wall, s)
                        else:
                            tj = caches / f"bare{i}.json"
                            script = (
                                image_bare_args(model, batch, steps, window)
                                if image
                                else ["benchmarks/bare_gpt.py", *bare_args(model, batch, steps, window, extra)]
                            )
                            cmd = [
                                sys.executable,
                                *script,
                                f"--timings={tj}",
                                f"--compilation-cache={caches / 'cache_bare'}",
                            ]
                            wall = run(cmd, env)
                            b = json.loads(tj.read_text())
                            got = b["window_examples_per_s_median"] if image else b["window_tokens_per_s_median"]
                            res["bare"] = (got, b["first_step"], wall, b)
                            kind, peak = b["device_kind"], peak_flops(b["device_kind"])
                            kernel = b.get("attention")
                    p, b = res["train"], res["bare"]
                    ratios.append(p[0] / b[0])
                    prod_rate.append(p[0])
                    bare_rate.append(b[0])
                    xla_mfu.append(p[3].get("perf/mfu"))
                    mems.append(
                        {
                            "train_peak_bytes": p[3].get("mem/peak_bytes_per_device"),
                            "bare_peak_bytes": b[3].get("peak_bytes_in_use"),
                        }
                    )
                    phases = {
                        k.split("/")[-1][:-2]: round(v, 2)
                        for k, v in p[3].items()
                        if k.startswith("perf/startup/") and k.endswith("_s")
                    }
                    starts.append(
                        {
                            "round": i,
                            "cold": i == 0,
                            "train_first_step_s": p[1],
                            "bare_first_step_s": b[1],
                            "train_wall_s": p[2],
                            "bare_wall_s": b[2],
                            "phases": phases,
                            "cache": p[3].get("perf/startup/compile_cache"),
                        }
                    )
                    mfu = (
                        ""
                        if not peak
                        else f", MFU train.py {p[0] * per_unit / peak:.1%} bare {b[0] * per_unit / peak:.1%}"
                    )
                    print(
                        f"{tag} round {i} ({'cold' if i == 0 else 'warm'}): "
                        f"{unit}/s train.py {p[0]:,.0f} bare {b[0]:,.0f} "
                        f"ratio {p[0] / b[0]:.3f}{mfu}; first step train.py {p[1]:.1f} s bare {b[1]:.1f} s; "
                        f"train.py phases {phases}",
                        flush=True,
                    )
                summary = {
                    "workload": name,
                    "dropout": rate,
                    "levers": levers if not image else {},
                    "device_kind": kind,
                    "attention": kernel,
                    "ratio": ratios,
                    f"train_{unit}_per_s": prod_rate,
                    f"bare_{unit}_per_s": bare_rate,
                    "mfu_train": [x * per_unit / peak for x in prod_rate] if peak else None,
                    "mfu_bare": [x * per_unit / peak for x in bare_rate] if peak else None,
                    "startup": starts,
                }
                if image:  # the counted FLOPs of the MFU, and XLA's (train.py's perf/mfu) beside them
                    summary.update(
                        model=model,
                        global_batch=batch,
                        flops_per_example=per_unit,
                        mfu_train_xla=xla_mfu,
                        memory=mems,
                    )
                record(out, "steps", **summary)
                print(
                    f"{tag}: steady-state ratio train.py / bare {spread(ratios)} over {len(ratios)} rounds", flush=True
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ---- in-process helpers (levers, init, memory) -------------------------------------------------------------------
def product_cfg(model: dict, batch: int, extra: dict):
    """The typed Config of a workload (as train.py builds it), with ``extra`` model keys."""
    from conf.schema import from_dict

    d = dims_of(model)
    gpt = {
        "name": "gpt",
        "size": model["size"],
        "vocab_size": d["vocab"],
        "context": d["context"],
        "width": d["width"],
        "depth": d["depth"],
        "heads": d["heads"],
        **extra,
    }
    return from_dict(
        {
            "model": gpt,
            "data": {"name": "tiny_shakespeare", "tfds_name": None},  # as conf/data/tiny_shakespeare.yaml
            "mesh": {"devices": 1},
            "precision": {"name": "bf16", "compute_dtype": "bfloat16", "loss_scale": "none"},
            "train": {"global_batch": batch},
            "wandb": {"mode": "disabled"},
        }
    )


def timed_steps(step, carry, steps: int, window: int) -> tuple[float, list[float], object]:
    """Runs ``carry = step(carry)`` ``steps`` times; returns (median s per step over windows after the first, all,
    the last carry)."""
    import jax

    per_step = []
    t = time.perf_counter()
    for s in range(steps):
        carry = step(carry)
        if (s + 1) % window == 0:
            jax.block_until_ready(carry)
            now = time.perf_counter()
            per_step.append((now - t) / window)
            t = now
    return statistics.median(per_step[1:] if len(per_step) > 1 else per_step), per_step, carry


def bare_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bare_gpt", str(REPO / "benchmarks" / "bare_gpt.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measure_product(
    model: dict, batch: int, extra: dict, steps: int, window: int, profile_dir: str | None = None
) -> dict:
    """The product's jitted train step (``training.build``) on one device-resident batch: compile time, compiled
    memory, median step time; with ``profile_dir``, the device time of its ops over ``window`` more steps
    (``op_breakdown``)."""
    import jax
    import numpy as np

    from measure.compiled import compiled_peak_bytes
    from training.build import build, plan

    t0 = time.perf_counter()
    p = plan(product_cfg(model, batch, extra))
    exp = build(p)
    jax.block_until_ready(exp.state)
    build_s = time.perf_counter() - t0
    t = dims_of(model)["context"]
    rng = np.random.default_rng(0)
    host = {
        "image": rng.integers(0, 256, (batch, t)).astype(np.int32),
        "label": rng.integers(0, 256, (batch, t)).astype(np.int32),
        "index": np.arange(batch, dtype=np.int32),
    }
    placed = exp.mode.batch_layout().place(host, batch)
    t0 = time.perf_counter()
    compiled = exp.steps.train.lower(exp.state, placed).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled_peak_bytes(compiled)
    one = lambda st: compiled(st, placed)[0]  # noqa: E731
    step_s, _, state = timed_steps(one, exp.state, steps, window)
    res = {"compile_s": compile_s, "step_s": step_s, "compiled_peak_bytes": mem["peak_bytes"], "build_s": build_s}
    if profile_dir:
        res["ops"] = profiled(one, compiled, state, window, profile_dir)
    return res


def measure_bare(
    model: dict,
    batch: int,
    extra: dict,
    steps: int,
    window: int,
    dropout_keys: str = "per_example",
    profile_dir: str | None = None,
) -> dict:
    """The bare script's jitted step (its own functions) on one device-resident batch (``profile_dir``: as
    ``measure_product``)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from measure.compiled import compiled_peak_bytes

    bare = bare_module()
    d = dims_of(model)
    rows = -(-d["vocab"] // int(extra.get("vocab_multiple", 1))) * int(extra.get("vocab_multiple", 1))
    params = jax.device_put(bare.init_params(jax.random.key(0), d["depth"], d["width"], rows, d["context"]))
    tx = optax.adam(1e-3)
    opt = jax.device_put(tx.init(params))
    kw = {
        "kind": extra.get("attention", "xla"),
        "rate": float(extra.get("dropout", 0.0)),
        "remat": extra.get("remat", "none"),
        "loss_chunk": int(extra.get("loss_chunk", 0)),
    }
    step = jax.jit(
        bare.make_train_step(tx, jnp.bfloat16, d["heads"], d["vocab"], 0, dropout_keys, **kw), donate_argnums=(0, 1)
    )
    rng = np.random.default_rng(0)
    x, y = (jax.device_put(rng.integers(0, 256, (batch, d["context"])).astype(np.int32)) for _ in range(2))
    index = jax.device_put(np.arange(batch, dtype=np.int32))
    t0 = time.perf_counter()
    compiled = step.lower(params, opt, x, y, np.int32(0), index).compile()
    compile_s = time.perf_counter() - t0
    mem = compiled_peak_bytes(compiled)

    def one(carry):
        p, o, s = carry
        p, o, _ = compiled(p, o, x, y, s, index)
        return p, o, s + 1

    step_s, _, carry = timed_steps(one, (params, opt, jnp.int32(0)), steps, window)
    res = {"compile_s": compile_s, "step_s": step_s, "compiled_peak_bytes": mem["peak_bytes"]}
    if profile_dir:
        res["ops"] = profiled(one, compiled, carry, window, profile_dir)
    return res


def hlo_categories(hlo_text: str) -> dict[str, str]:
    """{instruction name: category} of a compiled HLO module: ``matmul`` (a dot or convolution, or a fusion
    holding one), ``kernel`` (a custom call: a Pallas kernel), ``collective``, ``copy/layout``, ``fusion`` (the
    other fusions: elementwise and reductions), else the opcode."""
    import re

    bodies: dict[str, str] = {}
    for m in re.finditer(r"^(?:ENTRY )?%?([\w.\-]+) [^\n]*\{\n(.*?)^\}", hlo_text, re.M | re.S):
        bodies[m.group(1)] = m.group(2)
    cats = {}
    for m in re.finditer(r"^\s*(?:ROOT )?%?([\w.\-]+) = [^=]*? ([a-z][\w\-]*)\((.*)$", hlo_text, re.M):
        name, op, rest = m.groups()
        if op == "fusion":
            called = re.search(r"calls=%?([\w.\-]+)", rest)
            body = bodies.get(called.group(1), "") if called else ""
            cats[name] = "matmul" if re.search(r" (dot|convolution)\(", body) else "fusion"
        elif op in ("dot", "convolution"):
            cats[name] = "matmul"
        elif op == "custom-call":
            cats[name] = "kernel"
        elif op.split("-start")[0].split("-done")[0] in (
            "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute"
        ):  # fmt: skip
            cats[name] = "collective"
        elif op in ("copy", "transpose", "bitcast", "reshape", "copy-start", "copy-done"):
            cats[name] = "copy/layout"
        else:
            cats[name] = op
    return cats


def profiled(one, compiled, carry, steps: int, profile_dir: str) -> dict:
    """Device time per step of the ops of ``compiled`` over ``steps`` calls of ``one`` traced by ``jax.profiler``:
    ``{"categories": {category: s}, "top": [[op, category, s], ...], "total_s": s}`` (``hlo_categories``)."""
    import jax

    from measure.profiler import find_trace_file, read_trace_events

    carry = one(carry)
    jax.block_until_ready(carry)
    jax.profiler.start_trace(profile_dir)
    for _ in range(steps):
        carry = one(carry)
    jax.block_until_ready(carry)
    jax.profiler.stop_trace()
    return device_time_by_op(read_trace_events(find_trace_file(Path(profile_dir))), compiled.as_text(), steps)


def device_time_by_op(events: list[dict], hlo_text: str, steps: int) -> dict:
    """Device time per step of a compiled module's ops in a ``jax.profiler`` trace's events (Chrome JSON):
    ``{"categories": {category: s}, "top": [[op, category, s], ...], "total_s": s}``. CPU and GPU traces name the
    op and its module in the event's arguments (``hlo_op``, ``hlo_module``); TPU traces name the op in the event
    and give XLA's ``hlo_category`` beside it (the category when ``hlo_categories`` does not know the op)."""
    cats = hlo_categories(hlo_text)
    module = hlo_text.split("\n", 1)[0].split()[1].rstrip(",") if hlo_text.startswith("HloModule") else None
    per_op: dict[str, float] = {}
    xla_category: dict[str, str] = {}
    for e in events:
        args = e.get("args") or {}
        if e.get("ph") != "X":
            continue
        if "hlo_op" in args:
            if module and args.get("hlo_module", module) != module:
                continue
            op = args["hlo_op"]
        elif "hlo_category" in args:
            op = e["name"]
            xla_category[op] = args["hlo_category"]
        else:
            continue
        per_op[op] = per_op.get(op, 0.0) + float(e.get("dur", 0.0)) * 1e-6 / steps
    category = {op: cats.get(op, xla_category.get(op, "other")) for op in per_op}
    categories: dict[str, float] = {}
    for op, sec in per_op.items():
        categories[category[op]] = categories.get(category[op], 0.0) + sec
    top = sorted(per_op.items(), key=lambda kv: -kv[1])[:12]
    return {
        "categories": dict(sorted(categories.items(), key=lambda kv: -kv[1])),
        "top": [[op, category[op], sec] for op, sec in top],
        "total_s": sum(per_op.values()),
    }


def describe(res: dict, tokens: int, fpt: float, peak: float | None) -> str:
    tps = tokens / res["step_s"]
    mfu = f" MFU {tps * fpt / peak:5.1%}" if peak else ""
    build = f"  build {res['build_s']:5.1f} s" if "build_s" in res else ""
    return (
        f"step {res['step_s'] * 1e3:8.2f} ms  {tps:11,.0f} tokens/s{mfu}  compile {res['compile_s']:6.1f} s  "
        f"compiled peak {res['compiled_peak_bytes'] / 2**30:6.2f} GiB{build}"
    )


def part_levers(args, workloads: dict, out: str) -> None:
    """The bare step and the product's step, each lever on and off, in this process."""
    import jax

    kind = jax.devices()[0].device_kind
    peak = peak_flops(kind)
    tpu = jax.default_backend() == "tpu"
    fast = "splash" if tpu else "xla"
    print(f"== levers: {kind}", flush=True)
    for name in gpt_workloads(args.workloads, workloads, "levers"):
        model, batch, _, window = workloads[name]
        steps = 4 * window if not args.quick else 2 * window
        tokens = batch * dims_of(model)["context"]
        fpt = flops_per_token(model)
        big_vocab = dims_of(model)["vocab"] > 1024
        variants = [("bare", {"attention": "xla"}, "per_example")]
        if fast != "xla":
            variants.append(("bare", {"attention": fast}, "per_example"))
        if big_vocab:
            variants += [
                ("bare", {"attention": fast, "loss_chunk": 4096}, "per_example"),
                ("bare", {"attention": fast, "vocab_multiple": 128}, "per_example"),
            ]
        else:
            variants += [
                ("bare", {"attention": fast, "dropout": 0.2}, "per_example"),
                ("bare", {"attention": fast, "dropout": 0.2}, "per_step"),
            ]
        variants += [("product", {"attention": "auto"}, None)]
        if big_vocab:
            variants += [("product", {"attention": "auto", "loss_chunk": 4096}, None)]
        else:
            variants += [("product", {"attention": "auto", "dropout": 0.2}, None)]
        if args.quick:  # XLA's attention with and without dropout, both sides
            variants = [v for v in variants if v[1].get("attention") in ("xla", "auto") and not v[1].get("loss_chunk")]
        for who, extra, keys in variants:
            label = f"{name} {who} {extra}" + (f" keys={keys}" if keys and "dropout" in extra else "")
            try:
                res = (
                    measure_bare(model, batch, extra, steps, window, keys or "per_example")
                    if who == "bare"
                    else measure_product(model, batch, extra, steps, window)
                )
            except Exception as e:  # one variant failing (e.g. out of memory) must not lose the others
                print(f"{label}: failed: {str(e).splitlines()[0][:300]}", flush=True)
                record(
                    out, "levers", workload=name, who=who, extra=extra, keys=keys, error=str(e)[:500], device_kind=kind
                )
                continue
            print(f"{label:80s} {describe(res, tokens, fpt, peak)}", flush=True)
            record(
                out,
                "levers",
                workload=name,
                who=who,
                extra=extra,
                keys=keys,
                device_kind=kind,
                tokens_per_s=tokens / res["step_s"],
                mfu=(tokens / res["step_s"] * fpt / peak) if peak else None,
                **res,
            )


def part_profile(args, workloads: dict, out: str) -> None:
    """The product's step and the bare script's, side by side: device time per step by kind of op."""
    import jax

    kind = jax.devices()[0].device_kind
    print(f"== profile: {kind}", flush=True)
    work = Path(tempfile.mkdtemp(prefix="accelerator_profile_"))
    try:
        for name in gpt_workloads(args.workloads, workloads, "profile"):
            model, batch, _, window = workloads[name]
            steps = 2 * window
            extra = {"attention": "auto" if not args.quick else "xla"}
            bare_extra = {"attention": resolve_auto(dims_of(model)["context"])} if not args.quick else extra
            prod = measure_product(model, batch, extra, steps, window, str(work / f"{name}_product"))["ops"]
            bare = measure_bare(model, batch, bare_extra, steps, window, profile_dir=str(work / f"{name}_bare"))["ops"]
            print(f"{name}: device time per step, ms (train.py's step | bare script's step)", flush=True)
            for cat in sorted(
                set(prod["categories"]) | set(bare["categories"]), key=lambda c: -prod["categories"].get(c, 0)
            ):
                ms = [side["categories"].get(cat, 0) * 1e3 for side in (prod, bare)]
                print(f"  {cat:16s} {ms[0]:9.3f} | {ms[1]:9.3f}")
            print(f"  {'total':16s} {prod['total_s'] * 1e3:9.3f} | {bare['total_s'] * 1e3:9.3f}", flush=True)
            for label, ops in (("train.py", prod), ("bare", bare)):
                print(
                    f"  {label} top ops: "
                    + ", ".join(f"{op} ({cat}) {sec * 1e3:.3f}" for op, cat, sec in ops["top"][:8])
                )
            record(out, "profile", workload=name, device_kind=kind, product=prod, bare=bare)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def resolve_auto(context: int) -> str:
    """``model.attention=auto``'s kernel on this process's backend (``models.attention.resolve_attention``)."""
    from models.attention import resolve_attention

    return resolve_attention("auto", context)


def part_init(args, workloads: dict, out: str) -> None:
    """The product's state creation (``ParallelMode.init_state``), trace + compile + run: op by op on the device
    then placed (the default for a replicated state off the CPU), and as one program on the device."""
    import jax

    from parallel import make_mesh, mode_class
    from training.build import _optimizer, plan, state_init_fn

    kind = jax.devices()[0].device_kind
    print(f"== init: {kind}", flush=True)
    for name in gpt_workloads(args.workloads, workloads, "init"):
        model, batch, _, _ = workloads[name]
        for eager in (True, False):
            p = plan(product_cfg(model, batch, {}))
            mode = mode_class("jit_sharding")(make_mesh(p.devices, p.mesh_shape), global_batch=batch, accum_steps=1)
            tx, _ = _optimizer(p.cfg, p.peak_lr)
            _, init_fn = state_init_fn(p.cfg, tx, p.graphdef)
            jax.clear_caches()
            t0 = time.perf_counter()
            state = mode.init_state(init_fn, eager=eager)
            jax.block_until_ready(state)
            total = time.perf_counter() - t0
            where = "the device op by op, then placed" if eager else "the device as one program"
            print(f"{name} init_state on {where}: {total:.2f} s (trace, compile and run)", flush=True)
            record(out, "init", workload=name, where="eager" if eager else "jit", seconds=total, device_kind=kind)
            del state


def startup_child(name: str, cache: str, quick: bool) -> None:
    """One process's start-up, step by step (``--part startup``): seconds of each step as one JSON line. The state's
    creation three ways: on the host's CPU backend then placed, op by op on the device (``init_state``'s default for
    a replicated state off the CPU; ``eager_init_s``) and the bare script's op-by-op creation."""
    t0 = T0 = time.perf_counter()
    times: dict = {}

    def mark(key: str) -> None:
        nonlocal t0
        times[key] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()

    import jax

    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    mark("import_jax_s")
    jax.devices()
    mark("backend_s")
    import numpy as np
    import optax

    from measure.compiled import compiled_step_metrics
    from training.build import _optimizer, build, plan, state_init_fn

    mark("import_product_s")
    model, batch, _, _ = (QUICK if quick else WORKLOADS)[name]
    p = plan(product_cfg(model, batch, {}))
    tx, _ = _optimizer(p.cfg, p.peak_lr)
    _, init_fn = state_init_fn(p.cfg, tx, p.graphdef)
    mark("plan_s")
    cpu, dev = jax.local_devices(backend="cpu")[0], jax.devices()[0]
    lowered = jax.jit(init_fn, out_shardings=jax.sharding.SingleDeviceSharding(cpu)).lower()
    mark("host_init_lower_s")
    compiled = lowered.compile()
    mark("host_init_compile_s")
    host = jax.device_get(compiled())
    mark("host_init_run_s")
    jax.block_until_ready(jax.device_put(host, dev))
    mark("host_state_put_s")
    with jax.default_device(dev):
        jax.block_until_ready(init_fn())
    mark("eager_init_s")
    exp = build(p)
    jax.block_until_ready(exp.state)
    mark("build_s")
    t = dims_of(model)["context"]
    zeros = np.zeros((batch, t), np.int32)
    placed = exp.mode.batch_layout().place({"image": zeros, "label": zeros, "index": np.arange(batch)}, batch)
    lowered = exp.steps.train.lower(exp.state, placed)
    mark("step_lower_s")
    compiled = lowered.compile()
    mark("step_compile_s")
    compiled_step_metrics(lowered, compiled, 1)
    mark("step_metrics_s")
    jax.block_until_ready(compiled(exp.state, placed))
    mark("first_step_s")
    del exp
    d = dims_of(model)
    params = bare_module().init_params(jax.random.key(0), d["depth"], d["width"], d["vocab"], d["context"])
    jax.block_until_ready(optax.adam(1e-3).init(params))
    mark("bare_eager_init_s")
    times["state_bytes"] = int(sum(x.nbytes for x in jax.tree.leaves(host)))
    times["total_s"] = round(time.perf_counter() - T0, 3)
    print("STARTUP " + json.dumps(times), flush=True)


def part_startup(args, workloads: dict, out: str) -> None:
    """Start-up step by step (``startup_child``) in fresh processes: the first with an empty compilation cache
    (cold), the second warm."""
    print("== startup: seconds of each step in a fresh process", flush=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for name in gpt_workloads(args.workloads, workloads, "startup"):
        cache = tempfile.mkdtemp(prefix="accelerator_startup_")
        for cold in (True, False):
            cmd = [sys.executable, __file__, "--startup-child", name, cache] + (["--quick"] if args.quick else [])
            r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
            lines = [ln for ln in r.stdout.splitlines() if ln.startswith("STARTUP ")]
            if r.returncode or not lines:
                raise SystemExit(f"error: --startup-child {name} failed: {r.stderr[-2000:]}")
            times = json.loads(lines[-1][len("STARTUP ") :])
            print(f"{name} {'cold' if cold else 'warm'}: {times}", flush=True)
            record(out, "startup", workload=name, cold=cold, **times)
        shutil.rmtree(cache, ignore_errors=True)


def part_memory(args, workloads: dict, out: str) -> None:
    """GPT-2 small/medium: remat policy x global batch -> fits?, tokens/s, MFU, compiled peak."""
    import jax

    kind = jax.devices()[0].device_kind
    peak = peak_flops(kind)
    sizes = ["gpt2_small"] if args.quick else args.memory_sizes
    print(f"== memory: {kind}", flush=True)
    for size in sizes:
        model = workloads["gpt2_small"][0] if args.quick else {"size": size}
        fpt = flops_per_token(model)
        t = dims_of(model)["context"]
        cells = (
            [c.split(":") for c in args.cells] if args.cells else [(r, b) for r in args.remats for b in args.batches]
        )
        skip: set = set()
        for cell in cells:
            remat, batch, chunk = cell[0], int(cell[1]), int(cell[2]) if len(cell) > 2 else 0
            if (remat, chunk) in skip:
                continue
            label = f"{size} remat={remat} batch={batch}" + (f" loss_chunk={chunk}" if chunk else "")
            extra = {
                "remat": remat,
                **({"loss_chunk": chunk} if chunk else {}),
                **dict(kv.split("=", 1) for kv in args.levers or []),
            }
            try:
                res = measure_product(model, batch, extra, 3 * args.memory_window, args.memory_window)
            except Exception as e:
                text = str(e)
                fits = not any(s in text for s in ("RESOURCE_EXHAUSTED", "Ran out of memory", "out of memory"))
                print(f"{label}: {'does not fit' if not fits else 'failed'}: {text.splitlines()[0][:200]}", flush=True)
                record(
                    out,
                    "memory",
                    size=size,
                    remat=remat,
                    batch=batch,
                    loss_chunk=chunk,
                    fits=False if not fits else None,
                    error=text[:300],
                    device_kind=kind,
                )
                if not fits:
                    skip.add((remat, chunk))  # larger batches do not fit either
                continue
            print(f"{label:40s} {describe(res, batch * t, fpt, peak)}", flush=True)
            record(
                out,
                "memory",
                size=size,
                remat=remat,
                batch=batch,
                loss_chunk=chunk,
                fits=True,
                device_kind=kind,
                tokens_per_s=batch * t / res["step_s"],
                mfu=(batch * t / res["step_s"] * fpt / peak) if peak else None,
                **res,
            )


def report(paths: list[str]) -> None:
    """Every record of ``paths`` as one table per part."""
    recs = [json.loads(line) for p in paths for line in Path(p).read_text().splitlines() if line.strip()]
    steps = [r for r in recs if r["part"] == "steps" and "train_tokens_per_s" in r]
    images = [r for r in recs if r["part"] == "steps" and "train_examples_per_s" in r]
    if images:
        print(
            "| workload | global batch | train.py examples/s | bare examples/s | ratio | MFU train.py (counted) "
            "| MFU bare (counted) | MFU train.py (XLA's count) | GFLOPs per example "
            "| first step cold train.py / bare (s) |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in images:
            cold = [s for s in r["startup"] if s["cold"]]
            first = (
                f"{cold[0]['train_first_step_s']:.1f} / {cold[0]['bare_first_step_s']:.1f}"
                if cold and cold[0]["train_first_step_s"] is not None
                else "n/a"
            )
            xla = [x for x in r.get("mfu_train_xla") or [] if x is not None]
            print(
                f"| {r['workload']} | {r['global_batch']} | {statistics.median(r['train_examples_per_s']):,.0f} "
                f"| {statistics.median(r['bare_examples_per_s']):,.0f} | {spread(r['ratio'])} "
                f"| {spread(r['mfu_train']) if r.get('mfu_train') else 'n/a'} "
                f"| {spread(r['mfu_bare']) if r.get('mfu_bare') else 'n/a'} | {spread(xla) if xla else 'n/a'} "
                f"| {r['flops_per_example'] / 1e9:.3f} | {first} |"
            )
        if steps:
            print()
    if steps:
        print(
            "| workload | dropout | attention | train.py tokens/s | bare tokens/s | ratio | MFU train.py "
            "| cold start train.py / bare (s) | warm start train.py / bare (s) |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for r in steps:
            cold = [s for s in r["startup"] if s["cold"]]
            warm = [s for s in r["startup"] if not s["cold"]]
            fmt = lambda ss: (
                (
                    f"{statistics.median(s['train_first_step_s'] for s in ss):.1f} / "
                    f"{statistics.median(s['bare_first_step_s'] for s in ss):.1f}"
                )
                if ss
                else "n/a"
            )
            mfu = spread(r["mfu_train"]) if r.get("mfu_train") else "n/a"
            print(
                f"| {r['workload']} | {r['dropout']} | {r.get('attention') or '?'} "
                f"| {statistics.median(r['train_tokens_per_s']):,.0f} "
                f"| {statistics.median(r['bare_tokens_per_s']):,.0f} "
                f"| {spread(r['ratio'])} | {mfu} | {fmt(cold)} | {fmt(warm)} |"
            )
    for part in ("levers", "memory"):
        rows = [r for r in recs if r["part"] == part]
        if not rows:
            continue
        print(f"\n{part}:")
        for r in rows:
            what = {
                k: r[k]
                for k in ("workload", "who", "extra", "keys", "size", "remat", "batch", "loss_chunk", "fits")
                if k in r
            }
            if "step_s" in r:
                mfu = f", MFU {r['mfu']:.1%}" if r.get("mfu") else ""
                print(
                    f"  {what}: {r['tokens_per_s']:,.0f} tokens/s{mfu}, "
                    f"compiled peak {r['compiled_peak_bytes'] / 2**30:.2f} GiB"
                )
            else:
                print(f"  {what}: {r.get('error', '')[:120]}")
    for r in (r for r in recs if r["part"] == "startup"):
        steps = {k: v for k, v in r.items() if k.endswith("_s") and k != "total_s"}
        print(f"startup {r['workload']} {'cold' if r['cold'] else 'warm'}: {steps}")
    for r in (r for r in recs if r["part"] == "init"):
        print(f"init {r['workload']} on the {r.get('where', r.get('draws'))}: {r['seconds']:.2f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--part",
        default="steps,startup,levers,init,memory,profile",
        help="comma-separated: steps, startup, levers, init, memory, profile",
    )
    ap.add_argument("--quick", action="store_true", help="tiny sizes on the CPU (under a minute)")
    ap.add_argument("--workloads", default="char,gpt2_small")
    ap.add_argument("--dropouts", default="0,0.2", help="steps: dropout rates to run")
    ap.add_argument("--pairs", type=int, default=3, help="steps: interleaved rounds (the first cold)")
    ap.add_argument("--levers", nargs="*", default=None, help="model.KEY=VALUE for both sides (e.g. loss_chunk=4096)")
    ap.add_argument("--memory-sizes", default="gpt2_small,gpt2_medium")
    ap.add_argument("--remats", default="none,dots_saveable,full")
    ap.add_argument("--batches", default="8,16,32,64")
    ap.add_argument("--memory-window", type=int, default=3)
    ap.add_argument(
        "--cells", nargs="*", default=None, help="memory: REMAT:BATCH[:LOSS_CHUNK] cells (default: every remat x batch)"
    )
    ap.add_argument("--record", default=None, help="JSON-lines file the parts append to")
    ap.add_argument("--report", nargs="*", default=None, help="print the records of these files as one table")
    ap.add_argument("--startup-child", nargs=2, default=None, help=argparse.SUPPRESS)  # WORKLOAD CACHE (startup)
    args = ap.parse_args()
    if args.startup_child:
        if args.quick:
            os.environ.setdefault("JAX_PLATFORMS", "cpu")
        startup_child(*args.startup_child, quick=args.quick)
        return
    if args.report is not None:
        report(args.report)
        return
    args.workloads = args.workloads.split(",")
    args.dropouts = [float(x) for x in args.dropouts.split(",")]
    args.memory_sizes = args.memory_sizes.split(",")
    args.remats = args.remats.split(",")
    args.batches = [int(b) for b in args.batches.split(",")]
    out = args.record or os.path.join(os.environ.get("OUT", "."), "accelerator_records.jsonl")
    workloads = QUICK if args.quick else WORKLOADS
    unknown = [w for w in args.workloads if w not in workloads]
    if unknown:
        raise SystemExit(f"error: --workloads {','.join(unknown)} unknown; choose from {', '.join(workloads)}")
    if args.quick:  # one tiny GPT, the image workloads named, one round, the dropout path, two memory cells
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        args.workloads = [w for w in args.workloads if w == "char" or is_image(QUICK[w][0])] or ["char"]
        args.pairs = 1
        args.dropouts = args.dropouts[-1:]
        args.cells = args.cells or ["none:4", "full:8:64"]
    import jax

    if args.quick:
        jax.config.update("jax_num_cpu_devices", 1)
    if any(p != "steps" for p in args.part.split(",")):  # in-process parts: a repeated program (the init) compiles once
        jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="accelerator_cache_"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    parts = {
        "steps": part_steps,
        "startup": part_startup,
        "levers": part_levers,
        "init": part_init,
        "memory": part_memory,
        "profile": part_profile,
    }
    chosen = args.part.split(",")
    for name in chosen:
        if name not in parts:
            raise SystemExit(f"error: --part {name} is unknown; choose from {', '.join(parts)}")
    # steps and startup first: their subprocesses need the accelerator, which the other parts hold once opened
    for name in sorted(chosen, key=lambda n: n not in ("steps", "startup")):
        t0 = time.perf_counter()
        parts[name](args, workloads, out)
        print(f"-- part {name}: {time.perf_counter() - t0:.0f} s", flush=True)
    print(f"\nrecords: {out}")
    report([out])


if __name__ == "__main__":
    main()
