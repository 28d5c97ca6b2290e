"""Threads from the free cores (compiler/core/threads.py, issue 55): the kernel's counters read
twice; cores other jobs hold are left to them, a quiet machine and a user's choice untouched."""

from __future__ import annotations

import sys

import pytest

from ctxc.core import threads


def _counters(monkeypatch, busy: list[float], cores: int = 2, physical: int = 2) -> None:
    """Two reads of ``/proc/stat``: core i busy ``busy[i]`` of 100 ticks between them."""
    reads = iter(
        [
            {c: (0, 0) for c in range(cores)},
            {c: (round(100 * (1 - busy[c])), 100) for c in range(cores)},
        ]
    )
    monkeypatch.setattr(threads, "_ticks", lambda _cores: next(reads))
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda _pid: set(range(cores)))
    monkeypatch.setattr(threads, "_physical", lambda _cores: physical)
    monkeypatch.setattr(threads.time, "sleep", lambda _s: None)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delitem(sys.modules, "torch")  # a CLI process before torch loads


@pytest.mark.parametrize(
    ("busy", "physical", "want"),
    [
        ([0.05, 0.2], 2, None),  # quiet: left as it is
        ([1.0, 0.1], 2, "1"),  # one busy loop
        ([1.0, 1.0], 2, "1"),  # both held: one thread still
        ([0.6, 0.5], 2, "1"),  # a core's worth spread over two
        ([1.0, 0.0, 0.0, 0.0], 2, None),  # 3 of 4 logical free, torch runs 2 anyway
        ([1.0, 1.0, 1.0, 0.0], 2, "1"),
    ],
)
def test_torch_gets_the_cores_other_jobs_leave(monkeypatch, busy, physical, want) -> None:
    _counters(monkeypatch, busy, cores=len(busy), physical=physical)
    got = threads.choose_threads()
    env = threads.os.environ.get("OMP_NUM_THREADS")
    assert env == want and got == (int(want) if want else None), (busy, got, env)


def test_a_users_choice_and_a_loaded_torch_are_left_alone(monkeypatch) -> None:
    _counters(monkeypatch, [1.0, 1.0])
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert threads.choose_threads() is None and threads.os.environ["OMP_NUM_THREADS"] == "2"
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setitem(sys.modules, "torch", object())  # a library caller's process
    assert threads.choose_threads() is None and "OMP_NUM_THREADS" not in threads.os.environ


def test_the_real_counters_read_and_count_this_machines_cores() -> None:
    found = threads.free_cores(0.02)
    if sys.platform != "linux":
        assert found is None, found
        return
    assert found is not None, "no /proc/stat on Linux"
    free, allowed = found
    assert 0 <= free <= allowed and allowed >= 1, found
