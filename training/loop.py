"""The training loop: dispatch steps with a bound on the steps in flight, call the hooks that are due.

With more than one device taking part the loop keeps at most ``train.max_in_flight`` (2) steps in flight:
before dispatching step t+1 it waits on step t-1's output (on the CPU backend, too many steps of simulated-device
collectives in flight abort the process: ``check_in_flight``). One device has no collectives and a small step
leaves no room for a host round trip per step, so no bound applies there: the host never waits for a step except
inside the hooks (a logging window waits for its last step).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
from typing import Optional, Sequence

import jax

from core.errors import ConfigError, error_text
from training.hooks import Hook, LoopState
from training.report import warn

log = logging.getLogger(__name__)


# the most steps in flight on the CPU backend with more than one device: more can stall XLA:CPU's all-reduce until
# its 40 s rendezvous timeout aborts the process (SIGABRT)
CPU_MAX_IN_FLIGHT = 8


def check_in_flight(max_in_flight: int, devices: Sequence) -> None:
    """Refuses ``train.max_in_flight`` above ``CPU_MAX_IN_FLIGHT`` when ``devices`` (the run's jax devices) are
    more than one CPU device (other platforms and one device: no limit beyond being positive).

    Raises:
      ConfigError: one line naming the value, the device count and the fix.
    """
    if len(devices) > 1 and devices[0].platform == "cpu" and max_in_flight > CPU_MAX_IN_FLIGHT:
        raise ConfigError(
            f"train.max_in_flight={max_in_flight} with {len(devices)} CPU devices: more steps in flight than "
            f"{CPU_MAX_IN_FLIGHT} can stall XLA:CPU's collectives until a 40 s timeout aborts the process; use "
            f"train.max_in_flight={CPU_MAX_IN_FLIGHT} or less"
        )


def in_flight_bound(num_devices: int, max_in_flight: int) -> Optional[int]:
    """Steps allowed in flight: ``max_in_flight`` when more than one device takes part (the bound exists for
    simulated-device collectives), None (unbounded: no wait per step) with one device."""
    return max_in_flight if num_devices > 1 else None


def run_hooks(hooks: Sequence[Hook], loop: LoopState, step: int) -> None:
    """Asks every hook (every step, in order) whether it is due; pauses the timer once around the due ones."""
    due = [hook for hook in hooks if hook.due(step)]
    loop.logged_this_step = False
    if due:
        loop.timer.pause(loop.metrics)
        for hook in due:
            hook.run(loop, step)
        loop.timer.resume()
    if loop.extra and not loop.logged_this_step:
        # eval / sync values are attached to the next logged record of this step
        last_step, item = loop.window_records[-1]
        loop.window_records[-1] = (last_step, (item, loop.extra))
        loop.extra = {}


def train_loop(
    compiled,
    loop: LoopState,
    first_batch,
    batches,
    *,
    start: int,
    n_steps: int,
    hooks: Sequence[Hook],
    bound: Optional[int],
    transfer_guard: str,
    bar=None,
) -> LoopState:
    """Runs steps ``start + 1 .. n_steps`` from ``loop.state``; returns ``loop`` with the final state. Marks the
    first dispatch on ``loop.clock`` (``perf/startup_s``); closes every hook when it ends (also on errors).

    Args:
      compiled: the compiled train step ``(state, batch) -> (state, metrics)`` (with the gather inside it,
        ``Experiment.feed``: ``(state, (split, order)) -> (state, metrics)``).
      first_batch: the placed batch of step ``start`` (with the gather inside the step, ``Experiment.feed``: the
        device arrays it gathers from, ``DeviceSource.device_feeds``); ``batches`` yields the following ones.
      bound: steps allowed in flight (``in_flight_bound``): after dispatching step t the loop waits for the
        output of step t - ``bound`` before it dispatches the next; None: unbounded (never waits).
      transfer_guard: ``jax.transfer_guard`` level around the dispatch (``disallow``: any implicit host <->
        device transfer there raises; hooks run outside the guard and copy explicitly). ``allow``, JAX's
        default, sets no guard (a level set for the whole process, e.g. ``JAX_TRANSFER_GUARD``, applies).
      bar: a tqdm progress bar, or None.
    """
    in_flight: collections.deque = collections.deque()
    batch = first_batch
    # "allow" is JAX's default: no guard context per step (it costs host time in every step)
    guard = (
        contextlib.nullcontext if transfer_guard == "allow" else functools.partial(jax.transfer_guard, transfer_guard)
    )
    error: Optional[BaseException] = None
    try:
        for step in range(start, n_steps):
            with guard():
                if step > start:
                    batch = next(batches)
                loop.state, loop.metrics = compiled(loop.state, batch)
                if step == start:
                    loop.clock.first_step()
                loop.timer.steps += 1
                loop.window_records.append((step + 1, loop.metrics))
                if bound is not None:
                    in_flight.append(loop.metrics)
                    if len(in_flight) > bound:
                        jax.block_until_ready(in_flight.popleft())
            if bar is not None:
                bar.update(1)
            run_hooks(hooks, loop, step + 1)
    except BaseException as e:
        error = e
        raise
    finally:
        if bar is not None:
            bar.close()
        close_hooks(hooks, error)
    return loop


def close_hooks(hooks: Sequence[Hook], error: Optional[BaseException]) -> None:
    """Closes every hook, in order, also when one of them raises (the profiler and the signal handlers are always
    released, the last asynchronous save always awaited).

    Raises:
      when ``error`` (the exception the loop is ending with) is None: the first exception a hook's ``close``
      raised, once all are closed (any further one is printed as a ``warning:`` line). Otherwise ``error`` stays
      the run's error and each close error is one ``warning:`` line (stderr and the log) instead of replacing it:
      e.g. a checkpoint whose background write failed after a SIGTERM's save, which the SIGTERM line names.
      A ``KeyboardInterrupt`` or ``SystemExit`` from a ``close`` propagates at once (the hooks after it stay open).
    """
    failures: list[tuple[Hook, BaseException]] = []
    for hook in hooks:
        try:
            hook.close()
        except Exception as e:  # every hook is closed; the error is re-raised or reported below
            failures.append((hook, e))
    if not failures:
        return
    if error is None:
        for hook, e in failures[1:]:
            warn(f"closing {type(hook).__name__} also failed: {error_text(e)}", log)
        raise failures[0][1]
    for hook, e in failures:
        warn(f"closing {type(hook).__name__} failed after the run's error: {error_text(e)}", log)
