"""Programs run by tests/test_distributed.py, in several processes and in one.

``python tests/_distributed_programs.py SCENARIO OUTDIR`` runs in every process of a
multi-process launch (the environment comes from torchpmap.bench.launch, like torchrun's),
and saves what the process computed to ``OUTDIR/rank<r>.pt``. The test runs the same
programs on the whole global data in one process (:func:`reference`) and compares.
"""
from __future__ import annotations

import datetime
import os
import sys
import time
import traceback

import torch
import torch.utils._pytree as pytree
from torch.func import grad

import torchpmap as tp

G = 4  # the global size of the mapped axis in the collectives scenario


def global_data() -> dict:
    g = torch.Generator().manual_seed(1234)
    return {
        "x": torch.randn(G, 3, generator=g),
        "x_sq": torch.randn(G, G, 2, generator=g),  # a dim of size G for all_to_all / psum_scatter
        "x_tiled": torch.randn(G, 2 * G, 2, generator=g),
        "x_nested": torch.randn(G, 2, 3, generator=g),
        "w": torch.randn(G, 3, generator=g),  # cotangent weights for .backward()
        # float16 whose pairs overflow where the total does not: one process sums in float32
        "x_half": torch.tensor([[6e4, 0.5], [6e4, 1e-4], [-6e4, 3.0], [-6e4, 1e-4]], dtype=torch.float16),
        "mlp_x": torch.randn(G, 8, 5, generator=g),
        "mlp_y": torch.randn(G, 8, 1, generator=g),
        "tree": {  # leaves of several dtypes and shapes for the pytree collectives
            "f32": torch.randn(G, 3, 2, generator=g),
            "f64": torch.randn(G, 5, generator=g, dtype=torch.float64),
            "scalar": torch.randn(G, generator=g),
            "c64": torch.randn(G, 3, generator=g, dtype=torch.complex64),
            "i64": torch.randint(-50, 50, (G, 2), generator=g),
        },
    }


def local_data(rank: int, nproc: int) -> dict:
    """This process' part of :func:`global_data`."""
    return pytree.tree_map(lambda t: local(t, rank, nproc), global_data())


def local(t: torch.Tensor, rank: int, nproc: int) -> torch.Tensor:
    n = t.shape[0] // nproc
    return t[rank * n : (rank + 1) * n]


def _ring(n):
    return [(j, (j + 1) % n) for j in range(n)]


#: How the compiled scenario compiles: AOTAutograd without code generation (the trace and
#: the exchange ops are what is under test; the bench compiles with inductor).
JIT = {"backend": "aot_eager"}


def collective_programs(d: dict[str, torch.Tensor], jit: bool = False):
    """name -> (function of the (local or global) data dict, in_key); outputs are mapped along dim 0."""
    pm = lambda f, **kw: tp.pmap(f, axis_name="i", jit=JIT if jit else False, **kw)  # noqa: E731
    return {
        "psum": lambda d: pm(lambda v: tp.psum(v, "i"))(d["x"]),
        "pmean": lambda d: pm(lambda v: tp.pmean(v, "i"))(d["x"]),
        "pmax": lambda d: pm(lambda v: tp.pmax(v, "i"))(d["x"]),
        "pmin_int": lambda d: pm(lambda v: tp.pmin((v * 10).long(), "i"))(d["x"]),
        "psum_bool": lambda d: pm(lambda v: tp.psum(v > 0, "i"))(d["x"]),
        "psum_groups": lambda d: pm(lambda v: tp.psum(v, "i", axis_index_groups=[[0, 2], [1, 3]]))(d["x"]),
        "all_gather": lambda d: pm(lambda v: tp.all_gather(v, "i"))(d["x"]),
        "all_gather_tiled_axis1": lambda d: pm(lambda v: tp.all_gather(v, "i", axis=1, tiled=True))(d["x_sq"]),
        "ppermute": lambda d: pm(lambda v: tp.ppermute(v, "i", _ring(G)))(d["x"]),
        "pshuffle": lambda d: pm(lambda v: tp.pshuffle(v, "i", [2, 0, 3, 1]))(d["x"]),
        "all_to_all": lambda d: pm(lambda v: tp.all_to_all(v, "i", 0, 0))(d["x_sq"]),
        "all_to_all_tiled": lambda d: pm(lambda v: tp.all_to_all(v, "i", 0, 1, tiled=True))(d["x_tiled"]),
        "psum_scatter": lambda d: pm(lambda v: tp.psum_scatter(v, "i"))(d["x_sq"]),
        "psum_scatter_tiled": lambda d: pm(lambda v: tp.psum_scatter(v, "i", tiled=True))(d["x_tiled"]),
        "psum_scatter_groups": lambda d: pm(
            lambda v: tp.psum_scatter(v[:2], "i", scatter_dimension=0, axis_index_groups=[[0, 3], [2, 1]])
        )(d["x_sq"]),
        "all_to_all_groups_tiled": lambda d: pm(
            lambda v: tp.all_to_all(v, "i", 0, 1, axis_index_groups=[[1, 2], [0, 3]], tiled=True)
        )(d["x_tiled"]),
        "axis_index": lambda d: pm(lambda v: tp.axis_index("i"))(d["x"]),
        "half_sums": lambda d: pm(
            lambda v: (
                tp.psum(v, "i"),
                tp.pmean(v, "i"),
                tp.psum(v, "i", axis_index_groups=[[0, 1], [2, 3]]),
                tp.psum_scatter(v.expand(G, 2), "i"),
            )
        )(d["x_half"]),
        "nested_local": lambda d: pm(
            tp.pmap(
                lambda v: (tp.psum(v, "j"), tp.psum(v, "i"), tp.psum(v, ("i", "j")), tp.axis_index(("i", "j"))),
                axis_name="j",
            )
        )(d["x_nested"]),
        "vmap_inside": lambda d: pm(lambda v: tp.vmap(lambda u: tp.psum(u, "i") * tp.psum(u, "k"), axis_name="k")(v))(
            d["x_nested"]
        ),
        "grad_inside": lambda d: pm(
            grad(
                lambda v: (
                    (tp.psum(v**2, "i") * v).sum()
                    + (tp.all_gather(v, "i") * tp.axis_index("i")).sum()
                    + (tp.ppermute(v, "i", _ring(G)) ** 3).sum()
                )
            )
        )(d["x"]),
        "vmap_around": lambda d: torch.func.vmap(pm(lambda v: tp.psum(v, "i") * v), in_dims=1, out_dims=1)(
            torch.stack([d["x"], 2 * d["x"]], dim=1)
        ),
        "pytree_psum": lambda d: pm(lambda t: tp.psum({**t, "number": 1.5}, "i"))(d["tree"]),
        "pytree_pmean": lambda d: pm(lambda t: tp.pmean({**t, "number": 1.5}, "i"))(d["tree"]),
        "pytree_pmax": lambda d: pm(lambda t: tp.pmax({k: v for k, v in t.items() if k != "c64"}, "i"))(d["tree"]),
        "pytree_grad_inside": lambda d: pm(lambda t: grad(_tree_loss)(_floats(t), t["i64"]))(d["tree"]),
        "grad_inside_scatter_a2a": lambda d: pm(
            grad(
                lambda v: (
                    (tp.psum_scatter(v, "i") ** 2).sum()
                    + (tp.all_to_all(v, "i", 0, 0) * v * (tp.axis_index("i") + 1)).sum()
                )
            )
        )(d["x_sq"]),
    }


def _floats(t: dict) -> dict:
    return {k: v for k, v in t.items() if v.is_floating_point() or v.is_complex()}


def _as_real(v: torch.Tensor) -> torch.Tensor:
    return (torch.view_as_real(v) if v.is_complex() else v).double()


def _real_sum(out: dict, weights: dict | None = None) -> torch.Tensor:
    """A real scalar from the float and complex leaves, each weighted (by its position if no weights)."""
    total = torch.zeros((), dtype=torch.float64)
    for j, (k, v) in enumerate(out.items()):
        total = total + (_as_real(v) * (_as_real(weights[k]) if weights else j + 1.0)).sum()
    return total


def _tree_loss(floats: dict, ints: torch.Tensor) -> torch.Tensor:
    """pmean of a mixed pytree (ints and a number get no gradient), then a weighted sum."""
    return _real_sum(_floats(tp.pmean({**floats, "i64": ints, "number": 2.5}, "i")))


def pytree_backward(d: dict) -> dict:
    """``.backward()`` after a pmean of a mixed pytree, with integer cotangents (sums that never
    round: bitwise the same in every summation order); the float leaves' gradients."""
    leaves = {k: v.clone().requires_grad_() for k, v in _floats(d["tree"]).items()}
    out = tp.pmap(lambda t: tp.pmean({**t, "number": 2.5}, "i"), axis_name="i")({**d["tree"], **leaves})
    # the same small integers for every instance (the processes' losses add up to the one-process loss)
    weights = {k: (torch.arange(v[0].numel()) % 5 - 2).reshape(v.shape[1:]).to(v.dtype) for k, v in leaves.items()}
    _real_sum({k: out[k] for k in leaves}, weights).backward()
    return {k: v.grad for k, v in leaves.items()}


def count_transfers(d: dict) -> dict:
    """How many all-gathers, all-to-alls and all-reduces a pmean of a 6-leaf pytree and its
    backward make, once the steps repeat."""

    def step():
        tree = {f"p{k}": d["x"].clone().requires_grad_() * (k + 1) for k in range(6)}
        out = tp.pmap(lambda t: tp.pmean(t, "i"), axis_name="i")(tree)
        sum(o.sum() for o in out.values()).backward()

    return _counted_transfers(step)


def count_scatter_transfers(d: dict) -> dict:
    """The transfers of a psum_scatter over the processes' instances (several per process:
    through vmap): a reduce-scatter, each process sending every other its share of its
    instances' sum, once the steps repeat."""
    return _counted_transfers(lambda: tp.pmap(lambda v: tp.psum_scatter(v, "i"), axis_name="i")(d["x_sq"]))


def _counted_transfers(step) -> dict:
    """The all-gathers, all-to-alls and all-reduces of the third ``step()`` (the first
    teaches the processes what follows what: see process_agreement)."""
    from torchpmap._engines import process_exchange as engine

    counts = {"all_gather": 0, "all_to_all": 0, "all_gather_bytes": 0, "all_reduce": 0}
    gather, all_to_all, all_reduce = (
        engine._all_gather_flat,
        torch.distributed.all_to_all_single,
        torch.distributed.all_reduce,
    )

    def counted(name, fn):
        def call(*args, **kwargs):
            counts[name] += 1
            if name == "all_gather":
                counts["all_gather_bytes"] += args[1].numel() * args[1].element_size()  # what this process sends
            return fn(*args, **kwargs)
        return call

    step()
    step()
    engine._all_gather_flat = counted("all_gather", gather)
    torch.distributed.all_to_all_single = counted("all_to_all", all_to_all)
    torch.distributed.all_reduce = counted("all_reduce", all_reduce)
    try:
        step()
    finally:
        engine._all_gather_flat, torch.distributed.all_to_all_single = gather, all_to_all
        torch.distributed.all_reduce = all_reduce
    return counts


def _backward_program(v: torch.Tensor) -> torch.Tensor:
    s = tp.psum(v * v, "i")
    g = tp.all_gather(v, "i").sum(0)
    p = tp.ppermute(v, "i", _ring(G)) * (tp.axis_index("i") + 1)
    return s + g * v + p


def backward_outside(d: dict[str, torch.Tensor], jit: bool = False) -> torch.Tensor:
    """``.backward()`` on the (local) loss after the pmap: x.grad (mapped along dim 0)."""
    x = d["x"].clone().requires_grad_()
    out = tp.pmap(_backward_program, axis_name="i", jit=JIT if jit else False)(x)
    (out * d["w"]).sum().backward()
    return x.grad


def grad_around(d: dict[str, torch.Tensor]) -> torch.Tensor:
    """torch.func.grad around the pmap, of the (local) sum: the local part of the global gradient."""
    f = tp.pmap(_backward_program, axis_name="i")
    return torch.func.grad(lambda x: (f(x) * d["w"]).sum())(d["x"])


def train_by_hand(d: dict[str, torch.Tensor], steps: int = 3, jit: bool = False) -> dict[str, torch.Tensor]:
    """A data-parallel MLP trained with pmap(grad) + pmean over "batch"; returns the parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def loss_fn(params, x, y):
        return ((torch.func.functional_call(model, params, (x,)) - y) ** 2).mean()

    def instance(params, x, y):
        grads, loss = torch.func.grad_and_value(loss_fn)(params, x, y)
        return tp.pmean(grads, "batch"), tp.pmean(loss, "batch")

    p_step = tp.pmap(instance, axis_name="batch", in_axes=(None, 0, 0), out_axes=None, jit=JIT if jit else False)
    losses = []
    for _ in range(steps):
        params = {k: p.detach() for k, p in model.named_parameters()}
        grads, loss = p_step(params, d["mlp_x"], d["mlp_y"])
        for k, p in model.named_parameters():
            p.grad = grads[k]
        opt.step()
        losses.append(loss)
    return {**{k: p.detach().clone() for k, p in model.named_parameters()}, "losses": torch.stack(losses)}


def train_with_helper(d: dict[str, torch.Tensor], steps: int = 3, jit: bool = False) -> dict[str, torch.Tensor]:
    """The same with torchpmap.training.data_parallel_step and Adam."""
    from torchpmap.training import data_parallel_step

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    step = data_parallel_step(model, torch.nn.functional.mse_loss, opt, jit=JIT if jit else False)
    losses = [step((d["mlp_x"], d["mlp_y"])) for _ in range(steps)]
    return {**{k: p.detach().clone() for k, p in model.named_parameters()}, "losses": torch.stack(losses)}


def per_instance_dropout(d: dict) -> torch.Tensor:
    """randomness="per_instance": every process draws its instances' own numbers, which are
    those of one process (every process seeds alike, as for parameter initialization)."""
    torch.manual_seed(11)
    f = lambda v: torch.nn.functional.dropout(v, 0.5) + torch.rand(())  # noqa: E731
    return tp.pmap(f, axis_name="i", randomness="per_instance")(d["x"])


def under_autocast(d: dict) -> tuple:
    """Under CPU autocast: a linear layer in bfloat16 and a log-softmax in float32, as
    autocast casts them outside a map (its casts are corrected under vmap on every engine,
    this process' slice of a distributed axis included)."""
    w = torch.linspace(-1, 1, 6).reshape(2, 3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        f = lambda v: (torch.nn.functional.linear(v, w, w[0, :2]), torch.log_softmax(v, -1))  # noqa: E731
        return tp.pmap(f, axis_name="i")(d["x"])


def compared_programs(d: dict) -> dict[str, object]:
    """Every program whose results are compared between one process and several, on
    ``d`` (the global data in one process, a rank's share in several)."""
    out = {name: fn(d) for name, fn in collective_programs(d).items()}
    out["backward_outside"] = backward_outside(d)
    out["grad_around"] = grad_around(d)
    out["pytree_backward"] = pytree_backward(d)
    out["replicated"] = tp.pmap(lambda v: tp.psum(v, "i"), axis_name="i", out_axes=None)(d["x"])
    out["train_by_hand"] = train_by_hand(d)
    out["train_with_helper"] = train_with_helper(d)
    out["per_instance_dropout"] = per_instance_dropout(d)
    out["under_autocast"] = under_autocast(d)
    return out


#: The programs of compared_programs that compile as a whole (the others differentiate
#: or map around the pmap, which then runs eagerly inside that transform).
COMPILED = set(collective_programs({})) - {"vmap_around"} | {"backward_outside", "train_by_hand", "train_with_helper"}


def compiled_programs(d: dict) -> dict[str, object]:
    """The programs of :data:`COMPILED` with ``jit=True``: on one process' share, they
    must compile (a fallback to eager is an error here) and match the eager reference."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", tp.JitFallbackWarning)
        out = {name: fn(d) for name, fn in collective_programs(d, jit=True).items() if name in COMPILED}
        out["backward_outside"] = backward_outside(d, jit=True)
        out["train_by_hand"] = train_by_hand(d, jit=True)
        out["train_with_helper"] = train_with_helper(d, jit=True)
    return out


def reference() -> dict[str, object]:
    """Every program on the global data, in one process."""
    return compared_programs(global_data())


# --------------------------------------------------------------------------- mesh

MESH_SHAPE = (2, 2)
MESH_NAMES = ("data", "model")
MESH_LOCAL = (2, 1)  # instances per process along data, model


def mesh_global() -> torch.Tensor:
    g = torch.Generator().manual_seed(99)
    return torch.randn(MESH_SHAPE[0] * MESH_LOCAL[0], MESH_SHAPE[1] * MESH_LOCAL[1], 3, generator=g)


def mesh_program(v: torch.Tensor):
    return {
        "psum_model": tp.psum(v, "model"),
        "psum_data": tp.psum(v, "data"),
        "psum_both": tp.psum(v, ("data", "model")),
        "index": tp.axis_index(("data", "model")),
        "index_rev": tp.axis_index(("model", "data")),
        "gather_model": tp.all_gather(v, "model"),
        "shift_data": tp.ppermute(v, "data", _ring(MESH_SHAPE[0] * MESH_LOCAL[0])),
        # pytrees with leaves batched at different levels (a number, an index of the other axis)
        "tree_data": tp.psum({"v": v, "n": 2.0, "i": tp.axis_index("model")}, "data"),
        "tree_model": tp.pmean({"v": v, "n": 2.0, "i": tp.axis_index("data")}, "model"),
        "grad_data": grad(lambda u: (tp.pmean(u, "data") * tp.psum(u, "model")).sum())(v),
    }


def mesh_reference() -> dict:
    f = tp.pmap(tp.pmap(mesh_program, axis_name="model"), axis_name="data")
    return f(mesh_global())


# --------------------------------------------------------------------------- scenarios


def scenario_collectives(rank: int, nproc: int) -> dict:
    import torchpmap.distributed as tpd

    d = local_data(rank, nproc)
    out: dict[str, object] = {
        "process_index": tp.process_index(),
        "process_count": tp.process_count(),
        "devices": [(x.platform, x.id, x.process_index) for x in tp.devices()],
        "local_devices": [(x.platform, x.id, x.process_index) for x in tp.local_devices()],
        "is_initialized": tpd.is_initialized(),
    }
    tpd.initialize()  # idempotent
    out.update(compared_programs(d))
    out["transfers"] = count_transfers(d)
    out["scatter_transfers"] = count_scatter_transfers(d)
    out["compiled"] = compiled_programs(d)
    # Unequal local sizes: every process raises the same clear error (and stays usable),
    # whether the check rides on a reduction, precedes an all_gather, ends a call without
    # collectives, or runs in a compiled program.
    unequal = torch.ones(rank + 1)
    out["size_errors"] = {
        "psum": _error_of(lambda: tp.pmap(lambda v: tp.psum(v, "i"), axis_name="i")(unequal)),
        # a psum of bools sends int64 sums, also from a process with one instance
        "psum_bool": _error_of(lambda: tp.pmap(lambda v: tp.psum(v > 0, "i"), axis_name="i")(torch.ones(rank + 1, 3))),
        "all_gather": _error_of(lambda: tp.pmap(lambda v: tp.all_gather(v, "i"), axis_name="i")(unequal)),
        "none": _error_of(lambda: tp.pmap(lambda v: v * 2, axis_name="i")(unequal)),
        "jit": _error_of(lambda: tp.pmap(lambda v: tp.pmean(v, "i"), axis_name="i", jit=JIT)(unequal)),
    }
    out["after_size_error"] = tp.pmap(lambda v: tp.psum(v, "i"), axis_name="i")(torch.ones(1))
    if nproc == 4:
        out["mesh"] = scenario_mesh_part(rank)
    return out


def _error_of(fn) -> str | None:
    try:
        fn()
    except ValueError as e:
        return str(e)
    return None


def scenario_mesh_part(rank: int) -> dict:
    import torchpmap.distributed as tpd

    m = tpd.mesh(MESH_SHAPE, MESH_NAMES)
    i, j = m.coordinate("data"), m.coordinate("model")
    a, b = MESH_LOCAL
    block = mesh_global()[i * a : (i + 1) * a, j * b : (j + 1) * b]
    with m:
        f = tp.pmap(tp.pmap(mesh_program, axis_name="model"), axis_name="data")
        result = f(block)
    xg = block.clone().requires_grad_()
    with m:
        y = tp.pmap(tp.pmap(lambda v: tp.psum(v * v, "model") + tp.all_gather(v, "data").sum(0), axis_name="model"),
                    axis_name="data")(xg)
    y.sum().backward()
    explicit = tp.pmap(tp.pmap(mesh_program, axis_name="model", mesh=m), axis_name="data", mesh=m)(block)
    return {"coords": (i, j), "result": result, "explicit": explicit, "block_grad": xg.grad, "repr": repr(m)}


def scenario_raise(rank: int, nproc: int, jit: bool = False) -> dict:
    def f(v):
        if int(os.environ["RANK"]) == 1:
            raise ValueError("boom on purpose in rank 1")
        return tp.psum(v, "i")

    return _expect_failure(lambda: tp.pmap(f, axis_name="i", jit=JIT if jit else False)(torch.ones(2)))


def scenario_raise_jit(rank: int, nproc: int) -> dict:
    """The same on a first compiled call: rank 1 raises while tracing (and again in the
    eager retry); rank 0 waits in its compiled program's exchange op."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tp.JitFallbackWarning)  # rank 1's trace fails, as it should
        return scenario_raise(rank, nproc, jit=True)


def scenario_cannot_vectorize(rank: int, nproc: int) -> dict:
    """Two instances per process, writing a per-instance value into a tensor they share:
    vmap refuses it; in one process the instances fall back to one at a time, across
    processes the error says that they cannot, and what to do."""
    def f(c, v):
        c = c.clone()
        c.add_((v > 0).sum())
        return tp.psum(v, "i"), c

    try:
        tp.pmap(f, axis_name="i", in_axes=(None, 0), out_axes=(None, None))(torch.zeros((), dtype=torch.long),
                                                                            torch.arange(4.0).reshape(2, 2) - 1)
        return {"error": None}
    except BaseException as e:  # noqa: BLE001 - reported to the test
        return {"error": type(e).__name__, "notes": list(getattr(e, "__notes__", []))}


def scenario_die(rank: int, nproc: int) -> dict:
    def f(v):
        if int(os.environ["RANK"]) == 1:
            os._exit(17)
        return tp.psum(v, "i")

    return _expect_failure(lambda: tp.pmap(f, axis_name="i")(torch.ones(2)))


def scenario_die_jit(rank: int, nproc: int) -> dict:
    """The same, inside a compiled program: rank 0 waits in its exchange op, not in Python."""
    f = tp.pmap(lambda v: tp.psum(v * 2, "i"), axis_name="i", jit=JIT)
    f(torch.ones(2))  # compiled in both
    if rank == 1:
        os._exit(17)
    return _expect_failure(lambda: f(torch.ones(2)))


def scenario_sigkill(rank: int, nproc: int) -> dict:
    """The last process is killed (SIGKILL: no Python exit, no goodbye) inside the pmap."""
    import signal

    def f(v):
        if int(os.environ["RANK"]) == nproc - 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return tp.psum(v, "i")

    return _expect_failure(lambda: tp.pmap(f, axis_name="i")(torch.ones(2)))


def scenario_sleep(rank: int, nproc: int) -> dict:
    """The last process sleeps inside the pmap, past the timeout, before its collective:
    the others time out saying where it is; it then finds their failure records."""
    timeout = float(os.environ.get("TEST_TIMEOUT", "30"))

    def f(v):
        if int(os.environ["RANK"]) == nproc - 1:
            time.sleep(timeout + 3)
        return tp.psum(v, "i")

    return _expect_failure(lambda: tp.pmap(f, axis_name="i")(torch.ones(2)))


def scenario_absent(rank: int, nproc: int) -> dict:
    """Rank 1 is alive but never calls the pmap: the others time out, saying where it is."""
    if rank == 1:  # stay alive (outside any pmap) until rank 0 has reported
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(sys.argv[2], "rank0.pt")) and time.monotonic() < deadline:
            time.sleep(0.1)
        return {"waited": True}
    return _expect_failure(lambda: tp.pmap(lambda v: tp.psum(v, "i"), axis_name="i")(torch.ones(2)))


#: Ways for the last process to disagree with the others at an exchange, each from the
#: issue's table: (what every other process runs, what the last one runs), as pmapped functions
#: of a local value of shape (1, 4) (float32, or float64 with "f64" in the case's name).
def _disagreements() -> dict[str, tuple]:
    ring, back = _ring, lambda n: [(d, s) for s, d in _ring(n)]
    return {
        "dtype": (lambda v: tp.psum(v, "i"), lambda v: tp.psum(v.int(), "i")),
        "shape_same_bytes": (lambda v: tp.psum(v.double()[:2], "i"), lambda v: tp.psum(v, "i")),
        "collective": (lambda v: tp.psum(v, "i"), lambda v: tp.pmax(v, "i")),
        "perm": (lambda v: tp.ppermute(v, "i", ring(tp.process_count())),
                 lambda v: tp.ppermute(v, "i", back(tp.process_count()))),
        "shape_other_bytes": (lambda v: tp.psum(v, "i"), lambda v: tp.psum(torch.cat([v, v], -1), "i")),
        "psum_vs_all_gather": (lambda v: tp.psum(v, "i"), lambda v: tp.all_gather(v, "i")),
        "collective_vs_none": (lambda v: tp.psum(v, "i"), lambda v: v * 2),
        # (tiled=True is a local reshape of the same exchange: each process gets what it asked for)
        "all_gather_axis": (lambda v: tp.all_gather(v, "i", axis=0), lambda v: tp.all_gather(v, "i", axis=1)),
    }


def scenario_disagree(rank: int, nproc: int) -> dict:
    """Each way to disagree, eager and compiled, then an out-of-step case; each must raise
    the same clear error on every process, and (in step) leave the processes usable."""
    import warnings

    last = rank == nproc - 1
    out: dict[str, object] = {}
    x = torch.arange(4.0).reshape(1, 4) + rank
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", tp.JitFallbackWarning)
        for name, (theirs, mine) in _disagreements().items():
            for jit in (False, True):
                # agree twice first: the next transfer is then announced in the form of
                # `theirs` (one round; see process_agreement), and the odd process either
                # sends its differing header in that form or asks for two rounds
                for _ in range(2):
                    tp.pmap(theirs, axis_name="i", jit=JIT if jit else False)(x)
                f = mine if last else theirs
                out[name + ("_jit" if jit else "")] = _failure_of(
                    lambda: tp.pmap(f, axis_name="i", jit=JIT if jit else False)(x))
                # still in step: an agreeing call works right after
                out[name + ("_jit" if jit else "") + "_after"] = tp.pmap(lambda v: tp.psum(v, "i"), axis_name="i")(x)
    # the gradient exchange: the last process differentiates another output of the same call
    w = x.clone().requires_grad_()
    a, b = tp.pmap(lambda v: (tp.psum(v * v, "i"), tp.all_gather(v, "i")), axis_name="i")(w)
    out["backward"] = _failure_of(lambda: (b if last else a).sum().backward())
    out["backward_after"] = tp.pmap(lambda v: tp.psum(v, "i"), axis_name="i")(x)
    # out of step: the last process makes one more exchange in a call than the others
    out["out_of_step"] = _failure_of(lambda: (
        tp.pmap(lambda v: tp.psum(tp.psum(v, "i") if last else v, "i"), axis_name="i")(x),
        tp.pmap(lambda v: tp.psum(v, "i"), axis_name="i")(x)))
    out["after_out_of_step"] = _failure_of(lambda: tp.pmap(lambda v: tp.psum(v, "i"), axis_name="i")(x))
    return out


def scenario_uncaught_mismatch(rank: int, nproc: int) -> dict:
    """Payloads of different byte counts, not caught: the process must exit with an error."""
    x = torch.ones(1, 8 if rank == nproc - 1 else 4)
    tp.pmap(lambda v: tp.psum(v, "i"), axis_name="i")(x)
    return {}


def _failure_of(fn) -> dict | None:
    t = time.monotonic()
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - reported to the test
        return {"error": type(e).__name__, "message": str(e), "ranks": list(getattr(e, "ranks", ())),
                "seconds": time.monotonic() - t}
    return None


def bucket_data(nproc: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of the gradient-bucket scenario: one instance per process."""
    g = torch.Generator().manual_seed(5)
    return torch.randn(nproc, 8, 16, generator=g), torch.randn(nproc, 8, 4, generator=g)


def train_in_buckets(
    x: torch.Tensor,
    y: torch.Tensor,
    by_hand: bool = False,
    steps: int = 3,
    jit: bool = False,
    batch_norm: bool = False,
    dtype: torch.dtype = torch.float32,
) -> dict:
    """A 4-layer MLP (with a BatchNorm1d after its first layer if ``batch_norm``) trained
    by data_parallel_step (or the same step written as pmean(grad(...)), whose exchange
    starts after the backward), its parameters and data in ``dtype``; returns the
    parameters, buffers and losses."""
    from torch.func import functional_call, grad_and_value

    from torchpmap.training import data_parallel_step

    torch.manual_seed(3)
    sizes = [16, 64, 64, 64, 4]
    layers = [m for a, b in zip(sizes, sizes[1:]) for m in (torch.nn.Linear(a, b), torch.nn.Tanh())][:-1]
    if batch_norm:
        layers.insert(1, torch.nn.BatchNorm1d(sizes[1]))
    model = torch.nn.Sequential(*layers).to(dtype)
    x, y = x.to(dtype), y.to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if not by_hand:
        step = data_parallel_step(model, torch.nn.functional.mse_loss, opt, jit=JIT if jit else False)
    else:
        def instance(params, xb, yb):
            loss = lambda p: torch.nn.functional.mse_loss(functional_call(model, p, (xb,)), yb)  # noqa: E731
            return tp.pmean(grad_and_value(loss)(params), "batch")

        p_step = tp.pmap(instance, axis_name="batch", in_axes=(None, 0, 0), out_axes=None)

        def step(batch):
            grads, loss = p_step({k: p.detach() for k, p in model.named_parameters()}, *batch)
            for k, p in model.named_parameters():
                p.grad = grads[k]
            opt.step()
            return loss

    losses = [step((x, y)) for _ in range(steps)]
    state = {k: t.detach().clone() for k, t in (*model.named_parameters(), *model.named_buffers())}
    return {**state, "losses": torch.stack(losses)}


def scenario_gradient_buckets(rank: int, nproc: int) -> dict:
    """data_parallel_step across processes with its all-reduce started bucket by bucket in
    the backward: when the buckets start, the trained model against the same step written
    by hand, and processes whose buckets differ."""
    import torchpmap._engines.process_exchange as engine
    import torchpmap._frontend.instance_grad as instance_grad

    x, y = (t[rank : rank + 1] for t in bucket_data(nproc))
    tp.config.all_reduce_bytes = 1 << 10  # this little MLP's gradients go through all-reduces, its loss is gathered
    tp.config.bucket_bytes = 16 << 10  # and several buckets
    events: list[str] = []
    all_reduce, grad_and_value = torch.distributed.all_reduce, instance_grad.grad_and_value
    all_gather = engine._all_gather_flat

    def counted_all_reduce(t, *args, **kwargs):
        events.append(f"all_reduce {t.numel()}")
        return all_reduce(t, *args, **kwargs)

    def counted_all_gather(*args, **kwargs):
        events.append("all_gather")
        return all_gather(*args, **kwargs)

    def logged_grad_and_value(*args, **kwargs):
        inner = grad_and_value(*args, **kwargs)

        def call(*a, **k):
            out = inner(*a, **k)
            events.append("backward done")
            return out

        return call

    torch.distributed.all_reduce, instance_grad.grad_and_value = counted_all_reduce, logged_grad_and_value
    engine._all_gather_flat = counted_all_gather
    try:
        out = {"overlapped": train_in_buckets(x, y, steps=4)}
    finally:
        torch.distributed.all_reduce, instance_grad.grad_and_value = all_reduce, grad_and_value
        engine._all_gather_flat = all_gather
    out["events"] = events
    out["overlapped"] = train_in_buckets(x, y)
    # compiled: the buckets are ops of the program (no fallback to eager allowed)
    import warnings

    calls: list[int] = []
    torch.distributed.all_reduce = lambda t, *a, **k: (calls.append(t.numel()), all_reduce(t, *a, **k))[1]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", tp.JitFallbackWarning)
            out["compiled"] = train_in_buckets(x, y, jit=True)
    finally:
        torch.distributed.all_reduce = all_reduce
    out["compiled_all_reduces"] = calls
    out["by_hand"] = train_in_buckets(x, y, by_hand=True)
    # bfloat16: the buckets sum in float32 and round once, as pmean (and one process) does
    out["bfloat16"] = train_in_buckets(x, y, dtype=torch.bfloat16)
    out["bfloat16_by_hand"] = train_in_buckets(x, y, by_hand=True, dtype=torch.bfloat16)
    # batch norm: its statistics' means travel with the buckets' agreement; after one step
    # (the same parameters) they must be those of the one pmean of everything that a step
    # without buckets makes
    out["batch_norm"] = train_in_buckets(x, y, batch_norm=True, steps=1)
    out["batch_norm_compiled"] = train_in_buckets(x, y, batch_norm=True, steps=1, jit=True)
    tp.config.all_reduce_bytes = 1 << 30
    out["batch_norm_one_pmean"] = train_in_buckets(x, y, batch_norm=True, steps=1)
    tp.config.all_reduce_bytes = 1 << 10
    # every process must make the same buckets: a different bucket size is an error everywhere
    tp.config.bucket_bytes = (16 << 10) if rank < nproc - 1 else (32 << 10)
    out["disagree"] = _failure_of(lambda: train_in_buckets(x, y, steps=1))
    tp.config.bucket_bytes = 16 << 10
    out["after"] = train_in_buckets(x, y, steps=1)["losses"]
    # a first bucket of 4 KiB: the last 64x64 weight (16 KiB) is far bigger, so its first
    # rows travel with the first bucket and the rest in a bucket of its own
    tp.config.bucket_bytes = 4 << 10
    for name, jit in (("split", False), ("split_compiled", True)):
        sizes: list[int] = []
        torch.distributed.all_reduce = lambda t, *a, **k: (sizes.append(t.numel()), all_reduce(t, *a, **k))[1]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", tp.JitFallbackWarning)
                out[name] = train_in_buckets(x, y, jit=jit)
        finally:
            torch.distributed.all_reduce = all_reduce
        out[f"{name}_all_reduces"] = sizes
    tp.config.bucket_bytes = 16 << 10
    return out


class _BoomInBackward(torch.autograd.Function):
    """Identity whose backward raises on rank 1: after the buckets of the layers above it
    have started, before the first layer's gradient exists."""

    @staticmethod
    def forward(x):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, grad):
        if int(os.environ["RANK"]) == 1:
            raise ValueError("boom on purpose in rank 1's backward")
        return grad


def scenario_raise_in_backward(rank: int, nproc: int) -> dict:
    """data_parallel_step with gradient buckets; rank 1 raises in the middle of the
    backward, when some buckets' all-reduces are running: every other process must raise
    RankFailed naming it, none may hang."""
    from torchpmap.training import data_parallel_step

    class Boom(torch.nn.Module):
        def forward(self, x):
            return _BoomInBackward.apply(x)

    tp.config.all_reduce_bytes, tp.config.bucket_bytes = 1, 16 << 10
    torch.manual_seed(3)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        Boom(),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 64),
    )
    step = data_parallel_step(model, torch.nn.functional.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = torch.randn(1, 8, 16), torch.randn(1, 8, 64)
    return _expect_failure(lambda: step((x, y)))


# --------------------------------------------------------------------------- same answers as plain PyTorch (issue 27)


class WithSpare(torch.nn.Module):
    """A small model with batch norm and a layer its forward never uses."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        # no bias before the batch norm: its gradient is zero up to rounding, which AdamW would amplify
        self.body = torch.nn.Sequential(torch.nn.Linear(5, 8, bias=False), torch.nn.BatchNorm1d(8), torch.nn.Tanh())
        self.head, self.spare = torch.nn.Linear(8, 3), torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.body(x))


def same_answers_data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(16, 5, generator=g), torch.randint(0, 3, (16,), generator=g)


def metrics_loss(out, y):
    return torch.nn.functional.cross_entropy(out, y), {"accuracy": (out.argmax(-1) == y).float().mean()}


def train_with_spare(
    model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, n: int, steps: int = 3, clipped: bool = False
) -> dict:
    """data_parallel_step with AdamW (weight decay) and metrics; what the model holds after.
    ``clipped``: SGD with momentum and max_grad_norm=CLIP instead (a step that follows the
    clipped gradient's size, which AdamW's normalisation would hide)."""
    from torchpmap.training import data_parallel_step, shard

    opt = _optimizer(model, clipped)
    step = data_parallel_step(model, metrics_loss, opt, has_aux=True, max_grad_norm=CLIP if clipped else None)
    losses, accuracies = [], []
    for _ in range(steps):
        loss, aux = step(shard((x, y), n=n))
        losses.append(loss)
        accuracies.append(aux["accuracy"])
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "no_grad": sorted(k for k, p in model.named_parameters() if p.grad is None),
        "losses": torch.stack(losses),
        "accuracies": torch.stack(accuracies),
    }


def scenario_same_answers(rank: int, nproc: int) -> dict:
    """Unseeded models trained by data_parallel_step (pmean, and gradient buckets), the
    programs' digests, broadcast and check_same, complex collectives."""
    import torchpmap.distributed as tpd
    from torchpmap.distributed import ReplicasDiffer

    out: dict[str, object] = {}
    x, y = (local(t, rank, nproc) for t in same_answers_data())
    # 1. every process builds its model from its own seed, as the DDP tutorial does
    model = WithSpare(seed=100 + rank)
    out["initial"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out["trained"] = train_with_spare(model, x, y, n=2)  # two instances per process: one pmean per step
    saved = tp.config.all_reduce_bytes, tp.config.bucket_bytes
    tp.config.all_reduce_bytes, tp.config.bucket_bytes = 1 << 8, 1 << 8  # gradient buckets in the backward
    try:
        out["bucketed"] = train_with_spare(WithSpare(seed=200 + rank), x, y, n=1)
    finally:
        tp.config.all_reduce_bytes, tp.config.bucket_bytes = saved
    # 2. processes running different programs with the same shapes raise at the first exchange
    v = torch.arange(4.0).reshape(1, 1, 4) + rank
    last = rank == nproc - 1

    def psum_of(w):
        return tp.psum(w, "i")

    def psum_too(w):
        return tp.psum(w, "i")

    cases = {
        "in_axes": lambda: tp.pmap(psum_of, axis_name="i", in_axes=1 if last else 0)(v),
        "out_axes": lambda: tp.pmap(psum_of, axis_name="i", out_axes=1 if last else 0)(v),
        "function": lambda: tp.pmap(psum_too if last else psum_of, axis_name="i")(v),
        "no_collective": lambda: tp.pmap(lambda w: w * 2, axis_name="i", in_axes=1 if last else 0)(v),
    }
    for name, run in cases.items():
        out[f"differ_{name}"] = _failure_of(run)
        out[f"differ_{name}_after"] = tp.pmap(psum_of, axis_name="i")(v)  # still in step
    # 3. broadcast gives process 0's bits; check_same names the first leaf that differs
    nan = torch.tensor([float("nan")]).view(torch.int32).add(rank).view(torch.float32)  # a NaN payload per rank
    mine = {
        "f32": torch.cat([torch.tensor([-0.0 if rank == 0 else 0.0, 1.5 + rank]), nan]),
        "i64": torch.arange(3) * (rank + 1),
        "flag": torch.tensor([rank == 0, True]),
        "c128": torch.tensor([1 + 2j * rank], dtype=torch.complex128),
        "scalar": torch.tensor(float(rank)),
    }
    first = tpd.broadcast(mine)
    out["broadcast"] = {
        k: (t.dtype, tuple(t.shape), t.contiguous().view(-1).view(torch.uint8).clone()) for k, t in first.items()
    }
    out["check_same_equal"] = _failure_of(lambda: tpd.check_same(first, what="broadcast"))
    same_but_b = {"a": torch.ones(3), "b": torch.ones(2) * (1 if rank == 0 else 2), "c": torch.zeros(1) + rank}
    try:
        tpd.check_same(same_but_b, what="params")
        out["check_same_differ"] = None
    except ReplicasDiffer as e:
        out["check_same_differ"] = {"message": str(e), "path": e.path, "ranks": e.ranks}
    # 4. complex values through all_gather and ppermute
    z = (torch.arange(3.0) + 1j * rank).to(torch.complex128).reshape(1, 3)
    out["complex_all_gather"] = tp.pmap(lambda w: tp.all_gather(w, "i"), axis_name="i")(z)
    out["complex_ppermute"] = tp.pmap(lambda w: tp.ppermute(w, "i", _ring(nproc)), axis_name="i")(z)
    return out


CLIP = 0.05  # below the gradient's norm at each of the 3 steps of the clipped scenario


def _optimizer(model: torch.nn.Module, clipped: bool) -> torch.optim.Optimizer:
    if clipped:
        return torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.5)


def same_answers_reference(seed: int, n: int, clipped: bool = False) -> dict:
    """One process, every instance: the model of process 0's seed on the global batch."""
    x, y = same_answers_data()
    return train_with_spare(WithSpare(seed=seed), x, y, n=n, clipped=clipped)


def _expect_failure(fn) -> dict:
    t = time.monotonic()
    try:
        fn()
        result = {"error": None}
    except BaseException as e:  # noqa: BLE001 - reported to the test
        result = {"error": type(e).__name__, "message": str(e), "ranks": list(getattr(e, "ranks", ()))}
    result["seconds"] = time.monotonic() - t
    try:  # a later distributed pmap is refused at once
        tp.pmap(lambda v: tp.psum(v, "i"), axis_name="i")(torch.ones(2))
        result["after"] = None
    except BaseException as e:  # noqa: BLE001
        result["after"] = f"{type(e).__name__}: {e}"
    return result


# --------------------------------------------------------------------------- shard_map on a process mesh

SHARD_MAP_MESH = ((2, 2), ("data", "model"))


def shard_map_data():
    g = torch.Generator().manual_seed(7)
    return {
        "x": torch.randn(8, 4, generator=g),
        "w": torch.randn(4, 6, generator=g),
        "w1": torch.randn(4, 8, generator=g),
    }


def shard_map_programs(mesh, d: dict) -> dict:
    """The programs of tests/test_distributed.py's shard_map test, on any mesh: their
    results as plain global tensors (DTensors made whole)."""
    P = tp.P

    def whole(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t

    out = {}
    matmul = tp.shard_map(lambda x, w: tp.psum(x @ w, "model"), mesh=mesh,
                          in_specs=(P("data", "model"), P("model", None)), out_specs=P("data", None))
    out["matmul"] = whole(matmul(d["x"], d["w"]))

    def loss(w1, x):
        full = tp.all_gather(w1, "data", tiled=True)
        return tp.pmean((torch.tanh(x @ full) ** 2).mean(), "data")

    fsdp = tp.shard_map(lambda w1, x: (loss(w1, x), grad(loss)(w1, x)), mesh=mesh,
                        in_specs=(P("data"), P("data")), out_specs=(P(), P("data")))
    value, gradient = fsdp(d["w1"], d["x"])
    out["fsdp_loss"], out["fsdp_grad"] = whole(value), whole(gradient)
    ring = tp.shard_map(lambda x: tp.ppermute(x, "data", [(0, 1), (1, 0)]) + tp.axis_index("model"), mesh=mesh,
                        in_specs=P("data", "model"), out_specs=P("data", "model"))
    out["ring"] = whole(ring(d["x"]))
    return out


def shard_map_backward_programs(mesh, d: dict, as_dtensor=None) -> dict:
    """``.backward()`` from outside through shard_maps on any mesh: each argument's
    gradient, whole. ``as_dtensor(name, tensor)``: the argument as a process mesh takes
    it (a DTensor), or None for the tensors themselves."""
    P = tp.P

    def whole(t):
        if hasattr(t, "full_tensor"):
            return t.full_tensor()
        return torch.as_tensor(t)

    def leaf(name):
        t = d[name].clone()
        return (as_dtensor(name, t) if as_dtensor is not None else t).requires_grad_()

    weights = torch.linspace(-1.0, 1.0, 8 * 6).reshape(8, 6)
    out = {}
    # a result split over "data": the weight (replicated over "data") sums every position's part
    matmul = tp.shard_map(lambda x, w: tp.psum(x @ w, "model"), mesh=mesh,
                          in_specs=(P("data", "model"), P("model", None)), out_specs=P("data", None))
    x, w = leaf("x"), leaf("w")
    (whole(matmul(x, w)) * weights).sum().backward()
    out["matmul"] = (whole(x.grad), whole(w.grad))
    # a replicated result (invariant: its cotangent counted once) of a weight split over "data"
    def loss(w1, x):
        full = tp.all_gather(w1, "data", tiled=True)
        return tp.pmean((torch.tanh(x @ full) ** 2).mean(), "data")

    fsdp = tp.shard_map(loss, mesh=mesh, in_specs=(P("data"), P("data")), out_specs=P())
    w1, x = leaf("w1"), leaf("x")
    whole(fsdp(w1, x)).backward()
    out["fsdp"] = (whole(w1.grad), whole(x.grad))
    # one weight used invariantly (a psum of it) and with the split batch; two results
    both = tp.shard_map(lambda x, w: (tp.psum((w ** 2).sum(), "model"), x @ w), mesh=mesh,
                        in_specs=(P("data", None), P()), out_specs=(P(), P("data", None)))
    x, w = leaf("x"), leaf("w")
    scalar, product = both(x, w)
    (whole(scalar) * 3 + (whole(product) * weights).sum()).backward()
    out["mixed"] = (whole(x.grad), whole(w.grad))
    return out


def scenario_shard_map_backward(rank: int, nproc: int) -> dict:
    from torch.distributed.tensor import distribute_tensor

    import torchpmap.distributed as tpd

    mesh = tpd.mesh(*SHARD_MAP_MESH)
    d = shard_map_data()
    out = {"plain": shard_map_backward_programs(mesh, d)}
    placements = {"x": tp.P("data", "model"), "w": tp.P(None, "model"), "w1": tp.P("data")}

    def as_dtensor(name, t):
        from torchpmap._placement.dtensor import placements_for

        return distribute_tensor(t, mesh.device_mesh, placements_for(placements[name], mesh, name))

    out["dtensor"] = shard_map_backward_programs(mesh, d, as_dtensor)
    return out


def scenario_sharded_step(rank: int, nproc: int, clipped: bool = False) -> dict:
    """data_parallel_step(shard_params=True) across processes (ZeRO-3): models built from
    each process' own seed, AdamW, batch norm, metrics, a layer the loss never reaches;
    the weights gathered after, and the bytes each process holds for the shards.
    ``clipped``: SGD and max_grad_norm (the norm of rows held by both processes)."""
    from torchpmap.training import data_parallel_step, shard

    x, y = (local(t, rank, nproc) for t in same_answers_data())
    model = WithSpare(seed=100 + rank)
    opt = _optimizer(model, clipped)
    step = data_parallel_step(
        model, metrics_loss, opt, has_aux=True, shard_params=True, max_grad_norm=CLIP if clipped else None
    )
    losses, accuracies = [], []
    for _ in range(3):
        loss, aux = step(shard((x, y), n=2))  # two instances per process
        losses.append(loss)
        accuracies.append(aux["accuracy"])
    held = step.bytes_per_device()
    step.gather_params()
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "losses": torch.stack(losses),
        "accuracies": torch.stack(accuracies),
        "bytes": sum(held.values()),
    }


class Dot(torch.nn.Module):
    """``(w * x).sum(-1)``: the gradient of its weight's element k is the batch's mean of
    feature k, so an inf in one feature reaches one element (one row) of the gradient."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.linspace(-1.0, 1.0, 8))

    def forward(self, x):
        return (self.w * x).sum(-1)


def scaled_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Four global batches of 8 samples; the third has an inf in feature 7 of sample 1
    (process 0's data), whose gradient lands only in the last flat row (process 1's)."""
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 8, generator=g), torch.zeros(8)) for _ in range(4)]
    batches[2][0][1, 7] = float("inf")
    return batches


def train_scaled(rank: int, nproc: int, shard_params: bool, n: int) -> dict:
    """SGD under a GradScaler on :class:`Dot`: the weights and the scale after each batch
    of :func:`scaled_batches` (this process' samples, in ``n`` instances)."""
    from torchpmap.training import data_parallel_step, shard

    model = Dot()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    step = data_parallel_step(model, lambda out, y: out.mean(), opt, grad_scaler=scaler, shard_params=shard_params)
    weights, scales = [], []
    for x, y in scaled_batches():
        step(shard((local(x, rank, nproc), local(y, rank, nproc)), n=n))
        if shard_params:
            step.gather_params()
        weights.append(model.w.detach().clone())
        scales.append(scaler.get_scale())
    return {"weights": torch.stack(weights), "scales": scales}


def scenario_sharded_step_scaled(rank: int, nproc: int) -> dict:
    return train_scaled(rank, nproc, shard_params=True, n=2)


def scenario_sharded_step_checkpoint(rank: int, nproc: int) -> dict:
    """data_parallel_step(shard_params=True) with AdamW for 2 steps on every process (2
    instances each), then the weights and the whole optimizer state saved with
    torch.distributed.checkpoint by every process; the test resumes them in one."""
    import torch.distributed.checkpoint as dcp

    from torchpmap.training import data_parallel_step, shard

    x, y = (local(t, rank, nproc) for t in same_answers_data())
    model = WithSpare(seed=100)
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    step = data_parallel_step(model, metrics_loss, opt, has_aux=True, shard_params=True)
    for _ in range(2):
        step(shard((x, y), n=2))
    optim = step.optimizer_state_dict()
    step.gather_params()
    dcp.save({"model": model.state_dict(), "optim": optim}, checkpoint_id=os.environ["TEST_CHECKPOINT"])
    return {"bytes": sum(step.bytes_per_device().values())}


class HeapPeak:
    """The most bytes malloc held beyond what it held on entering, sampled after every
    aten op of this thread (glibc's ``mallinfo2``: arena chunks in use and mmapped
    blocks; CPU tensors of this size are malloc'd and freed as they come and go)."""

    def __init__(self) -> None:
        import ctypes

        class Info(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in (
                "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                "keepcost")]

        self._mallinfo2 = ctypes.CDLL("libc.so.6").mallinfo2
        self._mallinfo2.restype = Info

    def held(self) -> int:
        info = self._mallinfo2()
        return info.uordblks + info.hblkhd

    def during(self, fn) -> int:
        from torch.utils._python_dispatch import TorchDispatchMode

        meter = self

        class Sample(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                top[0] = max(top[0], meter.held() - start)
                return out

        top = [0]
        start = self.held()
        with Sample():
            fn()
        return top[0]


def scenario_sharded_step_peak(rank: int, nproc: int) -> dict:
    """The allocator's peak in each process during one step (after two), of the
    replicated step and the sharded one, for stacks of 6 and 12 square layers of 1 MiB:
    the sharded step gathers each layer as it runs (torchpmap._frontend.layer_gather)."""
    from torchpmap.training import data_parallel_step, shard

    meter = HeapPeak()
    torch.manual_seed(1)
    x, y = torch.randn(4 * nproc, 512), torch.randn(4 * nproc, 512)
    x, y = local(x, rank, nproc), local(y, rank, nproc)
    peaks = {}
    for depth in (6, 12):
        for sharded in (False, True):
            torch.manual_seed(0)
            model = torch.nn.Sequential(
                *(torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Tanh()) for _ in range(depth))
            )
            opt = torch.optim.SGD(model.parameters(), lr=1e-2)
            step = data_parallel_step(model, torch.nn.functional.mse_loss, opt, shard_params=sharded)
            for _ in range(2):
                step(shard((x, y), n=1))
            peaks[(depth, sharded)] = meter.during(lambda step=step: step(shard((x, y), n=1)))
    return {"peaks": peaks, "layer": (512 * 512 + 512) * 4}


def scenario_sharded_step_clipped(rank: int, nproc: int) -> dict:
    return scenario_sharded_step(rank, nproc, clipped=True)


def scenario_shard_map_checkpoint(rank: int, nproc: int) -> dict:
    """FSDP-style sharded weights (a shard_map's DTensor results) saved with
    torch.distributed.checkpoint by every process; the test loads them in one."""
    import torch.distributed.checkpoint as dcp

    import torchpmap.distributed as tpd

    mesh = tpd.mesh((nproc,), ("data",))
    d = shard_map_data()
    step = tp.shard_map(
        lambda w: w * 2 + tp.axis_index("data"), mesh=mesh, in_specs=tp.P("data"), out_specs=tp.P("data")
    )
    state = {"w1": step(d["w1"])}
    dcp.save(state, checkpoint_id=os.environ["TEST_CHECKPOINT"])
    return {"local": state["w1"].to_local()}


def scenario_shard_map(rank: int, nproc: int) -> dict:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    import torchpmap.distributed as tpd

    mesh = tpd.mesh(*SHARD_MAP_MESH)
    d = shard_map_data()
    out = {"plain": shard_map_programs(mesh, d)}
    # DTensors in: the spec's placements (taken as they are) and others (redistributed), and a torch DeviceMesh
    as_spec = {"x": distribute_tensor(d["x"], mesh.device_mesh, [Shard(0), Shard(1)]),
               "w": distribute_tensor(d["w"], mesh.device_mesh, [Replicate(), Shard(0)]),
               "w1": distribute_tensor(d["w1"], mesh.device_mesh, [Shard(0), Replicate()])}
    out["dtensor_as_spec"] = shard_map_programs(mesh.device_mesh, as_spec)
    others = {k: distribute_tensor(v, mesh.device_mesh, [Replicate(), Replicate()]) for k, v in d.items()}
    out["dtensor_redistributed"] = shard_map_programs(mesh, others)
    f = tp.shard_map(lambda x, w: tp.psum(x @ w, "model"), mesh=mesh, in_specs=(tp.P("data", "model"),
                     tp.P("model", None)), out_specs=tp.P("data", None))
    y = f(d["x"], d["w"])
    out["placements"] = [(type(p).__name__, getattr(p, "dim", None)) for p in y.placements]
    out["local_shape"] = tuple(y.to_local().shape)
    return out


def main() -> None:
    scenario, outdir = sys.argv[1], sys.argv[2]
    timeout = float(os.environ.get("TEST_TIMEOUT", "30"))
    import torchpmap.distributed as tpd

    tpd.initialize(timeout=datetime.timedelta(seconds=timeout))
    rank, nproc = tp.process_index(), tp.process_count()
    if scenario.startswith("uncaught_"):  # the error ends the process, as in a user's script
        globals()[f"scenario_{scenario}"](rank, nproc)
    try:
        out = globals()[f"scenario_{scenario}"](rank, nproc)
    except BaseException:  # noqa: BLE001 - keep the traceback for the test
        out = {"crashed": traceback.format_exc()}
    path = os.path.join(outdir, f"rank{rank}.pt")
    torch.save(out, path + ".tmp")
    os.replace(path + ".tmp", path)  # complete when it appears
    sys.stdout.flush()
    if scenario in (
        "raise",
        "raise_jit",
        "die",
        "die_jit",
        "absent",
        "disagree",
        "sigkill",
        "sleep",
        "raise_in_backward",
    ):
        # The group is out of step: skip waiting for its collectives at exit, but let rank 0
        # (the store's host) stay as long as torchpmap's own exit hook would.
        if rank == 0:
            from torchpmap._state.process_group import linger_seconds

            time.sleep(linger_seconds())
        os._exit(0)
    tpd.shutdown()


if __name__ == "__main__":
    main()
