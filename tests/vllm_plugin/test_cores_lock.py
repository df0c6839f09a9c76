"""``harness.Cores``, the lock under which ``make vllm-test``'s two workers run a test that takes both cores alone:
one waiting to hold it alone goes before sharers that come after it, and holds it once the sharers before it are
done. Threads stand for the workers (each hold opens the lock's files anew, as a process does)."""

from __future__ import annotations

import threading

import pytest
from harness import Cores

pytestmark = pytest.mark.quick


def holding(cores: Cores, alone: bool, released: threading.Event) -> tuple[threading.Thread, threading.Event]:
    """A thread that holds ``cores`` (alone or shared) until ``released`` -> (it, set once it holds)."""
    held = threading.Event()

    def run():
        fd = cores.hold(alone)
        held.set()
        released.wait(30)
        cores.release(fd)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, held


def test_one_waiting_alone_goes_before_later_sharers(tmp_path):
    cores = Cores(tmp_path / "cores")
    first_done, alone_done, later_done = threading.Event(), threading.Event(), threading.Event()
    first, first_held = holding(cores, False, first_done)
    assert first_held.wait(10)
    alone, alone_held = holding(cores, True, alone_done)
    assert not alone_held.wait(0.5), "held alone while another shares it"
    later, later_held = holding(cores, False, later_done)
    assert not later_held.wait(0.5), "a later sharer went before the one waiting to hold it alone"
    first_done.set()
    assert alone_held.wait(10)
    assert not later_held.wait(0.5), "shared while held alone"
    alone_done.set()
    assert later_held.wait(10)
    later_done.set()
    for thread in (first, alone, later):
        thread.join(10)


def test_sharers_share(tmp_path):
    cores = Cores(tmp_path / "cores")
    done = threading.Event()
    (a, a_held), (b, b_held) = holding(cores, False, done), holding(cores, False, done)
    assert a_held.wait(10) and b_held.wait(10)
    done.set()
    a.join(10), b.join(10)
