"""Profiler window and the measured communication ratio (``comm/ratio_measured``).

``profile.enabled=true`` records a ``jax.profiler`` trace of the optimizer steps
``(start_step, start_step + num_steps]`` into ``<run folder>/profile`` (TensorBoard/XProf layout:
``plugins/profile/<timestamp>/<host>.xplane.pb`` and ``<host>.trace.json.gz``, plus ``perfetto_trace.json.gz``
to open at https://ui.perfetto.dev), then reads the trace back (Chrome/Perfetto JSON, no extra package) and
computes::

    comm/time_measured_s   = time in collective ops per step on one device [s]
                             (union of the collective op intervals of the window on each device's timeline,
                             divided by num_steps, then averaged over the devices found in the trace)
    comm/ratio_measured    = comm/time_measured_s / profile/step_time_s
    profile/step_time_s    = host wall time of the window / num_steps [s] (the window starts after the
                             queue of in-flight steps has drained and ends with ``block_until_ready``)

An event is an XLA op of the step when its ``args`` carry ``hlo_op`` (XLA's annotation) and, when the trace
gives one, ``hlo_module`` equals the compiled step's module name. It is a collective when its ``hlo_op`` (or
name) is one of the compiled step's collectives (names from ``measure.hlo_text.parse_hlo_collectives``, which
drops no-ops over groups of one device; JAX may name them ``psum.3``, ``ppermute.1`` ...), is the
``-done``/``-update`` half of an async collective of a kind the step has, or is an NCCL kernel (``nccl*``).
Without the step's HLO, any name starting with a collective opcode counts (``all-reduce``, ``all-gather``,
``reduce-scatter``, ``all-to-all``, ``collective-permute``, ``ragged-all-to-all``, ``collective-broadcast``
and their ``-start``/``-done`` forms). Overlapping intervals (async starts/dones, several streams) are counted
once per device.

Device timelines: on the CPU backend every op event carries ``args.device_ordinal``; on GPU/TPU the device
ops live in processes named ``/device:...`` (one per device). On the CPU backend the time "in" a collective is
mostly rendezvous waiting for the other simulated devices (they share the host's cores), so
``comm/ratio_measured_valid`` is false there; it is also false when the trace holds no XLA op events.
"""

from __future__ import annotations

import gzip
import json
import logging
import re
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

log = logging.getLogger(__name__)

_COLLECTIVE_OPCODE_RE = re.compile(
    r"^%?(all-reduce|all-gather|reduce-scatter|ragged-all-to-all|all-to-all|collective-permute|"
    r"collective-broadcast)(-start|-done|-update)?([.\-_]|$)"
)
_NCCL_RE = re.compile(r"nccl", re.IGNORECASE)
_HLO_MODULE_RE = re.compile(r"^\s*HloModule\s+([^\s,]+)", re.MULTILINE)


class ProfileError(RuntimeError):
    """The trace could not be read (missing file, unexpected format)."""


def hlo_module_name(hlo_text: str) -> Optional[str]:
    """The module name of compiled HLO text (``HloModule jit_train_step, ...`` -> ``jit_train_step``)."""
    m = _HLO_MODULE_RE.search(hlo_text or "")
    return m.group(1) if m else None


def collective_kind(name: str, known: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The collective kind of an op or kernel called ``name``, or None when it is not a (counted) collective.

    ``known``: {HLO instruction name: kind} of the step's collectives (no-ops excluded); when given, a
    synchronous op or async start that is not in it is a no-op (a group of one device) and is not counted,
    while ``*-done``/``*-update`` ops are counted when a collective of their kind is known. When None,
    every name that starts with a collective opcode counts. NCCL kernels (``nccl*``) always count.
    """
    if known and name in known:
        return known[name]
    m = _COLLECTIVE_OPCODE_RE.match(name)
    if m:
        kind = m.group(1)
        if known is None or (m.group(2) in ("-done", "-update") and kind in known.values()):
            return kind
        return None
    return "nccl" if _NCCL_RE.search(name) else None


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of ``[start, end)`` intervals (microseconds)."""
    total, cur_start = 0.0, 0.0
    cur_end: Optional[float] = None
    for start, end in sorted(intervals):
        if cur_end is None or start > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None:
        total += cur_end - cur_start
    return total


def collective_time_from_events(
    events: Iterable[dict], module: Optional[str] = None, collective_names: Optional[Mapping[str, str]] = None
) -> dict[str, Any]:
    """Time in collective ops per device timeline, from Chrome-trace events (``ts``/``dur`` in microseconds).

    Args:
      events: the trace's ``traceEvents`` (complete events ``ph == 'X'`` are used; ``M`` events name the
        processes).
      module: the compiled step's HLO module name; op events of other modules are ignored (None: keep all).
      collective_names: {HLO instruction name: kind} of the step's collectives (see ``collective_kind``);
        None: recognise collectives by opcode prefix only.

    Returns:
      ``{"devices": int, "op_events": int, "collective_events": int, "collective_s": {device: seconds},
      "kinds": {opcode or 'nccl': seconds summed over devices (intervals of one kind merged)}}``.
    """
    events = list(events)
    names = dict(collective_names) if collective_names is not None else None
    device_pids = {
        e.get("pid")
        for e in events
        if e.get("ph") == "M"
        and e.get("name") == "process_name"
        and str((e.get("args") or {}).get("name", "")).startswith("/device:")
    }
    per_device: dict[str, list[tuple[float, float]]] = {}
    per_kind: dict[tuple[str, str], list[tuple[float, float]]] = {}
    devices: set[str] = set()
    op_events = collective_events = 0
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        args = e.get("args") or {}
        if "device_ordinal" in args:
            device = f"ordinal:{args['device_ordinal']}"
        elif e.get("pid") in device_pids:
            device = f"pid:{e.get('pid')}"
        else:
            continue  # host-side events (Python, PjRt dispatch) are not device time
        hlo_module = args.get("hlo_module")
        if module and hlo_module and not str(hlo_module).startswith(module):
            continue
        name = str(args.get("hlo_op") or e.get("name", ""))
        if "hlo_op" not in args and not (e.get("pid") in device_pids and _NCCL_RE.search(name)):
            continue  # not an XLA op (thread-pool bookkeeping, rendezvous markers ...)
        op_events += 1
        devices.add(device)
        kind = collective_kind(name, names) or collective_kind(str(e.get("name", "")), names)
        if kind is None:
            continue
        collective_events += 1
        start = float(e["ts"])
        interval = (start, start + float(e["dur"]))
        per_device.setdefault(device, []).append(interval)
        per_kind.setdefault((kind, device), []).append(interval)
    kinds: dict[str, float] = {}
    for (kind, _), intervals in per_kind.items():
        kinds[kind] = kinds.get(kind, 0.0) + _union_us(intervals) * 1e-6
    return {
        "devices": len(devices),
        "op_events": op_events,
        "collective_events": collective_events,
        "collective_s": {d: _union_us(per_device.get(d, [])) * 1e-6 for d in sorted(devices)},
        "kinds": kinds,
    }


def find_trace_file(out_dir: Path) -> Path:
    """The newest ``perfetto_trace.json.gz`` (else ``*.trace.json.gz``) under ``out_dir/plugins/profile``.

    Raises:
      ProfileError: none found.
    """
    runs = sorted((Path(out_dir) / "plugins" / "profile").glob("*"), key=lambda p: p.stat().st_mtime)
    for run in reversed(runs):
        for pattern in ("perfetto_trace.json.gz", "*.trace.json.gz"):
            found = sorted(run.glob(pattern))
            if found:
                return found[0]
    raise ProfileError(f"no trace file under {Path(out_dir) / 'plugins' / 'profile'}")


def read_trace_events(path: Path) -> list[dict]:
    """``traceEvents`` of a (gzipped) Chrome/Perfetto JSON trace."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ProfileError(f"{path} has no traceEvents list")
    return events


def measured_ratio(
    events: Iterable[dict],
    num_steps: int,
    step_time_s: float,
    platform: str,
    module: Optional[str] = None,
    collective_names: Optional[Mapping[str, str]] = None,
) -> dict[str, Any]:
    """The ``comm/*measured*`` keys from the events of a window of ``num_steps`` steps of ``step_time_s``."""
    stats = collective_time_from_events(events, module, collective_names)
    out: dict[str, Any] = {
        "profile/devices_in_trace": stats["devices"],
        "profile/op_events": stats["op_events"],
        "profile/collective_events": stats["collective_events"],
    }
    valid = platform != "cpu" and stats["op_events"] > 0
    if stats["devices"]:
        per_step_s = sum(stats["collective_s"].values()) / stats["devices"] / num_steps
        out["comm/time_measured_s"] = per_step_s
        out["comm/ratio_measured"] = per_step_s / step_time_s
        for kind, seconds in sorted(stats["kinds"].items()):
            out[f"comm/time_measured_s/{kind}"] = seconds / stats["devices"] / num_steps
    else:
        log.warning(
            "the profile trace holds no XLA op events of module %s; comm/ratio_measured is not computed", module
        )
    out["comm/ratio_measured_valid"] = valid
    return out


class Profiler:
    """Records a ``jax.profiler`` trace of steps ``(start_step, start_step + num_steps]`` into ``out_dir``.

    ``after_step(done, last_output)`` is called after every dispatched step (``done`` = steps dispatched so
    far); at ``done == start_step`` it waits for ``last_output`` (so no earlier step runs inside the window)
    and starts the trace (``start_step == 0``: at construction), at ``done == start_step + num_steps`` it waits
    again, stops the trace and measures. ``acts_at(done)`` says whether ``after_step`` will block at ``done``
    (the caller pauses its step timer around it). ``result()`` returns the ``comm/*measured*`` and
    ``profile/*`` keys once the window has been recorded (empty dict when disabled or not reached).

    Args:
      enabled: False makes every method a no-op.
      start_step: steps run before the window (>= 0).
      num_steps: steps in the window (>= 1).
      out_dir: the trace folder (``<run folder>/profile``).
      platform: ``jax.Device.platform`` of the mesh ('cpu', 'gpu', 'tpu'); 'cpu' marks the ratio not valid.
      hlo_text: the compiled step's HLO text (names its module and its collectives); None: match by opcode.
      num_devices: devices of the mesh (for the collective parser).
    """

    def __init__(
        self,
        enabled: bool,
        start_step: int,
        num_steps: int,
        out_dir: Path,
        platform: str,
        hlo_text: Optional[str] = None,
        num_devices: Optional[int] = None,
    ):
        self.enabled = enabled
        self.start_step, self.num_steps = start_step, num_steps
        self.out_dir, self.platform = Path(out_dir), platform
        self.module = hlo_module_name(hlo_text) if hlo_text else None
        self.collective_names: Optional[dict[str, str]] = None
        if enabled and hlo_text:
            from measure.hlo_text import parse_hlo_collectives

            self.collective_names = {c.name: c.kind for c in parse_hlo_collectives(hlo_text, num_devices)}
        self._t0: Optional[float] = None
        self._result: dict[str, Any] = {}
        if enabled and start_step == 0:
            self._start()

    @property
    def stop_step(self) -> int:
        return self.start_step + self.num_steps

    def acts_at(self, done: int) -> bool:
        """Whether ``after_step(done, ...)`` starts or stops the trace (and so blocks on the device)."""
        return self.enabled and ((done == self.start_step and self.start_step > 0) or done == self.stop_step)

    def _fail(self, what: str, e: Exception) -> None:
        """A profiler failure (e.g. no CUPTI on a GPU host) costs the measurement, never the run."""
        line = f"{what} failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        log.warning("profile: %s; comm/ratio_measured is not computed", line)
        self._result = {"profile/error": line}
        self.enabled = False

    def _start(self) -> None:
        import jax

        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.out_dir), create_perfetto_trace=True)
        except Exception as e:
            self._fail("jax.profiler.start_trace", e)
            return
        self._t0 = time.perf_counter()

    def after_step(self, done: int, last_output: Any) -> None:
        import jax

        if not self.acts_at(done):
            return
        jax.block_until_ready(last_output)
        if done == self.start_step:
            self._start()
            return
        if self._t0 is None:  # the window's start was never reached (a run resumed past it)
            return
        wall_s = time.perf_counter() - self._t0
        step_time_s = wall_s / self.num_steps
        try:
            jax.profiler.stop_trace()
            trace = find_trace_file(self.out_dir)
            measured = measured_ratio(
                read_trace_events(trace), self.num_steps, step_time_s, self.platform, self.module, self.collective_names
            )
        except Exception as e:
            self._fail("reading the profile", e)
            return
        self._result = {
            "profile/dir": str(self.out_dir),
            "profile/trace_file": str(trace),
            "profile/start_step": self.start_step,
            "profile/num_steps": self.num_steps,
            "profile/step_time_s": step_time_s,
            **measured,
        }
        log.info(
            "profile of steps %d-%d in %s: comm/ratio_measured=%s (valid=%s)",
            self.start_step + 1,
            self.stop_step,
            trace,
            self._result.get("comm/ratio_measured"),
            self._result["comm/ratio_measured_valid"],
        )

    def close(self) -> None:
        """Stops a trace left running (the loop ended early, e.g. on an error)."""
        if self.enabled and self._t0 is not None and not self._result:
            self.enabled = False
            try:
                import jax

                jax.profiler.stop_trace()
            except RuntimeError:
                pass
            self._t0 = None

    def result(self) -> dict[str, Any]:
        return dict(self._result)


def check_window(enabled: bool, start_step: int, num_steps: int, total_steps: int) -> Optional[str]:
    """One-line error when the profile window does not fit in the run, else None."""
    if not enabled:
        return None
    if start_step < 0 or num_steps <= 0:
        return f"profile.start_step={start_step} must be >= 0 and profile.num_steps={num_steps} positive"
    if start_step + num_steps > total_steps:
        return (
            f"profile.start_step={start_step} + profile.num_steps={num_steps} > {total_steps} training steps; "
            f"lower them or raise train.steps"
        )
    return None


def explain_ratio(summary: dict[str, Any]) -> None:
    """Logs once which communication ratio a summary (and ``sweeps.report``) should use, and why."""
    if "comm/ratio_measured_valid" not in summary or summary["comm/ratio_measured_valid"]:
        return
    platform = summary.get("platform", "?")
    why = (
        f"comm/ratio_measured={summary.get('comm/ratio_measured', float('nan')):.3g} is not valid on the "
        f"{platform} backend (collective time there is mostly rendezvous waiting between simulated devices)"
        if platform == "cpu"
        else "comm/ratio_measured is not valid (the trace held no XLA op events)"
    )
    if "comm/ratio_model" in summary:
        log.info(
            "%s; summaries use comm/ratio_model=%.3g (hardware.link_bytes_per_s=%.3g bytes/s) instead",
            why,
            summary["comm/ratio_model"],
            summary.get("hardware/link_bytes_per_s", float("nan")),
        )
    else:
        log.info(
            "%s; no model-based ratio either (python -m sweeps.project <run folder> --hardware h100_sxm --mfu 0.4 "
            "models one for a target machine)",
            why,
        )
