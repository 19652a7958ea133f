"""torchpmap._frontend.function_cache: ``pmap(f)`` made again with the same options shares
what the one made before learned (and compiled)."""
import gc
import warnings

import torch

import torchpmap as tp


def double(x):
    return x * 2


def shares(a, b):
    return a._layouts is b._layouts and a._vmap_fallback is b._vmap_fallback and a._programs is b._programs


def test_the_same_function_and_options_share_what_was_learned():
    assert shares(tp.pmap(double), tp.pmap(double))
    assert shares(tp.pmap(double, axis_name="i"), tp.pmap(double, axis_name="i"))
    assert shares(tp.pmap(double, in_axes=(0,)), tp.pmap(double, in_axes=(0,)))
    assert shares(tp.pmap(double, jit=True), tp.pmap(double, jit=True))


def test_other_options_learn_apart():
    kept = tp.pmap(double)
    assert not shares(tp.pmap(double, axis_name="i"), kept)
    assert not shares(tp.pmap(double, out_axes=1), kept)
    assert not shares(tp.pmap(double, jit=True), kept)
    assert not shares(tp.pmap(lambda x: x * 2), tp.pmap(lambda x: x * 2))  # two function objects


def test_unhashable_options_learn_afresh_each_time():
    options = {"options": {"max_autotune": False}}
    assert not shares(tp.pmap(double, jit=options), tp.pmap(double, jit=options))


def test_bad_options_still_raise_every_time():
    for _ in range(2):
        try:
            tp.pmap(double, randomness="sometimes")
        except ValueError:
            pass
        else:
            raise AssertionError("randomness='sometimes' was accepted")


def test_a_collected_function_takes_its_entry_with_it():
    from torchpmap._frontend import function_cache

    def local(x):
        return x + 1

    tp.pmap(local)(torch.ones(2, 3))
    tp.pmap(local, jit=True)(torch.ones(2, 3))  # a compiled program must not hold the function either
    assert local in function_cache._made
    gc.collect()  # the functions of earlier tests that are garbage already go first
    before = len(function_cache._made)
    del local
    gc.collect()
    assert len(function_cache._made) == before - 1


def test_inline_jit_calls_trace_once():
    """``pmap(f, jit=True)(x)`` written inside a loop traces ``f`` once, as a kept mapped
    function does (JAX caches on the function's identity the same way), and gives the
    kept function's numbers."""
    traced = []

    def step(x):
        traced.append(1)  # runs in Python only while tracing
        return torch.sin(x) + tp.psum(x, "i")

    x = torch.randn(4, 3)
    one = tp.devices()[:1]  # one device: traced and compiled on every machine
    results = [tp.pmap(step, axis_name="i", jit=True, devices=one)(x + k) for k in range(3)]
    assert len(traced) == 1
    for k, got in enumerate(results):
        torch.testing.assert_close(got, tp.pmap(step, axis_name="i")(x + k))


def test_inline_lambdas_copy_their_arguments_on_the_first_call_only(monkeypatch, placement):
    """A lambda written inline in a loop is a new function each time, with one code object.
    Until that code has run vectorized, a call keeps a copy of its mapped arguments, to undo
    a failed attempt's writes (torchpmap._engines.rerun_guard); once it has, no function of
    that code copies again. A closure's fallback stays its own: another closure of the same
    code that needs one still falls back and writes once."""
    from torchpmap._engines import rerun_guard

    kept = []
    note = rerun_guard.note

    def noting(call):
        before = note(call)
        kept.append(before.saved)
        return before

    monkeypatch.setattr(rerun_guard, "note", noting)
    x = torch.arange(8.0).reshape(4, 2)
    inline = compile("lambda t: t * 2 + step", "<loop body>", "eval")  # a code object of this test run's own
    for step in range(3):
        got = tp.pmap(eval(inline, {"step": step}))(x)  # a new function each time, as written inline
        torch.testing.assert_close(torch.as_tensor(got).cpu(), x * 2 + step)
    # a device per instance runs each alone, without vmap: nothing to undo, no copy
    assert [k is not None for k in kept] == ([False] * 3 if len(placement) == 4 else [True, False, False])

    def make(read):
        def body(t):
            t.add_(1)
            return t * t.sum().item() if read else t * 2

        return body

    y = torch.arange(8.0).reshape(4, 2)
    tp.pmap(make(False))(y.clone())  # this code has run vectorized now
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tp.VectorizationFallbackWarning)
        # another closure of it fails vectorized after its write (on one device; 4
        # devices run one instance each): no copy was kept, so it refuses to run the
        # instances again rather than write twice. On every placement: written once.
        try:
            got = tp.pmap(make(True))(y)
        except RuntimeError as e:
            assert "cannot be undone" in str(e)
        else:
            want = torch.arange(8.0).reshape(4, 2) + 1
            torch.testing.assert_close(torch.as_tensor(got).cpu(), want * want.sum(1, keepdim=True))
    torch.testing.assert_close(y, torch.arange(8.0).reshape(4, 2) + 1)


# ------------------------------------------------ the autograd record: by code and what is held


def _counting_hook(module: torch.nn.Module) -> list[int]:
    calls: list[int] = []
    module.register_full_backward_hook(lambda *args: calls.append(1))
    return calls


def test_an_inline_lambda_over_the_same_module_is_watched_once_and_a_later_hook_is_still_caught():
    """A lambda written inline in a loop is a new function per call; over the same module it
    shares one autograd record (watched on the first call only, then checked), so the
    watch's slow path is not paid on every call, and a hook added later is still called
    once per instance."""
    model = torch.nn.Linear(3, 2)
    x = torch.randn(4, 5, 3, requires_grad=True)
    one = [tp.devices()[0]]
    made = [tp.pmap(lambda v: model(v).sum(), devices=one) for _ in range(2)]
    assert made[0]._vmap_fallback.autograd is made[1]._vmap_fallback.autograd
    for _ in range(2):
        tp.pmap(lambda v: model(v).sum(), devices=one)(x).sum().backward()
    calls = _counting_hook(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tp.VectorizationFallbackWarning)
        tp.pmap(lambda v: model(v).sum(), devices=one)(x).sum().backward()
    assert len(calls) == 4


def test_closures_over_other_modules_or_other_bound_objects_are_watched_apart():
    """The same code over another model (``make_step(model)`` for two models), or a method
    bound to another object, keeps a record of its own: a hook on the second model is
    called once per instance, although the first model's watched run found no hook."""

    def make_step(model: torch.nn.Module):
        return tp.pmap(lambda v: model(v).sum(), devices=[tp.devices()[0]])

    first, second = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    x = torch.randn(4, 5, 3, requires_grad=True)
    make_step(first)(x).sum().backward()  # watched: no hook
    assert make_step(first)._vmap_fallback.autograd is not make_step(second)._vmap_fallback.autograd
    calls = _counting_hook(second)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tp.VectorizationFallbackWarning)
        make_step(second)(x).sum().backward()
    assert len(calls) == 4
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    assert tp.pmap(a.forward)._vmap_fallback.autograd is not tp.pmap(b.forward)._vmap_fallback.autograd


def test_a_closure_over_a_list_keeps_a_record_of_its_own():
    """A list may change between calls, and hold other modules: not shared."""
    layers = [torch.nn.Linear(3, 3)]
    made = [tp.pmap(lambda v: layers[0](v)) for _ in range(2)]
    assert made[0]._vmap_fallback.autograd is not made[1]._vmap_fallback.autograd


def test_closures_whose_empty_cells_differ_keep_records_of_their_own():
    """Cells are compared in place: a closure holding (the layer, empty) is not one holding
    (empty, the layer), though both hold the same layer."""
    shared = torch.nn.Linear(3, 3)

    def make(first: bool):
        if first:
            a = shared
        else:
            b = shared
        return lambda v: a(v) + b(v)  # one of its two cells stays empty

    assert tp.pmap(make(True))._vmap_fallback.autograd is not tp.pmap(make(False))._vmap_fallback.autograd
