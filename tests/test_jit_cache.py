"""pmap(jit=True) keeps its compiled programs in a least-recently-used cache of
configurable size; memory stays flat once it is full; a function that recompiles on most
calls gets a warning saying what keeps changing."""
import gc
import warnings

import pytest
import torch

import torchpmap as tp

EAGER = {"backend": "eager"}  # compiling costs little: these tests are about the cache


def _graph_modules() -> int:
    gc.collect()
    # issubclass(type(o)), not isinstance: isinstance reads __class__, which some torch
    # module-level objects answer with a deprecation warning
    return sum(issubclass(type(o), torch.fx.GraphModule) for o in gc.get_objects())


def test_least_recently_used_eviction(monkeypatch):
    monkeypatch.setattr(tp.config, "jit_cache_size", 3)
    f = tp.pmap(lambda v: v + 1, jit=EAGER, devices=tp.devices()[:1])
    traces = []
    f_inner = f._programs._note_trace
    monkeypatch.setattr(
        f._programs, "_note_trace", lambda call, sig: (traces.append(sig.leaves[0][0]), f_inner(call, sig))
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tp.JitRecompileWarning)
        for width in [1, 2, 3, 1, 4, 1, 2]:  # 1 stays recent; 2 and 3 are evicted in turn
            f(torch.ones(2, width))
    assert [s[-1] for s in traces] == [1, 2, 3, 4, 2]
    assert len(f._programs) == 3


@pytest.mark.slow
def test_memory_stays_flat_past_the_bound(monkeypatch):
    monkeypatch.setattr(tp.config, "jit_cache_size", 4)
    f = tp.pmap(lambda v: v * 2 + 1, jit=EAGER, devices=tp.devices()[:1])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tp.JitRecompileWarning)
        for i in range(20):
            f(torch.ones(2, i + 1))
        before = _graph_modules()
        for i in range(20, 220):  # 200 recompiles past the bound
            f(torch.ones(2, i + 1))
        after = _graph_modules()
    assert len(f._programs) == 4
    assert after <= before, (before, after)  # every evicted program was freed (each held ~0.1 MiB)


def test_a_function_that_recompiles_on_most_calls_is_told_why():
    f = tp.pmap(lambda v: v * 2, jit=EAGER, devices=tp.devices()[:1])
    with pytest.warns(
        tp.JitRecompileWarning,
        match=r"traced and compiled on 8 of its 8 calls: the shapes, strides, dtypes or values of argument leaves "
        r"\[0\] keep changing",
    ):
        for i in range(8):
            f(torch.ones(2, i + 1))
    g = tp.pmap(lambda v: v * 2, jit=EAGER, devices=tp.devices()[:1])
    with warnings.catch_warnings():
        warnings.simplefilter("error", tp.JitRecompileWarning)  # a steady shape never warns
        for _ in range(20):
            g(torch.ones(2, 3))


def test_threads_calling_one_program_first_compile_it_once():
    """Four threads call a new pmap(jit=True) at once: the first traces and compiles it, the
    others wait for it and run that program (make_fx's patches are global: concurrent
    traces failed with an AssertionError and ran eagerly, with a JitFallbackWarning)."""
    import threading

    f = tp.pmap(lambda v: tp.psum(v * 2, "i") + v, axis_name="i", jit=True, devices=tp.devices()[:1])
    g = tp.pmap(lambda v: tp.pmax(v, "i") - v, axis_name="i", jit=True, devices=tp.devices()[:1])
    x = torch.arange(12.0).reshape(4, 3)
    start, results, failures = threading.Barrier(4), {}, []

    def call(k: int) -> None:
        start.wait()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", tp.JitFallbackWarning)
                results[k] = (f if k % 2 else g)(x + k)
        except BaseException as e:  # noqa: BLE001 - reported below
            failures.append(e)

    threads = [threading.Thread(target=call, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures, failures
    for k in range(4):
        v = x + k
        want = v.sum(0) * 2 + v if k % 2 else v.amax(0) - v
        assert torch.equal(results[k], want), k
    for fun in (f, g):  # each traced once (two threads waited), and compiled
        assert fun._programs._traces == 1 and fun._programs.compiled_count() == 1


def test_a_first_compile_in_a_thread_that_exits_leaves_later_compiles_working():
    """torch 2.11 (a CUDA build without a GPU) crashed the process on the next trace
    (segmentation fault) once the thread of the first one had exited; torchpmap registers
    what that first trace registers from the importing thread instead
    (torch_private.ensure_cuda_device_guard). A fresh process: the first trace counts."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import threading, torch, torchpmap as tp\n"
        "f = tp.pmap(lambda v: v * 2, jit=True, devices=tp.devices()[:1])\n"
        "t = threading.Thread(target=lambda: f(torch.ones(2, 3))); t.start(); t.join()\n"
        "g = tp.pmap(lambda v: v * 3, jit=True, devices=tp.devices()[:1])\n"
        "print(g(torch.ones(2, 3)).sum().item(), g._programs.compiled_count())\n"
    )
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.split() == ["18.0", "1"], (
        done.returncode,
        done.stdout,
        done.stderr[-2000:],
    )


def test_sharded_arguments_split_along_other_dims_get_programs_of_their_own(four_devices):
    """A ShardedTensor argument was keyed by its wrapper's strides (contiguous, whatever
    its shards hold): a program compiled for one split along dim 0 was reused for one of
    the same shape split along dim 1, and failed ("expected size 8==8, stride 1==4")."""
    a = torch.arange(32.0).reshape(8, 4)
    by_rows = tp.pmap(lambda v: v * 1, devices=four_devices)(a)
    by_cols = tp.pmap(lambda v: v * 1, out_axes=1, devices=four_devices)(a.t().contiguous())
    assert isinstance(by_rows, tp.ShardedTensor) and by_rows.shape == by_cols.shape == (8, 4)
    g = tp.pmap(lambda v: v.cumsum(0), in_axes=1, jit=True, devices=four_devices)
    for arg in (by_rows, by_cols, a):
        want = torch.as_tensor(torch.as_tensor(arg).cpu()).cumsum(0).t()
        torch.testing.assert_close(torch.as_tensor(g(arg)).cpu(), want)
