"""The baton of the device threads (torchpmap._engines.baton).

The case it exists for: a thread that runs work for the holder while the holder waits
for it (autograd's CUDA device thread running a collective's backward node for the
device thread that called ``torch.func.grad``) sets the baton down, lets another device
thread run up to the collective, and picks it up for the holder. Before, the baton was
an ``RLock``, which only its owner may release: on the H200 (2026-11-27), a shard_map
with the gradient inside the map on ``cuda:0`` and a CPU device raised "cannot release
un-acquired lock".
"""
from __future__ import annotations

import threading

import pytest
import torch

import torchpmap as tp
from torchpmap._engines.baton import Baton


def test_a_thread_acting_for_the_holder_sets_the_baton_down_and_picks_it_up_for_it():
    baton, order = Baton(), []
    other_ran = threading.Event()

    def other() -> None:  # another device thread: runs only while the baton is down
        with baton:
            order.append("other")
            other_ran.set()

    def for_the_holder() -> None:  # autograd's thread, while the holder blocks on it
        held = baton.set_down()
        assert other_ran.wait(10)
        baton.pick_up(held)
        order.append("picked up")

    baton.acquire()
    baton.acquire()  # reentrant for its holder
    waiting = threading.Thread(target=other)
    waiting.start()
    helper = threading.Thread(target=for_the_holder)
    helper.start()
    helper.join(10)
    assert not helper.is_alive() and order == ["other", "picked up"]
    baton.release()  # the holder gives back both takes: it holds the baton as it did
    baton.release()
    waiting.join(10)
    with baton:  # free again
        pass


def test_the_baton_stays_with_its_holder_until_the_last_release():
    baton, got = Baton(), threading.Event()
    baton.acquire()
    baton.acquire()
    baton.release()
    t = threading.Thread(target=lambda: (baton.acquire(), got.set(), baton.release()))
    t.start()
    assert not got.wait(0.2)
    baton.release()
    assert got.wait(10)
    t.join(10)


def test_only_the_holder_gives_a_take_back():
    baton = Baton()
    baton.acquire()
    errors: list[BaseException] = []

    def stranger() -> None:
        try:
            baton.release()
        except RuntimeError as e:
            errors.append(e)

    t = threading.Thread(target=stranger)
    t.start()
    t.join(10)
    assert len(errors) == 1 and "does not hold" in str(errors[0])
    baton.release()
    with pytest.raises(RuntimeError, match="does not hold"):
        baton.release()


@pytest.mark.parametrize("debug", [False, True], ids=["devices", "debug mode"])
def test_the_threads_take_their_first_turns_in_their_order(placement, debug):
    """Each instance's thread (debug mode) or device thread runs up to its first collective
    in the order of the axis, as a loop does: a list the function appends to, or a buffer it
    updates in place, ends the same on every run (the first free thread took the baton)."""
    if not debug and tp.device_count() == 1:
        pytest.skip("one device runs its instances vectorized, in one thread")
    for _ in range(5):
        order: list[int] = []

        def f(x: torch.Tensor) -> torch.Tensor:
            order.append(int(tp.axis_index("i")))
            return tp.psum(x, "i")

        mapped = tp.pmap(f, axis_name="i", devices=tp.devices()[: 1 if debug else 4])
        if debug:
            with tp.disable_vectorization():
                mapped(torch.arange(8.0))
        else:
            mapped(torch.arange(4.0))
        assert order == list(range(8 if debug else 4))
