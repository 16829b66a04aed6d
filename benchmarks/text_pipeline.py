"""grain against the repository's text pipeline: same batches? host batches/s? time to a resumed batch?

The repository's pipeline (``data.text.WindowSource``, "stateless" below): the global batch of step ``s`` is
``B`` windows of ``T + 1`` byte tokens at offsets drawn from ``numpy.random.default_rng([seed, s])``; process
``p`` of ``P`` gathers its rows ``[p B/P, (p+1) B/P)``. No iterator state: a resumed run calls it with its step.

grain 0.2.18 (``pip install grain==0.2.18``), three pipelines, each a ``grain.MapDataset`` iterated through
``to_iter_dataset(ReadOptions(num_threads=t))`` for each t of ``--threads`` (0: in the calling thread;
16: grain's default, threaded prefetch; its checkpointable
iterator state is ``get_state()`` / ``set_state()``), built per process:

- ``grain_rows``: a map over (step, row) indices, one element per window of this process
  (``MapDataset.range(steps * B/P)``: element ``j`` = row ``p B/P + j % (B/P)`` of step ``j // (B/P)``, its
  offset from the same ``default_rng([seed, step])`` draw, cached per step), then ``.batch(B/P)``. Designed to
  equal the stateless sampler bitwise.
- ``grain_steps``: a map over steps, each element the stateless sampler's batch (``MapDataset.range(steps)
  .map(local_batch)``): equal by construction; measures what grain's iterator adds around the same work.
- ``grain_shuffle``: grain's own idiom: ``MapDataset.source(windows)`` (a random-access source of every
  window start of the train split) ``.shuffle(seed).repeat()``, this process's rows by ``.slice(p::P)``, then
  ``.batch(B/P)``. It samples without replacement within an epoch, so it is NOT the stateless sequence (no run
  could switch to it and stay bitwise equal to runs made before); its own resume is checked.

Checks (exact, ``numpy.array_equal`` on every key): the first ``--check-steps`` batches of ``grain_rows`` and
``grain_steps`` equal the stateless ones for P = 1 and for P = 2 (each process's rows); for every grain
pipeline, the batch after restoring the iterator state saved at step ``s`` equals the batch an uninterrupted
iterator yields at step ``s``.

Speed: host batches/s (numpy batches on the host, nothing placed on devices) for batch ``64 x 128`` and
``8 x 1024`` (global batch x context, P = 1) over ``--rounds`` interleaved rounds of ``--batches`` batches each
(order rotated per round; iterator creation excluded); median (min-max) per pipeline and its ratio to the
stateless sampler. Resume: wall time from nothing to the first batch of step ``--resume-step`` (the stateless
sampler: build + one call; grain: build the dataset and iterator + ``set_state`` + ``next``), median (min-max)
over the rounds. The load average is printed before and after. Data: Tiny Shakespeare's train split.

    python benchmarks/text_pipeline.py [--rounds 7] [--batches 1000] [--threads 0,16] [--resume-step 100000]
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from data.text import SHARED_TINY_SHAKESPEARE, WindowSource, byte_tokens, read_utf8, tfds_splits  # noqa: E402

SEED = 0


class Windows:
    """grain random-access source: element ``i`` = tokens ``[i, i + T + 1)`` for every start of the split."""

    def __init__(self, tokens: np.ndarray, context: int):
        self.tokens, self.context = tokens, context

    def __len__(self) -> int:
        return len(self.tokens) - self.context

    def __getitem__(self, i: int) -> np.ndarray:
        return self.tokens[i : i + self.context + 1]


def stateless_rows(process: int, processes: int, global_batch: int) -> slice:
    per = global_batch // processes
    return slice(process * per, (process + 1) * per)


def stack_windows(windows) -> dict:
    """grain ``batch_fn``: (index, window) pairs -> the stateless sampler's batch keys."""
    w = np.stack([x[1] for x in windows])
    return {"image": w[:, :-1], "label": w[:, 1:], "index": np.asarray([x[0] for x in windows], np.int32)}


def grain_rows(tokens, context, global_batch, seed, process, processes, steps):
    """Element-level map over (step, row) of this process, batched: the stateless draw, per window."""
    import grain

    src = WindowSource(tokens, context, global_batch, seed)
    per = global_batch // processes
    first = process * per
    starts = functools.lru_cache(maxsize=8)(src.global_starts)
    offsets = np.arange(context + 1)

    def window(j: int):
        step, row = divmod(int(j), per)
        g = first + row
        return ((step * global_batch + g) % 2**31, tokens[starts(step)[g] + offsets])

    return grain.MapDataset.range(steps * per).map(window).batch(per, batch_fn=stack_windows)


def grain_steps(tokens, context, global_batch, seed, process, processes, steps):
    """Map over steps: each element the stateless sampler's batch of this process."""
    import grain

    src = WindowSource(tokens, context, global_batch, seed)
    rows = stateless_rows(process, processes, global_batch)
    return grain.MapDataset.range(steps).map(lambda s: src.local_batch(int(s), rows))


def grain_shuffle(tokens, context, global_batch, seed, process, processes, steps):
    """grain's idiom: shuffled random-access windows, repeated, this process's slice, batched."""
    import grain

    per = global_batch // processes
    ds = grain.MapDataset.source(Windows(tokens, context)).shuffle(seed=seed).repeat()
    ds = ds.slice(slice(process, None, processes))

    def stack(ws):
        w = np.stack(ws)
        return {"image": w[:, :-1], "label": w[:, 1:]}

    return ds.batch(per, batch_fn=stack)


GRAIN = {"grain_rows": grain_rows, "grain_steps": grain_steps, "grain_shuffle": grain_shuffle}


def grain_iter(name, tokens, context, global_batch, threads, steps, process=0, processes=1):
    import grain

    ds = GRAIN[name](tokens, context, global_batch, SEED, process, processes, steps)
    return iter(ds.to_iter_dataset(grain.ReadOptions(num_threads=threads, prefetch_buffer_size=max(threads, 1) * 4)))


def equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


def check_equal(tokens, context, global_batch, threads, n_steps) -> list[str]:
    lines = []
    for name in ("grain_rows", "grain_steps"):
        for processes in (1, 2):
            ok = True
            for p in range(processes):
                src = WindowSource(tokens, context, global_batch, SEED)
                it = grain_iter(name, tokens, context, global_batch, threads, n_steps + 1, p, processes)
                for s in range(n_steps):
                    ok &= equal(next(it), src.local_batch(s, stateless_rows(p, processes, global_batch)))
            lines.append(
                f"  {name:<13} == stateless, P={processes}, {n_steps} steps x {global_batch}x{context}: "
                f"{'identical' if ok else 'DIFFERENT'}"
            )
    first = next(grain_iter("grain_shuffle", tokens, context, global_batch, threads, 1))
    stateless = WindowSource(tokens, context, global_batch, SEED).local_batch(0, slice(0, global_batch))
    same = all(np.array_equal(first[k], stateless[k]) for k in ("image", "label"))
    lines.append(
        "  grain_shuffle == stateless (image, label), step 0: "
        f"{'identical' if same else 'different'} (another sequence by design: without replacement per epoch)"
    )
    return lines


def check_resume(tokens, context, global_batch, threads, step) -> list[str]:
    lines = []
    for name in GRAIN:
        it = grain_iter(name, tokens, context, global_batch, threads, step + 2)
        for _ in range(step):
            next(it)
        state = it.get_state()
        expected = next(it)
        fresh = grain_iter(name, tokens, context, global_batch, threads, step + 2)
        fresh.set_state(state)
        lines.append(
            f"  {name:<13} state after {step} batches {state}: restored batch == uninterrupted: "
            f"{equal(next(fresh), expected)}"
        )
    src = WindowSource(tokens, context, global_batch, SEED)
    again = WindowSource(tokens, context, global_batch, SEED)
    rows = slice(0, global_batch)
    lines.append(
        f"  stateless     step {step} from a new source == the same step: "
        f"{equal(src.local_batch(step, rows), again.local_batch(step, rows))} (no state)"
    )
    return lines


def rate(make_next, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        make_next()
    return n / (time.perf_counter() - t0)


def pipelines(threads: list[int]) -> list[tuple[str, str, int]]:
    """(label, pipeline, grain threads): the stateless sampler, then every grain pipeline per thread count."""
    return [("stateless", "stateless", 0)] + [(f"{n} t={t}", n, t) for n in GRAIN for t in threads]


def measure_speed(tokens, context, global_batch, threads, rounds, n) -> dict[str, list[float]]:
    """batches/s per pipeline; timed from the first ``next`` (grain's threads start there, its prefetch buffer
    fills inside the timed span) to the n-th batch, so n must be well above the buffer (4 x threads)."""
    pipes = pipelines(threads)
    out: dict[str, list[float]] = {label: [] for label, _, _ in pipes}
    total = (rounds + 1) * n + 10
    for r in range(rounds + 1):  # round 0 warms up (imports, caches) and is dropped
        order = pipes[r % len(pipes) :] + pipes[: r % len(pipes)]
        for label, name, t in order:
            if name == "stateless":
                src = WindowSource(tokens, context, global_batch, SEED)
                rows = slice(0, global_batch)
                counter = iter(range(r * n, total))
                value = rate(lambda: src.local_batch(next(counter), rows), n)
            else:
                it = grain_iter(name, tokens, context, global_batch, t, total)
                value = rate(lambda: next(it), n)
                del it
            if r:
                out[label].append(value)
    return out


def measure_resume(tokens, context, global_batch, threads, step, rounds) -> dict[str, list[float]]:
    # the state a checkpoint at `step` would hold: a MapDataset iterator's state is the index of its next
    # element, here a batch (check_resume prints it after 37 batches: {'next_index': 37})
    states = {name: {"next_index": step} for name in GRAIN}
    out: dict[str, list[float]] = {k: [] for k in ["stateless", *GRAIN]}
    for _ in range(rounds + 1):  # the first round warms up and is dropped
        t0 = time.perf_counter()
        WindowSource(tokens, context, global_batch, SEED).local_batch(step, slice(0, global_batch))
        out["stateless"].append(time.perf_counter() - t0)
        for name in GRAIN:
            t0 = time.perf_counter()
            it = grain_iter(name, tokens, context, global_batch, threads, step + 2)
            it.set_state(states[name])
            next(it)
            out[name].append(time.perf_counter() - t0)
            del it
    return {k: v[1:] for k, v in out.items()}


def fmt(values: list[float], scale: float = 1.0, digits: str = ".0f") -> str:
    v = [x * scale for x in values]
    return f"{statistics.median(v):{digits}} ({min(v):{digits}}-{max(v):{digits}})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--batches", type=int, default=1000, help="batches per pipeline per round")
    ap.add_argument(
        "--threads", default="0,16", help="grain ReadOptions.num_threads to compare (0: in the caller; 16: default)"
    )
    ap.add_argument("--resume-step", type=int, default=100_000)
    ap.add_argument("--check-steps", type=int, default=20)
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    try:
        import grain  # noqa: F401
    except ImportError:
        sys.exit("error: grain is not installed; pip install grain==0.2.18 (not a dependency of the repository)")
    import importlib.metadata

    tokens = byte_tokens(tfds_splits(read_utf8(SHARED_TINY_SHAKESPEARE, "tiny_shakespeare"))[0])
    print(f"grain {importlib.metadata.version('grain')}, numpy {np.__version__}, {os.cpu_count()} CPUs")
    print(
        f"tokens: Tiny Shakespeare train split, {len(tokens):,}; grain ReadOptions(num_threads in {threads}, "
        "prefetch_buffer_size=4 x threads)"
    )
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("same batches (exact, every key):")
    for line in check_equal(tokens, 128, 64, threads[-1], args.check_steps):
        print(line)
    print("resume (iterator state restored vs uninterrupted, 64 x 128):")
    for line in check_resume(tokens, 128, 64, threads[-1], 37):
        print(line)
    for global_batch, context in ((64, 128), (8, 1024)):
        rates = measure_speed(tokens, context, global_batch, threads, args.rounds, args.batches)
        base = statistics.median(rates["stateless"])
        print(
            f"host batches/s, {global_batch} x {context}, {args.rounds} interleaved rounds of {args.batches} "
            "batches: median (min-max), ratio of medians to stateless"
        )
        for label, values in rates.items():
            print(f"  {label:<18} {fmt(values):>22}   x{statistics.median(values) / base:.3f}")
    res = measure_resume(tokens, 1024, 8, threads[-1], args.resume_step, args.rounds)
    print(
        f"time to the batch of step {args.resume_step:,} from nothing (8 x 1024, grain t={threads[-1]}), ms: "
        "median (min-max)"
    )
    for name, values in res.items():
        print(f"  {name:<13} {fmt(values, 1e3, '.2f'):>22}")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
