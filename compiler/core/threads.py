"""Threads from the cores other jobs leave free, chosen before torch loads (issue 55).

torch runs one OpenMP thread a core, and its threads wait for each other at every operation by
spinning. Beside a job that holds a core, the thread on that core runs in the job's time slices
and its partner spins the while: a default ``ctxc bake`` beside one busy loop on the 2-core
machine took 277 s of wall and 344 s of CPU against 115 s and 200 s quiet (docs/bake.md,
Measured). :func:`free_cores` samples the kernel's per-core counters for a tenth of a second;
:func:`choose_threads` sets ``OMP_NUM_THREADS`` (which torch reads when it loads, as do the
processes it starts) to the free cores when they are fewer than the allowed ones. A quiet machine
is left as it is: its speed is kept. A choice the user made (``--threads``, ``CTXC_THREADS``,
``OMP_NUM_THREADS``) is never changed.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

__all__ = ["SAMPLE_SECONDS", "choose_threads", "free_cores"]

SAMPLE_SECONDS = 0.1  # ten of the kernel's 100 Hz ticks per core
# A core counts as held when the busy share summed over the allowed cores reaches its next whole
# number less this: a shell or a page-cache flush (0.1-0.3) holds none, a busy loop (~1.0) one.
_SLACK = 0.3
_STAT = Path("/proc/stat")


def _ticks(cores: set[int]) -> dict[int, tuple[int, int]] | None:
    """Per allowed core: (idle ticks, all ticks) from ``/proc/stat``; None where unreadable."""
    try:
        lines = _STAT.read_text().splitlines()
    except OSError:
        return None
    out = {}
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or not name[3:].isdigit():
            continue
        core = int(name[3:])
        if core in cores and len(fields) >= 5:
            values = [int(v) for v in fields[:8]]
            out[core] = (values[3] + values[4], sum(values))  # idle + iowait, all
    return out or None


def _physical(cores: set[int]) -> int:
    """The physical cores among ``cores`` (hyper-threads of one core counted once), as torch
    counts them for its default threads; ``len(cores)`` where the topology is not readable."""
    seen = set()
    for core in cores:
        top = Path(f"/sys/devices/system/cpu/cpu{core}/topology")
        try:
            seen.add(((top / "physical_package_id").read_text(), (top / "core_id").read_text()))
        except OSError:
            return len(cores)
    return len(seen)


def free_cores(seconds: float = SAMPLE_SECONDS) -> tuple[int, int] | None:
    """The cores this process may run on that no other job holds now, and how many it may.

    Args:
        seconds: how long to sample (this process sleeps the while, so its own use is nil).

    Returns:
        ``(free, allowed)``, free at least 0; None where the kernel's counters are not
        readable (not Linux).
    """
    try:
        cores = set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    before = _ticks(cores)
    if before is None:
        return None
    time.sleep(seconds)
    after = _ticks(cores)
    if after is None:
        return None
    busy = 0.0
    for core, (idle, total) in after.items():
        if core in before:
            spent = total - before[core][1]
            busy += 1.0 - (idle - before[core][0]) / spent if spent > 0 else 0.0
    held = math.floor(busy + _SLACK)
    return max(len(cores) - held, 0), len(cores)


def choose_threads(seconds: float = SAMPLE_SECONDS) -> int | None:
    """Set ``OMP_NUM_THREADS`` to the free cores when other jobs hold some, before torch loads.

    Nothing is set when the user chose (``OMP_NUM_THREADS`` set), when torch is already loaded
    (a library caller's process: its threads are its own), where the counters are unreadable,
    or when every allowed core is free.

    Returns:
        the threads set, or None when nothing was set.

    Side effects:
        sets ``os.environ["OMP_NUM_THREADS"]`` (this process's torch and its children read it).
    """
    if "OMP_NUM_THREADS" in os.environ or "torch" in sys.modules:
        return None
    found = free_cores(seconds)
    if found is None:
        return None
    free, allowed = found
    if free >= allowed:
        return None
    try:
        default = _physical(set(os.sched_getaffinity(0)))  # torch's own count
    except OSError:
        return None
    threads = max(min(free, default), 1)
    if threads >= default:
        return None
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return threads
