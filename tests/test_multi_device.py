"""Several devices in one process: placement, sharded outputs, faults, mesh, debug mode.

The fixture ``cpu_devices`` switches the number of CPU devices for one test, so these
tests exercise the multi-device engine whatever TORCHPMAP_NUM_CPU_DEVICES the run uses.
"""
import contextlib
import threading
import warnings

import numpy as np
import pytest
import torch
from torch.func import grad

import torchpmap as tp
from torchpmap._engines.thread_exchange import Rendezvous
from torchpmap._placement import devices as _devices


@pytest.fixture
def cpu_devices(monkeypatch):
    def use(n: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
        monkeypatch.setenv("TORCHPMAP_NUM_CPU_DEVICES", str(n))
        _devices._local_devices.cache_clear()
        return tp.devices()

    yield use
    monkeypatch.undo()
    _devices._local_devices.cache_clear()


def placed_on() -> int:
    """The id of the device this instance runs on."""
    return _devices.current_default()[0].id


PROGRAMS = {
    "psum": lambda v: tp.psum(v, "i"),
    "pmean_int": lambda v: tp.pmean(v.long(), "i"),
    "pmax": lambda v: tp.pmax(v, "i"),
    "all_gather": lambda v: tp.all_gather(v, "i", axis=1),
    "all_gather_tiled": lambda v: tp.all_gather(v, "i", tiled=True),
    "psum_scatter": lambda v: tp.psum_scatter(v.repeat(8 // v.shape[0] + 1)[:8].reshape(8, 1), "i"),
    "ppermute": lambda v: tp.ppermute(v, "i", [(j, (j + 3) % 8) for j in range(8)]),
    "all_to_all": lambda v: tp.all_to_all(v.repeat(4).reshape(8, 1), "i", 0, 1),
    "axis_index": lambda v: v * tp.axis_index("i"),
    "groups": lambda v: tp.psum(v, "i", axis_index_groups=[[0, 5], [1, 2, 3], [4, 6, 7]]),
}


@pytest.mark.parametrize("name", sorted(PROGRAMS))
@pytest.mark.parametrize("n_devices", [2, 4, 8])
def test_results_identical_to_one_device(cpu_devices, name, n_devices):
    devs = cpu_devices(n_devices)
    x = torch.randn(8, 2, generator=torch.Generator().manual_seed(0))
    f = PROGRAMS[name]
    many = tp.pmap(f, axis_name="i")(x)
    one = tp.pmap(f, axis_name="i", devices=devs[:1])(x)
    assert isinstance(many, tp.ShardedTensor) and isinstance(one, torch.Tensor)
    assert many.devices() == devs
    assert torch.equal(torch.as_tensor(many), one)


def test_placement_uses_first_devices_then_splits_evenly(cpu_devices):
    devs = cpu_devices(4)
    assert [repr(d) for d in devs] == ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]
    where = tp.pmap(lambda v: v * 0 + placed_on())
    assert where(torch.zeros(2)).devices() == devs[:2]
    assert torch.as_tensor(where(torch.zeros(8))).tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    chosen = tp.pmap(lambda v: v * 0 + placed_on(), devices=[devs[3], devs[1]])(torch.zeros(4))
    assert chosen.devices() == [devs[3], devs[1]] and chosen.tolist() == [3, 3, 1, 1]
    with pytest.raises(ValueError, match=r"size 6.*4 devices"):
        where(torch.zeros(6))


def test_sharded_tensor_behaves_like_a_tensor(cpu_devices):
    cpu_devices(2)
    out = tp.pmap(lambda v: v * 2)(torch.arange(8.).reshape(4, 2))
    assert out.shape == (4, 2) and out.dtype == torch.float32 and out.dim() == 2 and len(out) == 4
    assert [s.device for s in out.shards] == out.devices() and [s.tensor.shape for s in out.shards] == [(2, 2)] * 2
    assert out.tolist() == (torch.arange(8.).reshape(4, 2) * 2).tolist()
    assert np.array_equal(out.numpy(), np.asarray(out))
    assert torch.equal(out[3], torch.tensor([12.0, 14.0])) and out[3].data_ptr() == out.shards[1].tensor[1].data_ptr()
    assert torch.equal(torch.sum(out, 0), torch.tensor([24.0, 32.0]))
    assert torch.equal(out + 1, torch.as_tensor(out) + 1)
    assert "devices=[cpu:0, cpu:1]" in repr(out) and repr(out).startswith("tensor([[")


def test_sharded_tensor_fed_back_is_not_copied(cpu_devices):
    cpu_devices(4)
    first = tp.pmap(lambda v: v + 1)(torch.arange(4.))
    seen = []

    def record(v):  # one instance per device, run directly: v is the slice of its device's shard
        seen.append(v.data_ptr())
        return v * 2

    again = tp.pmap(record)(first)
    assert sorted(seen) == sorted(s.tensor.data_ptr() for s in first.shards)
    assert torch.equal(torch.as_tensor(again), (torch.arange(4.) + 1) * 2)
    # a result that is the argument's own shard is copied (see torchpmap._frontend.output_copies)
    same = tp.pmap(lambda v: v)(first)
    assert not {s.tensor.data_ptr() for s in same.shards} & {s.tensor.data_ptr() for s in first.shards}
    first = tp.pmap(lambda v: v + 1)(torch.arange(8.))
    # a different placement is gathered and split again, still correct
    other = tp.pmap(lambda v: v, devices=tp.devices()[:2])(first)
    assert torch.equal(torch.as_tensor(other), torch.arange(8.) + 1)


def test_exception_reaches_caller_and_pool_recovers(cpu_devices):
    cpu_devices(4)

    def fails_on_device_2(v):
        total = tp.psum(v, "i")
        if placed_on() == 2:
            raise KeyError("broken instance")
        return tp.psum(total, "i")  # the others wait here and must be released

    threads_before = threading.active_count()
    with pytest.raises(KeyError, match="broken instance") as info:
        tp.pmap(fails_on_device_2, axis_name="i")(torch.arange(4.))
    assert any("instance 2" in note and "cpu:2" in note for note in info.value.__notes__)
    assert info.traceback[-1].name == "fails_on_device_2"  # the original traceback
    assert torch.equal(
        torch.as_tensor(tp.pmap(lambda v: tp.psum(v, "i"), axis_name="i")(torch.arange(4.0))), torch.full((4,), 6.0)
    )
    assert threading.active_count() <= threads_before + 4  # the workers were reused, none left hanging


def _within(seconds: float, fn):
    """``fn()``'s result or exception, or a failure if it has not returned in ``seconds``."""
    box: dict = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the test
            box["error"] = e

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"still running after {seconds} s: a deadlock"
    if "error" in box:
        raise box["error"]
    return box["value"]


@pytest.mark.parametrize("n_devices", [1, 2, 4])
def test_a_nested_map_failing_after_a_collective_over_the_outer_axis_neither_hangs_nor_differs(cpu_devices, n_devices):
    """A nested map whose vectorized run fails, inside a device thread of the outer map:
    its instances used to be rerun one at a time (to name the failing one, or as the
    fallback of a function vmap cannot run), and their collective over the outer axis
    waited for the other device threads while this one held their turn: a deadlock on 2
    and 4 devices. The failure now goes to the outer map: the user's error at once, and
    the fallback's numbers, as on one device."""
    cpu_devices(n_devices)

    def raises(v):
        tp.psum(v, "i")
        raise ValueError("user error after a collective")

    with pytest.raises(ValueError, match="user error after a collective"):
        _within(60, lambda: tp.pmap(tp.pmap(raises, axis_name="j"), axis_name="i")(torch.ones(2, 4, 3)))

    def reads_a_value(v):  # .item(): vmap cannot run it, the instances fall back to one at a time
        s = tp.psum(v, "i")
        return s * 2 if v.sum().item() > 0 else -s

    x = torch.arange(24.0).reshape(2, 4, 3) - 10
    want = torch.stack([torch.where(x[i].sum(-1, keepdim=True) > 0, 2 * x.sum(0), -x.sum(0)) for i in range(2)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tp.VectorizationFallbackWarning)
        got = _within(60, lambda: tp.pmap(tp.pmap(reads_a_value, axis_name="j"), axis_name="i")(x))
        torch.testing.assert_close(torch.as_tensor(got), want)
        # a map that fell back (remembered) on one device, reused inside the device threads
        inner = tp.pmap(reads_a_value, axis_name="j")
        for devices in (tp.devices()[:1], tp.devices()[:2]):
            got = _within(60, lambda devices=devices: tp.pmap(inner, axis_name="i", devices=devices)(x))
            torch.testing.assert_close(torch.as_tensor(got), want)


def test_collective_that_cannot_complete_times_out():
    """A participant that neither arrives nor returns (a device that stopped): the meeting
    gives up after the timeout. (A thread that blocks holding the turn keeps the others
    from running at all; one that returns is caught at once: see the next test.)"""
    rendezvous = Rendezvous(0.5)
    with pytest.raises(TimeoutError, match=r"psum over axis 'i' waited 0.5 s for the participants \[1\] of 2"):
        rendezvous.meet("group", 1, 0, 2, "psum over axis 'i'", torch.zeros(1), lambda values: values)


@pytest.mark.filterwarnings("ignore::torchpmap.VectorizationFallbackWarning")  # the branch cannot vectorize
@pytest.mark.parametrize("debug", [False, True], ids=["vectorized", "debug"])
@pytest.mark.parametrize("n_devices", [1, 2, 4])
def test_a_collective_that_some_instances_skip_raises_at_once_naming_them(cpu_devices, monkeypatch, n_devices, debug):
    """A branch on a value: instances 1 and 3 return without calling psum. That waited
    for the collective timeout (300 s), then raised; the others now learn at once that
    those instances returned (JAX refuses such a program when it traces it)."""
    cpu_devices(n_devices)
    monkeypatch.setattr(tp.config, "collective_timeout", 120.0)  # waiting for it would fail the match below

    def branch(v):
        if v.sum() > 0:
            return tp.psum(v, "i")
        return v

    f = tp.pmap(branch, axis_name="i")
    with tp.disable_vectorization() if debug else contextlib.nullcontext():
        with pytest.raises(RuntimeError, match=r"psum over axis 'i' was called by .* returned without calling it"):
            f(torch.tensor([1.0, -1.0, 2.0, -2.0]))
        # the same program where every instance takes the branch: the pmap is fine afterwards
        torch.testing.assert_close(f(torch.tensor([1.0, 2.0, 3.0, 4.0])), torch.full((4,), 10.0))


def test_instances_that_disagree_on_the_collective_fail_clearly(cpu_devices):
    cpu_devices(2)

    def mismatched(v):
        return tp.pmax(v, "i") if placed_on() == 1 else tp.psum(v, "i")

    with pytest.raises(RuntimeError, match="disagree on the collective"):
        tp.pmap(mismatched, axis_name="i")(torch.arange(2.))


def test_concurrent_callers_from_python_threads(cpu_devices):
    cpu_devices(4)
    f = tp.pmap(lambda v: tp.psum(v, "i") + tp.axis_index("i"), axis_name="i")
    results, errors = {}, []

    def call(seed):
        try:
            x = torch.arange(8.) * seed
            results[seed] = (x, torch.as_tensor(f(x)))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=call, args=(s,)) for s in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and len(results) == 6
    for x, out in results.values():
        assert torch.equal(out, x.sum() + torch.arange(8.))


def test_autodiff_across_devices(cpu_devices):
    devs = cpu_devices(4)
    x = torch.arange(1.0, 9.0)
    inside = tp.pmap(grad(lambda v: tp.psum(v**2, "i")), axis_name="i")(x)
    assert torch.equal(torch.as_tensor(inside), 16 * x)  # psum transposes to psum: 8 instances * 2x
    y = x.clone().requires_grad_()
    out = tp.pmap(lambda v: tp.all_gather(v, "i") * (tp.axis_index("i") + 1), axis_name="i")(y)
    torch.as_tensor(out).sum().backward()  # a ShardedTensor is a tensor: as_tensor keeps the graph
    y1 = x.clone().requires_grad_()
    tp.pmap(lambda v: tp.all_gather(v, "i") * (tp.axis_index("i") + 1), axis_name="i", devices=devs[:1])(
        y1
    ).sum().backward()
    assert torch.equal(y.grad, y1.grad) and torch.equal(y.grad, torch.full((8,), 36.0))
    # a torch.func transform around a pmap on several devices: as on one device
    around = [
        grad(lambda v: tp.pmap(lambda u: tp.psum(u, "i") * u, axis_name="i", devices=d)(v).sum())(x)
        for d in (devs, devs[:1])
    ]
    assert torch.equal(around[0], around[1])


def test_nested_pmap_without_mesh_vectorizes_the_inner_axis(cpu_devices):
    devs = cpu_devices(2)
    x = torch.arange(8.).reshape(2, 4)
    f = tp.pmap(tp.pmap(lambda v: tp.psum(v, "j") + tp.psum(v, "i") * 0 + placed_on(), axis_name="j"), axis_name="i")
    out = f(x)
    assert out.devices() == devs
    assert torch.as_tensor(out).tolist() == [[6.0] * 4, [23.0] * 4]


@pytest.mark.parametrize("outer", ["pmap", "vmap"])
def test_a_nested_pmap_with_devices_is_refused_naming_the_enclosing_map(cpu_devices, outer):
    """Refused on every placement, also under torchpmap.vmap (the message spoke of a
    multi-device pmap there)."""
    devs = cpu_devices(2)
    inner = tp.pmap(lambda v: v * 2, axis_name="j", devices=devs[:1])
    wrap = tp.pmap if outer == "pmap" else tp.vmap
    for devices in ({"devices": devs[:1]}, {"devices": devs}) if outer == "pmap" else ({},):
        with pytest.raises(ValueError, match=r"nested inside another map \(a pmap, torchpmap.vmap or shard_map\)"):
            wrap(inner, axis_name="i", **devices)(torch.ones(2, 3))


def test_mesh_places_instance_d_m_on_mesh_device(cpu_devices):
    devs = cpu_devices(4)
    mesh = tp.Mesh(np.array(devs).reshape(2, 2), ("data", "model"))
    x = torch.arange(4.0).reshape(2, 2)

    def inner(v):
        return (
            v * 0 + placed_on(),
            tp.axis_index(("data", "model")),
            tp.psum(v, "model"),
            tp.psum(v, "data"),
            tp.psum(v, ("data", "model")),
            tp.all_gather(v, "data"),
        )

    nested = tp.pmap(tp.pmap(inner, axis_name="model"), axis_name="data")
    with mesh:
        on_mesh = [torch.as_tensor(o) for o in nested(x)]
    vectorized = tp.pmap(tp.pmap(inner, axis_name="model"), axis_name="data", devices=devs[:1])(x)
    expected_device = torch.tensor([[float(mesh.devices[d, m].id) for m in range(2)] for d in range(2)])
    assert torch.equal(on_mesh[0], expected_device)
    for got, want in zip(on_mesh[1:], vectorized[1:]):
        assert torch.equal(got, want)
    assert on_mesh[2].tolist() == [[1.0, 1.0], [5.0, 5.0]]  # "model": within a mesh row
    assert on_mesh[3].tolist() == [[2.0, 4.0], [2.0, 4.0]]  # "data": within a mesh column
    # the same through pmap(..., mesh=mesh), and gradients through the mesh
    y = x.clone().requires_grad_()
    f = tp.pmap(
        tp.pmap(lambda v: tp.psum(v**2, "data") * (tp.axis_index("model") + 1), axis_name="model", mesh=mesh),
        axis_name="data",
        mesh=mesh,
    )
    torch.sum(f(y)).backward()  # torch functions gather differentiably
    assert torch.equal(y.grad, 4 * (torch.arange(2.0) + 1) * x)


@pytest.mark.parametrize("transform", ["grad", "vjp", "jvp", "vmap"])
def test_a_torch_func_transform_around_mesh_pmaps_gives_one_devices_numbers(cpu_devices, transform):
    """A mesh runs a thread per position, which a transform around the call cannot follow
    (its backward would run every position's node in one thread). Under one, the outer
    mesh axis runs over its devices as a plain multi-device pmap, and the axes nested in it
    vectorized on each device: the same numbers as on one device. A transform inside a
    position, around a nested mesh pmap, runs that pmap on the position's device."""
    devs = cpu_devices(4)
    mesh = tp.Mesh(np.array(devs).reshape(2, 2), ("i", "j"))

    def f(v):
        return tp.psum(v * v, "i") * (tp.axis_index("j") + 1)

    nested = tp.pmap(tp.pmap(f, axis_name="j"), axis_name="i")

    def loss(x):
        return torch.as_tensor(nested(x)).sum()

    x = torch.arange(4.0).reshape(2, 2) + 1
    runs = {
        "grad": lambda: torch.func.grad(loss)(x),
        "vjp": lambda: torch.func.vjp(lambda x: torch.as_tensor(nested(x)), x)[1](torch.ones(2, 2))[0],
        "jvp": lambda: torch.func.jvp(lambda x: torch.as_tensor(nested(x)), (x,), (torch.ones(2, 2),))[1],
        "vmap": lambda: torch.func.vmap(lambda x: torch.as_tensor(nested(x)))(torch.stack([x, 2 * x])),
    }
    _devices.set_current_default((devs[0],))  # the oracle: every instance on one device
    try:
        want = runs[transform]()
    finally:
        _devices.set_current_default(None)
    with mesh:
        got = runs[transform]()
    torch.testing.assert_close(torch.as_tensor(got), want)

    def inner_grad(v):  # per mesh row: the gradient of a nested mesh pmap, taken inside the row
        return torch.func.grad(lambda w: tp.pmap(f, axis_name="j")(w).sum())(v)

    with mesh:
        got = tp.pmap(inner_grad, axis_name="i")(x)
    torch.testing.assert_close(torch.as_tensor(got), torch.func.grad(loss)(x))


def test_nested_mesh_results_stay_sharded_in_two_dims(cpu_devices):
    devs = cpu_devices(6)
    mesh = tp.Mesh(np.array(devs).reshape(2, 3), ("data", "model"))
    x = torch.arange(12.0).reshape(2, 3, 2)
    f = tp.pmap(tp.pmap(lambda v: v * 2 + tp.psum(v, "model"), axis_name="model"), axis_name="data")
    expected = tp.pmap(tp.pmap(lambda v: v * 2 + tp.psum(v, "model"), axis_name="model"), axis_name="data",
                       devices=devs[:1])(x)
    with mesh:
        out = f(x)
        assert out.devices() == list(mesh.devices.flat)  # block (d, m) on mesh.devices[d, m]
        for d, row in enumerate(out.shards):
            assert [b.device for b in row.tensor.shards] == list(mesh.devices[d])
            assert all(b.tensor.shape == (1, 1, 2) for b in row.tensor.shards)
        assert torch.equal(out.gather(), expected) and torch.equal(out[1], expected[1])
        # fed back with the same placement, every block is used where it is
        blocks = sorted(b.tensor.data_ptr() for row in out.shards for b in row.tensor.shards)
        seen = []
        g = tp.pmap(tp.pmap(lambda v: (seen.append(v.data_ptr()), v + 1)[1], axis_name="model"), axis_name="data")
        assert torch.equal(g(out).gather(), expected + 1)
        assert sorted(seen) == blocks


def test_mesh_errors(cpu_devices):
    devs = cpu_devices(4)
    with pytest.raises(ValueError, match="2 dimensions .* 1 axis names"):
        tp.Mesh(np.array(devs).reshape(2, 2), ("data",))
    mesh = tp.Mesh(np.array(devs).reshape(2, 2), ("data", "model"))
    with mesh, pytest.raises(ValueError, match="size 3, which is not a multiple of the 2 devices"):
        tp.pmap(lambda v: v, axis_name="data")(torch.zeros(3))


@pytest.mark.parametrize("count", [1, 4])
def test_device_at_refuses_unknown_axes_and_asks_for_missing_ones(cpu_devices, count):
    devs = cpu_devices(count)
    mesh = tp.Mesh(np.array(devs).reshape(-1, 1) if count == 1 else np.array(devs).reshape(2, 2), ("data", "model"))
    last = mesh.shape["data"] - 1
    assert mesh.device_at({"data": last, "model": 0}) == mesh.devices[last, 0]
    assert mesh.device_at({"model": 0, "data": -1}) == mesh.devices[-1, 0]  # any order, negative from the end
    with pytest.raises(KeyError, match=r"'zzz' is not an axis of this mesh and no index was given for 'data'; give one "
                                       r"index per axis of the mesh, \{'data': \d, 'model': \d\}"):
        mesh.device_at({"zzz": 1, "model": 0})
    with pytest.raises(KeyError, match=r"no index was given for 'data', 'model'"):
        mesh.device_at({})
    with pytest.raises(IndexError, match=rf"index for axis 'data' must be an int in 0..{last} .* got {last + 1}"):
        mesh.device_at({"data": last + 1, "model": 0})
    with pytest.raises(IndexError, match=r"index for axis 'model' must be an int .* got True"):
        mesh.device_at({"data": 0, "model": True})


@pytest.mark.parametrize("count", [1, 4])
def test_a_ragged_device_list_is_described_as_ragged(cpu_devices, count):
    d = cpu_devices(count)
    with pytest.raises(
        ValueError,
        match=r"the device list is ragged: its rows have different lengths \[1, 2\]\. A mesh "
        r"is a full grid: give every row the same number of devices",
    ):
        tp.Mesh([[d[0]], [d[-1], d[0]]], ("data", "model"))
    with pytest.raises(ValueError, match=r"ragged: at nesting level 1, some entries are lists and others are devices"):
        tp.Mesh([[d[0]], d[-1]], ("data", "model"))
    with pytest.raises(ValueError, match=r"ragged: the lists at nesting level 2 have different lengths \[1, 1, 1, 2\]"):
        tp.Mesh([[[d[0]], [d[0]]], [[d[0]], [d[0], d[-1]]]], ("a", "b", "c"))
    # not ragged: too deep
    with pytest.raises(ValueError, match="the device grid has 2 dimensions .* but 1 axis names"):
        tp.Mesh([[d[0]], [d[-1]]], ("data",))


def test_debug_mode_runs_instances_one_at_a_time(cpu_devices, capsys):
    cpu_devices(2)
    seen = []

    def f(v):
        seen.append(float(v))  # .item() works: no vmap here
        print("instance", int(tp.axis_index("i")))
        return tp.psum(v, "i") * v

    x = torch.arange(4.0)
    with tp.disable_vectorization():
        debug = tp.pmap(f, axis_name="i")(x)
        with pytest.raises(ZeroDivisionError) as info:
            tp.pmap(lambda v: 1 / int(tp.axis_index("i")), axis_name="i")(x)
    assert sorted(seen) == [0.0, 1.0, 2.0, 3.0]
    assert sorted(capsys.readouterr().out.split("\n")[:-1]) == [f"instance {i}" for i in range(4)]
    assert torch.equal(torch.as_tensor(debug), 6 * x)
    assert any("instance 0" in n for n in info.value.__notes__)


def test_forward_mode_ad_across_devices(cpu_devices):
    cpu_devices(4)
    x = torch.arange(8.0)
    programs = {
        "jvp": lambda v: torch.func.jvp(torch.sin, (v,), (torch.ones_like(v),))[1],
        "jvp through psum": lambda v: torch.func.jvp(
            lambda u: tp.psum(torch.sin(u), "i") * u, (v,), (torch.ones_like(v),)
        )[1],
        "jacfwd through all_gather": lambda v: torch.func.jacfwd(lambda u: tp.all_gather(u * u, "i"))(v),
    }
    for name, fun in programs.items():
        one = tp.pmap(fun, "i", devices=tp.devices()[:1])(x)
        for _ in range(5):  # the device threads share PyTorch's one forward-AD level: never a race
            assert torch.equal(torch.as_tensor(tp.pmap(fun, "i")(x)), one), name


# --------------------------------------------------------------------------- pytrees: one exchange per collective


def _mixed_tree(seed: int = 0) -> dict:
    """Per-instance leaves (8 instances) of several dtypes and shapes, scalars included."""
    g = torch.Generator().manual_seed(seed)
    return {
        "f32": torch.randn(8, 3, 2, generator=g),
        "f64": torch.randn(8, 5, generator=g, dtype=torch.float64),
        "scalar": torch.randn(8, generator=g),  # each instance holds a 0-d tensor
        "c64": torch.randn(8, 3, generator=g, dtype=torch.complex64),
        "i64": torch.randint(-50, 50, (8, 2), generator=g),
    }


def _floats(t: dict) -> dict:
    return {k: v for k, v in t.items() if v.is_floating_point() or v.is_complex()}


def _real_sum(out: dict) -> torch.Tensor:
    """A real scalar loss over the float and complex leaves, summed in float64."""
    return sum(torch.view_as_real(v).double().sum() if v.is_complex() else v.double().sum() for v in out.values())


def _reduction(op: str):
    """The pytree reduction ``op``, with a Python number among the leaves."""
    return lambda t: getattr(tp, op)({**t, "number": 1.5}, "i")


@pytest.mark.parametrize("op", ["psum", "pmean", "pmax", "pmin"])
@pytest.mark.parametrize("n_devices", [2, 4])
def test_pytree_reduction_bitwise_equal_to_one_device(cpu_devices, op, n_devices):
    devs = cpu_devices(n_devices)
    tree = _mixed_tree()
    if op in ("pmax", "pmin"):  # no order on complex numbers
        tree.pop("c64")
    f = _reduction(op)
    many, one = tp.pmap(f, axis_name="i")(tree), tp.pmap(f, axis_name="i", devices=devs[:1])(tree)
    assert many.keys() == one.keys() == {*tree, "number"}
    for k in one:
        assert many[k].devices() == devs and torch.equal(torch.as_tensor(many[k]), one[k]), k
        assert many[k].dtype == one[k].dtype


@pytest.mark.parametrize("op", ["psum", "pmean"])
@pytest.mark.parametrize("n_devices", [2, 4])
def test_pytree_reduction_gradients_inside_bitwise_equal_to_one_device(cpu_devices, op, n_devices):
    devs = cpu_devices(n_devices)
    tree = _mixed_tree(1)
    reduce = _reduction(op)

    def loss(floats: dict, ints: torch.Tensor) -> torch.Tensor:  # the int and number leaves get no gradient
        out = _floats(reduce({**floats, "i64": ints}))
        return _real_sum({k: v * (j + 1.0) for j, (k, v) in enumerate(out.items())})  # a different cotangent each

    f = lambda t: grad(loss)(_floats(t), t["i64"])  # noqa: E731
    many, one = tp.pmap(f, axis_name="i")(tree), tp.pmap(f, axis_name="i", devices=devs[:1])(tree)
    for k in one:
        assert torch.equal(torch.as_tensor(many[k]), one[k]), k


def _backward(f, tree: dict, weights: dict, devices) -> dict:
    """``.backward()`` of a weighted sum of ``pmap(f)``'s outputs: the gradient of each float leaf."""
    leaves = {k: v.clone().requires_grad_() for k, v in _floats(tree).items()}
    out = tp.pmap(f, axis_name="i", devices=devices)({**tree, **leaves})
    gathered = {k: o.gather() if isinstance(o, tp.ShardedTensor) else o for k, o in out.items()}
    _real_sum({k: gathered[k] * w for k, w in weights.items()}).backward()
    return {k: v.grad for k, v in leaves.items()}


@pytest.mark.parametrize("op", ["psum", "pmean"])
@pytest.mark.parametrize("n_devices", [2, 4])
def test_pytree_reduction_backward_outside(cpu_devices, op, n_devices):
    devs = cpu_devices(n_devices)
    tree = _mixed_tree(2)
    g = torch.Generator().manual_seed(3)
    random_weights = {k: torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in _floats(tree).items()}
    integer_weights = {k: torch.randint(-3, 4, v.shape, generator=g).to(v.dtype) for k, v in _floats(tree).items()}
    bundled = _reduction(op)
    one_by_one = lambda t: {k: getattr(tp, op)(v, "i") for k, v in {**t, "number": 1.5}.items()}  # noqa: E731
    # Bundling moves bytes only: the gradients are bitwise those of one collective per leaf.
    many = _backward(bundled, tree, random_weights, devs)
    for k, want in _backward(one_by_one, tree, random_weights, devs).items():
        assert torch.equal(many[k], want), k
    # Across devices .backward() adds the cotangents per device, then over devices (in another
    # order than one device does); with sums that round nowhere the gradients are bitwise equal.
    many = _backward(bundled, tree, integer_weights, devs)
    for k, want in _backward(bundled, tree, integer_weights, devs[:1]).items():
        assert torch.equal(many[k], want), k


def test_pytree_leaves_batched_at_different_levels(cpu_devices):
    devs = cpu_devices(2)
    x = torch.randn(4, 3, 2, generator=torch.Generator().manual_seed(4))

    def f(v):  # "u" is batched over the inner axis "k", "v" is not: each keeps its own lead dim
        inner = lambda u: tp.psum({"u": u, "v": v, "n": 3}, "i")  # noqa: E731
        return tp.vmap(inner, axis_name="k")(v)

    many, one = tp.pmap(f, axis_name="i")(x), tp.pmap(f, axis_name="i", devices=devs[:1])(x)
    for k in one:
        assert torch.equal(torch.as_tensor(many[k]), one[k]), k


def _record_meetings(monkeypatch) -> list:
    """Records (meeting key, number of tensors) for every rendezvous a device thread joins."""
    from torchpmap._engines.thread_exchange import Rendezvous

    meetings, meet = [], Rendezvous.meet

    def recording_meet(self, group, seq, index, count, what, value, combine):
        meetings.append(((group, seq), len(value)))
        return meet(self, group, seq, index, count, what, value, combine)

    monkeypatch.setattr(Rendezvous, "meet", recording_meet)
    return meetings


def test_pmean_of_a_pytree_is_one_exchange_per_axis(cpu_devices, monkeypatch):
    devs = cpu_devices(4)
    meetings = _record_meetings(monkeypatch)
    tree = {f"p{k}": torch.randn(4, k + 1, 2) for k in range(6)}
    # grad of a pmean over 2 devices: each device meets once forward and once for the transpose
    tp.pmap(grad(lambda t: _real_sum(tp.pmean(t, "i"))), axis_name="i", devices=devs[:2])(tree)
    assert [n for _, n in meetings] == [6] * 4 and len({key for key, _ in meetings}) == 2
    # over two mesh axes (2 x 2 devices, one instance each): each device meets once per axis
    meetings.clear()
    with tp.Mesh(np.array(devs).reshape(2, 2), ("i", "j")):
        nested = tp.pmap(tp.pmap(lambda t: tp.pmean(t, ("i", "j")), axis_name="j"), axis_name="i")
        nested({k: v.reshape(2, 2, *v.shape[1:]) for k, v in tree.items()})
    assert [n for _, n in meetings] == [6] * 8 and len({key for key, _ in meetings}) == 4


def test_idle_device_workers_exit(cpu_devices, monkeypatch):
    import threading
    import time

    cpu_devices(4)
    monkeypatch.setattr(tp.config, "worker_idle_timeout", 0.2)
    workers = lambda: {t for t in threading.enumerate() if t.name == "torchpmap-device"}  # noqa: E731
    before = workers()  # idle since earlier tests, waiting out their old timeout (or handed work below)
    f = tp.pmap(lambda v: tp.psum(v, "i"), "i")
    callers = [threading.Thread(target=lambda: f(torch.arange(8.0))) for _ in range(4)]
    for c in callers:
        c.start()
    for c in callers:
        c.join()
    assert len(workers()) >= 4
    deadline = time.monotonic() + 10
    while not workers() <= before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert workers() <= before  # every worker the burst started has exited
    assert torch.equal(torch.as_tensor(f(torch.arange(8.0))), torch.full((8,), 28.0))  # the pool grows again


def test_device_slices_that_disagree_on_shapes_or_dtypes(cpu_devices):
    cpu_devices(2)

    def by_device(v):  # a program whose shapes or dtypes depend on the device: refused, never promoted
        first = _devices.current_default()[0].id == 0
        return tp.psum(v if first else v.double(), "i")

    with pytest.raises(
        RuntimeError,
        match=r"disagree on the values of psum over axis 'i': slice 0 passes float32\[2, 2\], slice 1 passes "
        r"float64\[2, 2\]",
    ):
        tp.pmap(by_device, "i")(torch.ones(4, 2))
    with pytest.raises(
        ValueError,
        match=r"output 0 differs between devices: cpu:0 returns torch.float32 with per-instance shape \(2,\), cpu:1 "
        r"returns torch.float32 with shape \(3,\)",
    ):
        tp.pmap(lambda v: v if _devices.current_default()[0].id == 0 else torch.cat([v, v[:1]]))(torch.ones(2, 2))


@pytest.mark.parametrize("n_devices", [1, 4])
@pytest.mark.filterwarnings("ignore:torch.func.vmap cannot run:torchpmap.VectorizationFallbackWarning")  # _neg_view
def test_lazily_conjugated_results_keep_their_sign_on_every_placement(cpu_devices, n_devices):
    """``v.conj()`` is a view with a conjugate bit (``z.conj().imag`` one with a negative
    bit): a result on several devices computed with the bit dropped (sums, copies,
    comparisons took the unconjugated values) while printing right."""
    cpu_devices(n_devices)
    w = torch.tensor([1 + 1j, 2 + 2j, 3 + 3j, 4 + 4j])
    for f in (lambda v: v.conj(), lambda v: v.conj().reshape(1), lambda v: v.conj().imag):
        got = tp.pmap(f)(w)
        want = torch.stack([f(v) for v in w])
        assert torch.equal(got.sum(), want.sum()) and torch.equal(got.clone(), want) and bool((got == want).all())
        assert torch.equal(tp.pmap(lambda v: v * 1)(got), want)  # fed into another map
    x = torch.tensor([[1 + 1j, 2 + 2j]] * 4)
    got = tp.pmap(lambda v, w: v + w.conj(), in_axes=(0, None))(x, x[0])
    assert torch.equal(got.clone(), x + x[0].conj())


COLLECTIVES_OF_ONE_ARGUMENT = {
    "all_gather": lambda v: tp.all_gather(v, "i"),
    "all_gather_tiled": lambda v: tp.all_gather(v, "i", tiled=True),
    "all_to_all": lambda v: tp.all_to_all(v, "i", 0, 0),
    "pswapaxes": lambda v: tp.pswapaxes(v, "i", 0),
    "pvary": lambda v: tp.pvary(v, "i"),
    "psum": lambda v: tp.psum(v, "i"),
    "ppermute": lambda v: tp.ppermute(v, "i", [(k, (k + 1) % 4) for k in range(4)]),
}


@pytest.mark.parametrize("n_devices", [1, 4])
@pytest.mark.parametrize("name", sorted(COLLECTIVES_OF_ONE_ARGUMENT))
def test_a_collectives_result_is_its_own_memory_on_every_placement(cpu_devices, name, n_devices):
    """As across devices (where the values travel): writing into a collective's result
    changes neither the argument nor the caller's tensor, and writing into the argument
    after the collective does not change its result. On one device all_gather,
    all_to_all, pswapaxes and pvary returned views of the argument."""
    cpu_devices(n_devices)
    op = COLLECTIVES_OF_ONE_ARGUMENT[name]
    original = torch.arange(16.0).reshape(4, 4)
    want = tp.pmap(op, axis_name="i")(original.clone())

    def write_result(v):
        r = op(v)
        r.mul_(0)
        return v * 1

    x = original.clone()
    assert torch.equal(tp.pmap(write_result, axis_name="i")(x), original) and torch.equal(x, original)

    def write_argument(v):
        r = op(v)
        v.add_(100)
        return r

    assert torch.equal(torch.as_tensor(tp.pmap(write_argument, axis_name="i")(original.clone())), torch.as_tensor(want))


_RAISES_THREE_DEEP = """
import torch, torchpmap as tp

def f(a):
    raise RuntimeError("boom")

mesh = tp.make_mesh((2, 2, 2), ("x", "y", "z"))
for debug in (False, True):
    try:
        if debug:
            with tp.disable_vectorization():
                tp.shard_map(f, mesh=mesh, in_specs=tp.P("x"), out_specs=tp.P())(torch.randn(8, 3))
        else:
            tp.shard_map(f, mesh=mesh, in_specs=tp.P("x"), out_specs=tp.P())(torch.randn(8, 3))
    except RuntimeError as e:
        print("raised", debug, e)
try:
    tp.pmap(tp.pmap(tp.pmap(f, axis_name="k"), axis_name="j"), axis_name="i")(torch.randn(2, 2, 2, 3))
except RuntimeError as e:
    print("raised nested", e)
"""


@pytest.mark.parametrize("n_devices", [1, 8])
def test_an_error_three_maps_deep_reaches_the_caller(n_devices):
    """An error raised in a function mapped three levels deep (a 3-D mesh, nested pmaps),
    vectorized and one instance at a time, reaches the caller. It hung: the enclosing
    instance threads' second run (naming the instance) nested a third inside them, and
    two device threads' random-stream modes in one thread took one lock twice."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "TORCHPMAP_NUM_CPU_DEVICES": str(n_devices)}
    done = subprocess.run([sys.executable, "-c", _RAISES_THREE_DEEP], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:3] == ["raised False boom", "raised True boom", "raised nested boom"], done.stdout


def test_writing_into_a_returned_broadcast_argument_leaves_the_callers_tensor_alone(placement):
    """An instance that returns its ``in_axes=None`` argument: on 4 devices (one instance
    each, run directly) the result's shards were the caller's tensor itself, so writing
    into the result changed it; on one device vmap's result is an expanded view, which
    refuses the write, and a loop stacks copies. The caller's tensor now never changes."""
    w = torch.ones(2)
    out = tp.pmap(lambda x, w: (x * 1, w), in_axes=(0, None))(torch.zeros(4), w)[1]
    try:
        with torch.no_grad():
            out.mul_(0)
    except RuntimeError as refused:  # one device: torch refuses a write to an expanded view
        assert "single memory location" in str(refused)
    torch.testing.assert_close(w, torch.ones(2))


def test_mesh_axes_run_one_at_a_time_in_debug_mode_and_after_a_fallback(four_devices):
    """On a 2 x 2 Mesh, debug mode and a function vmap cannot run (``.item()`` of values
    that differ, a fallback the function remembers from a call without the mesh) raised
    ZeroDivisionError: the one-at-a-time engine spread the instances over all the mesh's
    devices. Each instance now runs on its mesh position's device, one at a time, with
    the numbers of the map without a mesh; more instances than devices along an axis is
    refused with a message (it is not run one at a time on a mesh yet)."""

    def f(x):
        return tp.psum(x * x.sum().item(), "j")

    def nested(f):
        return tp.pmap(tp.pmap(f, axis_name="j"), axis_name="i")

    x = torch.arange(4.0).reshape(2, 2)
    mesh = tp.Mesh(np.array(four_devices).reshape(2, 2), ("i", "j"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tp.VectorizationFallbackWarning)
        want = torch.as_tensor(nested(f)(x)).cpu()
        with mesh:
            got = torch.as_tensor(nested(f)(x)).cpu()
            with tp.disable_vectorization():
                debug = torch.as_tensor(nested(lambda x: tp.psum(x * 2, "j"))(x)).cpu()
                with pytest.raises(NotImplementedError, match="one instance per device"):
                    nested(lambda x: x * 2)(torch.zeros(2, 4))
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(debug, torch.as_tensor(nested(lambda x: tp.psum(x * 2, "j"))(x)).cpu())


def _grad_enabled_inside(devices, n: int) -> tuple:
    """A function that enables grad itself, called under the caller's no_grad."""

    def f(v, w):
        with torch.enable_grad():
            return tp.psum(v * w, "i") * v

    x, w = torch.arange(float(n)).requires_grad_(), torch.tensor(2.0, requires_grad=True)
    with torch.no_grad():
        r = tp.pmap(f, axis_name="i", in_axes=(0, None), devices=devices)(x, w)
        plain = tp.pmap(lambda v: v * w, devices=devices)(x)  # without: nothing recorded
    torch.as_tensor(r).sum().backward()
    return r.requires_grad, x.grad.tolist(), w.grad.item(), plain.requires_grad


@pytest.mark.parametrize("n", [4, 8])
def test_a_function_that_enables_grad_under_no_grad_differentiates_as_on_one_device(four_devices, n):
    """A device holding one instance took its slice, and stacked its result, under the
    caller's no_grad: the result required grad but its graph stopped there (x.grad and
    w.grad None, no error), where one device's vmap differentiates into the arguments.
    Debug mode on one device stacked the instances' results under no_grad (backward then
    raised "does not require grad")."""
    want = _grad_enabled_inside(four_devices[:1], n)
    total = n * (n - 1) / 2  # the loss is w * total**2: x.grad 2 w total each, w.grad total**2
    assert want == (True, [4.0 * total] * n, total * total, False)
    assert _grad_enabled_inside(four_devices, n) == want
    with tp.disable_vectorization():
        assert _grad_enabled_inside(four_devices[:1], n) == want
        assert _grad_enabled_inside(four_devices, n) == want
