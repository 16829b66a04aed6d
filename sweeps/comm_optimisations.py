"""Sweep preset ``comm_optimisations``: one job per communication remedy, and what each buys in bytes.

Usage::

    python -m sweeps.comm_optimisations                       # 4 jobs, CPU minutes, folder printed
    python -m sweeps.comm_optimisations --out runs/comm -- parallel=shard_map train.steps=null
    python -m sweeps.report runs/comm                         # the scaling table (also written here)

Variants (each a fresh ``python train.py`` process with its own run folder ``<out>/<variant>``, so every job
gets its own backend and device count; the four W&B runs share one group, ``comm-<folder name>``):

===============  =========================================================  ===================================
variant          overrides                                                  what moves per optimizer step
===============  =========================================================  ===================================
``none``         (the mode's own float32 reduction)                         float32 all-reduce of the gradients
``bf16_reduce``  ``parallel.grad_reduce_dtype=bfloat16``                    bf16 all-reduce: half the payload
``<c>_ef``       ``parallel.grad_compression=<c>``, for each compression   quantised all-to-all + all-gather,
                 (``COMPRESSION_VARIANTS``)                                 error feedback (``parallel.compress``)
``accum4``       ``train.accum_steps=4``, 4x ``train.global_batch``         same bytes per step for 4x the
                                                                            examples: a quarter per example
===============  =========================================================  ===================================

``accum4`` keeps the per-device microbatch of ``none`` (so memory per device is the same) and reduces once
per 4 microbatches. Anything after ``--`` is passed to every job (e.g. ``parallel=pmap``,
``train.steps=null`` for the full ``train.epochs``). The defaults ``train.steps=200 train.log_every=50`` keep
the preset at a few CPU minutes. A Hydra multirun cannot express this list (its sweeper takes products), hence
this wrapper; each job is still a plain ``train.py`` run with its own ``summary.json`` and ``.hydra`` folder.

Writes into ``<out>``: ``comm_optimisations.md`` / ``.csv`` (per variant: payload bytes per step from the
lowered module, which predicts a GPU, and from the compiled one; ring-model bytes per step and per example;
ratios to ``none``; eval accuracy and its difference to ``none``; examples/s), and the ``sweeps.report``
outputs (``scaling.md``, ``scaling.csv``, plots). Exit status 0 when every job succeeded, 1 otherwise (the
failures are in the table and in each job's ``summary.json``), 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import csv
import datetime as _dt
import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

from conf.schema import Compression

REPO = Path(__file__).resolve().parent.parent

DEFAULT_OVERRIDES = ("train.steps=200", "train.log_every=50")
DEFAULT_GLOBAL_BATCH = 256  # training.build.DEFAULT_GLOBAL_BATCH (kept import-free of JAX)
ACCUM = 4
# the variant of each compression (with error feedback): name -> override
COMPRESSION_VARIANTS = {f"{c}_ef": f"parallel.grad_compression={c}" for c in Compression if c != "none"}

# variant -> overrides (``{global_batch}`` is the job's global batch without accumulation)
VARIANTS: dict[str, tuple[str, ...]] = {
    "none": (),
    "bf16_reduce": ("parallel.grad_reduce_dtype=bfloat16",),
    **{name: (override,) for name, override in COMPRESSION_VARIANTS.items()},
    "accum4": (f"train.accum_steps={ACCUM}", "train.global_batch={accum_global_batch}"),
}

COLUMNS = [
    "variant",
    "status",
    "mode",
    "devices",
    "global batch",
    "accum",
    "payload bytes/step (lowered)",
    "payload bytes/step (compiled)",
    "GPU payload/step vs none",
    "ring bytes/step (compiled)",
    "ring bytes/step vs none",
    "ring bytes/example vs none",
    "eval accuracy",
    "eval accuracy - none",
    "examples/s",
    "variant overrides",
]


def _global_batch(extra: list[str]) -> int:
    """The global batch the extra overrides ask for (the last ``train.global_batch=`` wins), else the default."""
    gb = DEFAULT_GLOBAL_BATCH
    for o in extra:
        if o.startswith("train.global_batch="):
            value = o.split("=", 1)[1]
            gb = DEFAULT_GLOBAL_BATCH if value in ("null", "~") else int(value)
        if o.startswith("train.per_device_batch="):
            raise SystemExit(
                "sweeps.comm_optimisations: train.per_device_batch is not supported here (accum4 "
                "scales the global batch); set train.global_batch instead"
            )
    return gb


def job_overrides(variant: str, extra: list[str]) -> list[str]:
    """Overrides of one job: preset defaults, then the user's extras, then the variant's own."""
    gb = _global_batch(extra)
    own = [o.format(accum_global_batch=ACCUM * gb) for o in VARIANTS[variant]]
    return [*DEFAULT_OVERRIDES, *extra, *own]


def run_job(out: Path, variant: str, extra: list[str], group: str) -> dict:
    """Runs ``train.py`` for one variant in ``out/variant``; returns its summary (or a failed stub)."""
    job_dir = out / variant
    overrides = job_overrides(variant, extra)
    if not any(o.startswith("wandb.group=") for o in overrides):
        overrides.append(f"wandb.group={group}")
    cmd = [sys.executable, "train.py", f"hydra.run.dir={job_dir}", *overrides]
    print(f"[comm_optimisations] {variant}: {' '.join(cmd[1:])}", flush=True)
    proc = subprocess.run(cmd, cwd=REPO)
    try:
        summary = json.loads((job_dir / "summary.json").read_text())
    except (OSError, ValueError) as e:
        job_dir.mkdir(parents=True, exist_ok=True)
        summary = {"status": "failed", "error": f"train.py exited {proc.returncode} without a summary.json ({e})"}
        (job_dir / "summary.json").write_text(json.dumps(summary))
    return summary


def gpu_payload(s: dict) -> Optional[float]:
    """Payload bytes per step as a GPU would move them: the lowered module's (the dtypes the program asks for;
    XLA:CPU promotes bf16 all-reduces to float32 when compiling, a GPU does not), or the compiled module's
    when the lowered one has no collectives (jit_sharding's own reduction is inserted by GSPMD when compiling,
    in float32)."""
    lowered, compiled = s.get("comm/payload_bytes_per_step_lowered"), s.get("comm/payload_bytes_per_step")
    return lowered if lowered else compiled


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a is not None and b else None


def rows(summaries: dict[str, dict]) -> list[dict[str, Any]]:
    """One table row per variant; ratios are relative to ``none`` (blank when it or the variant failed)."""
    ok = {v: s.get("status") == "ok" for v, s in summaries.items()}
    base = summaries.get("none", {}) if ok.get("none") else {}

    def per_example(s):
        ring, gb = s.get("comm/bytes_per_step"), s.get("train/global_batch")
        return ring / gb if ring is not None and gb else None

    out = []
    for variant, s in summaries.items():
        good = s if ok[variant] else {}
        acc, base_acc = good.get("eval/accuracy"), base.get("eval/accuracy")
        out.append(
            {
                "variant": variant,
                "status": "ok" if ok[variant] else f"failed: {s.get('error', '')}",
                "mode": s.get("parallel"),
                "devices": s.get("mesh/devices"),
                "global batch": s.get("train/global_batch"),
                "accum": s.get("train/accum_steps"),
                "payload bytes/step (lowered)": good.get("comm/payload_bytes_per_step_lowered"),
                "payload bytes/step (compiled)": good.get("comm/payload_bytes_per_step"),
                "GPU payload/step vs none": _ratio(gpu_payload(good), gpu_payload(base)),
                "ring bytes/step (compiled)": good.get("comm/bytes_per_step"),
                "ring bytes/step vs none": _ratio(good.get("comm/bytes_per_step"), base.get("comm/bytes_per_step")),
                "ring bytes/example vs none": _ratio(per_example(good), per_example(base)),
                "eval accuracy": acc,
                "eval accuracy - none": acc - base_acc if acc is not None and base_acc is not None else None,
                "examples/s": good.get("perf/examples_per_s"),
                "variant overrides": " ".join(VARIANTS[variant]).replace(
                    "{accum_global_batch}", str(s.get("train/global_batch", "4x"))
                )
                or "(none)",
            }
        )
    return out


def _fmt(column: str, v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, float):
        if column.endswith("vs none"):
            return f"{v:.3f}"
        if "accuracy" in column:
            return f"{v:+.4f}" if column.endswith("none") else f"{v:.4f}"
        return f"{v:,.1f}" if not v.is_integer() else f"{int(v):,}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v).replace("|", "\\|")


def write_tables(out: Path, table: list[dict], common: list[str] = ()) -> tuple[Path, Path]:
    """``comm_optimisations.csv`` (raw numbers) and ``comm_optimisations.md`` in ``out``."""
    csv_path, md_path = out / "comm_optimisations.csv", out / "comm_optimisations.md"
    with csv_path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(COLUMNS)
        for r in table:
            w.writerow(["" if r[c] is None else r[c] for c in COLUMNS])
    platforms = set()
    for r in table:
        try:
            platforms.add(json.loads((out / r["variant"] / "summary.json").read_text()).get("platform"))
        except (OSError, ValueError):
            pass
    lines = [
        "# Communication optimisations",
        "",
        f"Folder: `{out}`  ",
        f"Platform(s): {', '.join(sorted(p for p in platforms if p)) or 'unknown'}  ",
        f"Overrides of every job: `{' '.join(common) or '(none)'}`",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "|".join("---" for _ in COLUMNS) + "|",
    ]
    lines += ["| " + " | ".join(_fmt(c, r[c]) for c in COLUMNS) + " |" for r in table]
    lines += [
        "",
        "- payload = sum of the collectives' logical sizes per step. Lowered: from the StableHLO module, "
        "in the dtypes the program asks for; compiled: from the compiled HLO. XLA:CPU promotes bf16 "
        "all-reduces to float32 when compiling (a GPU reduces bf16 natively), so on CPU the compiled "
        "payload of bf16_reduce equals the float32 one. GPU payload = lowered, or compiled when the "
        "lowered module has no collectives (jit_sharding's own reduction is added when compiling).",
        "- ring bytes = bytes each device sends under the ring model (DESIGN.md), from the compiled module "
        "(on CPU, bf16_reduce shows float32 here).",
        "- accum4: 4 microbatches per optimizer step at 4x the global batch: same bytes per step, a quarter "
        "per example.",
        "- eval accuracy - none: difference to the uncompressed run with the same seed.",
    ]
    md_path.write_text("\n".join(lines) + "\n")
    return csv_path, md_path


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m sweeps.comm_optimisations",
        description="none / bf16 reduce / compressed + error feedback / accumulation 4",
    )
    parser.add_argument("--out", default=None, help="sweep folder (default: multirun/<date>/<time>-comm_optimisations)")
    parser.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(VARIANTS)}")
    args = parser.parse_args(argv)
    chosen = list(VARIANTS) if args.only is None else [v.strip() for v in args.only.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in VARIANTS]
    if unknown or not chosen:
        print(
            f"error: --only={args.only!r}: unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}",
            file=sys.stderr,
        )
        return 2
    now = _dt.datetime.now()
    out = (
        Path(args.out)
        if args.out
        else REPO / "multirun" / now.strftime("%Y-%m-%d") / (now.strftime("%H-%M-%S") + "-comm_optimisations")
    )
    out = out.absolute()
    out.mkdir(parents=True, exist_ok=True)
    group = "comm-" + out.name
    summaries = {v: run_job(out, v, extra, group) for v in chosen}
    csv_path, md_path = write_tables(out, rows(summaries), [*DEFAULT_OVERRIDES, *extra])
    from sweeps import report  # never imports JAX

    report.main([str(out)])
    print(md_path.read_text())
    print(f"tables: {md_path} {csv_path}")
    return 0 if all(s.get("status") == "ok" for s in summaries.values()) else 1


if __name__ == "__main__":
    from training import process

    process.run_tool(main, imports_jax=False)  # a signal: one line, no traceback
