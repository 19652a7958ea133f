"""Data-parallel training with ``pmap``: shard the batch, average the gradients, step.

Data parallelism runs the same model on every instance of a mapped axis, each on its own
slice (shard) of the global batch. Every instance computes the gradient of its local
loss; :func:`torchpmap.pmean` averages those gradients over the named axis, so every
instance ends up with the same update and the parameters stay identical. When the loss
is a mean over examples and the shards are equal in size, the mean of the per-shard
mean losses *is* the mean loss over the whole batch, and so is its gradient: the step
is the one a single process would take on the whole batch.

This module holds the few pieces that make that pattern short:

* :func:`shard` / :func:`unshard`: ``(B, ...)`` <-> ``(n, B/n, ...)`` for a pytree batch.
* :func:`replicate` / :func:`unreplicate`: one copy per instance <-> instance 0.
* :func:`prefetch_to_device`: shards and moves upcoming batches in a background thread.
* :func:`data_parallel_step`: ``nn.Module`` + loss + ``torch.optim`` optimizer ->
  ``step(sharded_batch) -> loss``.

The whole pattern, written by hand (this is what :func:`data_parallel_step` does for an
``nn.Module``, minus buffers such as batch-norm statistics):

>>> import torch, torchpmap as tp
>>> from torch.func import grad_and_value
>>> from torchpmap.training import shard
>>> params = {"w": torch.zeros(3, 1, requires_grad=True), "b": torch.zeros(1, requires_grad=True)}
>>> opt = torch.optim.SGD(params.values(), lr=0.1)     # any torch.optim optimizer
>>> def loss_fn(params, x, y):                          # one instance's loss on its shard
...     return ((x @ params["w"] + params["b"] - y) ** 2).mean()
>>> def instance_grads(params, x, y):                   # runs once per instance
...     grads, loss = grad_and_value(loss_fn)(params, x, y)
...     return tp.pmean((grads, loss), "batch")           # one exchange for both
>>> p_grads = tp.pmap(instance_grads, axis_name="batch", in_axes=(None, 0, 0), out_axes=None)
>>> x = torch.randn(64, 3, generator=torch.Generator().manual_seed(0))
>>> y = x @ torch.tensor([[1.0], [2.0], [3.0]]) + 4.0
>>> for _ in range(100):
...     values = {k: p.detach() for k, p in params.items()}
...     grads, loss = p_grads(values, *shard((x, y), 4))  # 4 instances of 16 rows
...     for k, p in params.items():
...         p.grad = grads[k]                           # averaged: the same on every instance
...     opt.step()
>>> loss.item() < 1e-3
True

``in_axes=(None, 0, 0)`` broadcasts the parameters to every instance and maps the data
over its leading (instance) axis; ``out_axes=None`` returns the averaged gradients and
loss once instead of once per instance (they are the same on every instance).

With an ``nn.Module``, the loss calls ``torch.func.functional_call(model, params, (x,))``,
one module for every instance, on any number of devices (device threads take turns
between collectives, so no thread sees the module while another has swapped its tensors
in).
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Generator, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.func import functional_call

from torchpmap._collectives.gradient_mean import GradientMean
from torchpmap._collectives.public import pmean
from torchpmap._engines import instance_autograd, recurrent
from torchpmap._frontend import buffer_means, sparse_gradients
from torchpmap._frontend.api import pmap
from torchpmap._frontend.device_params import DeviceParams
from torchpmap._frontend.elementwise_optimizers import check_elementwise
from torchpmap._frontend.instance_grad import instance_grad_and_value
from torchpmap._frontend.reached import reached as _reached
from torchpmap._frontend.sharded_step import ShardedStep
from torchpmap._placement import devices as _devices
from torchpmap._placement.devices import DeviceLike
from torchpmap._placement.sharded import ShardedTensor, row_of_shards
from torchpmap._state import torch_private as private
from torchpmap._state.config import config
from torchpmap._state.faults import SharedWrite
from torchpmap._state.listing import first_few
from torchpmap._state.torch_private import pytree
from torchpmap._state.type_aliases import AxisName, PyTree, Randomness

__all__ = [
    "replicate",
    "unreplicate",
    "shard",
    "unshard",
    "prefetch_to_device",
    "data_parallel_step",
    "ShardedStep",
]


# --------------------------------------------------------------------------- helpers


def _instances(n: int | None, what: str) -> int:
    """``n``, or the number of local devices when ``n`` is None; checked."""
    if n is None:
        return _devices.local_device_count()
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"{what}: n must be a positive int (the number of instances) or None, got {n!r}")
    return n


def _where(what: str, path: pytree.KeyPath) -> str:
    """A key path for error messages: ``batch[0]['x']``, or ``batch`` for the root."""
    return what + pytree.keystr(path)


def _as_tensor(leaf: Any, path: pytree.KeyPath, what: str, arg: str) -> torch.Tensor:
    if isinstance(leaf, torch.Tensor):
        return leaf
    if isinstance(leaf, ShardedTensor):  # a multi-device pmap result
        return leaf.gather()
    if isinstance(leaf, (np.ndarray, np.generic, bool, int, float, complex)):
        return torch.as_tensor(leaf)
    raise TypeError(
        f"{what}: the leaf at {_where(arg, path)} is a {type(leaf).__name__} ({leaf!r}); "
        "only tensors, numpy arrays and Python numbers can be leaves here"
    )


def _leading_axis(x: torch.Tensor, path: pytree.KeyPath, what: str, arg: str, role: str) -> int:
    if x.dim() == 0:
        raise ValueError(
            f"{what}: the leaf at {_where(arg, path)} is a scalar (shape ()), so it has no leading {role} axis"
        )
    return x.shape[0]


# --------------------------------------------------------------------------- replicate


def replicate(tree: PyTree, n: int | None = None) -> PyTree:
    """One copy of every leaf per instance, stacked along a new leading axis of size ``n``.

    Use it for a value that a pmapped function takes with ``in_axes=0`` but that starts
    out the same everywhere (parameters, optimizer state). The copies are real copies: an
    in-place change to one instance's copy does not touch the others. Tensors stay on
    their device; numpy arrays and Python numbers become tensors. Passing a value with
    ``in_axes=None`` instead broadcasts it without copying.

    Args:
        tree: a pytree of tensors, numpy arrays or numbers.
        n: the number of instances; defaults to ``torchpmap.local_device_count()``.

    Example:
        >>> import torch
        >>> from torchpmap.training import replicate
        >>> r = replicate({"w": torch.tensor([1., 2.]), "step": 0}, n=3)
        >>> r["w"]
        tensor([[1., 2.],
                [1., 2.],
                [1., 2.]])
        >>> r["step"]
        tensor([0, 0, 0])
    """
    n = _instances(n, "replicate")

    def copy(path: pytree.KeyPath, leaf: Any) -> torch.Tensor:
        x = _as_tensor(leaf, path, "replicate", "tree")
        return x.unsqueeze(0).expand(n, *x.shape).clone()

    return pytree.tree_map_with_path(copy, tree)


def unreplicate(tree: PyTree) -> PyTree:
    """Instance 0 of every leaf: the inverse of :func:`replicate`.

    Use it to get one copy of a value that is the same on every instance (parameters kept
    in sync by averaged gradients, a ``pmean``), e.g. to save or evaluate it.

    Example:
        >>> import torch
        >>> from torchpmap.training import replicate, unreplicate
        >>> unreplicate(replicate({"w": torch.tensor([1., 2.])}, n=4))
        {'w': tensor([1., 2.])}
    """

    def first(path: pytree.KeyPath, leaf: Any) -> torch.Tensor:
        if isinstance(leaf, ShardedTensor) and leaf.dim() > 0:
            # read from the first shard only: a plain tensor, a view of it, where no autograd
            # view is needed (a ShardedView, so that a write through it is recorded, otherwise)
            return leaf[0] if leaf.requires_grad else row_of_shards(leaf, 0)
        x = _as_tensor(leaf, path, "unreplicate", "tree")
        _leading_axis(x, path, "unreplicate", "tree", "instance")
        return x[0]

    return pytree.tree_map_with_path(first, tree)


# --------------------------------------------------------------------------- shard


def shard(batch: PyTree, n: int | None = None) -> PyTree:
    """Splits the leading batch axis of every leaf: ``(B, ...)`` -> ``(n, B // n, ...)``.

    Instance ``i`` of a pmap with ``in_axes=0`` then sees rows ``i*B/n .. (i+1)*B/n - 1``
    of the global batch. ``B`` must be divisible by ``n`` (equal shards are what make the
    mean of per-shard mean losses equal the full-batch mean loss): drop or pad the last
    incomplete batch of an epoch. The result is a view of the input where possible.

    Args:
        batch: a pytree of tensors or numpy arrays (numpy arrays become tensors), each
            with the batch along axis 0.
        n: the number of instances; defaults to ``torchpmap.local_device_count()``.

    Raises:
        ValueError: naming the key path of the first leaf whose batch size is not
            divisible by ``n`` (or that is a scalar), or the key paths and batch sizes of
            leaves whose batch sizes differ (each would be split its own way, and
            instance ``i`` would see rows of different examples).

    Example:
        >>> import torch
        >>> from torchpmap.training import shard
        >>> x, y = shard((torch.zeros(8, 3), torch.arange(8)), n=4)
        >>> tuple(x.shape), y
        ((4, 2, 3), tensor([[0, 1],
                [2, 3],
                [4, 5],
                [6, 7]]))
        >>> shard({"x": torch.zeros(10, 3)}, n=4)
        Traceback (most recent call last):
        ...
        ValueError: shard: batch['x'] has 10 rows along its leading (batch) axis (shape (10, 3)), which do not
        split evenly into n=4 instances (10 % 4 = 2). Use a batch size that is a multiple of 4 (8 or 12, say), or
        drop the last incomplete batch.
        >>> shard({"x": torch.zeros(8, 3), "y": torch.zeros(12)}, n=4)
        Traceback (most recent call last):
        ...
        ValueError: shard: the leaves of batch have different batch sizes (their leading axes), so each would be
        split its own way: batch['x'] has 8 rows (shape (8, 3)), batch['y'] has 12 rows (shape (12,)). Every leaf
        must hold the same examples along axis 0: slice them to one batch size.
    """
    n = _instances(n, "shard")
    seen: list[tuple[pytree.KeyPath, int, tuple[int, ...]]] = []

    def split(path: pytree.KeyPath, leaf: Any) -> torch.Tensor:
        x = _as_tensor(leaf, path, "shard", "batch")
        rows = _leading_axis(x, path, "shard", "batch", "batch")
        if rows % n:
            below, above = rows - rows % n, rows + n - rows % n
            suggestion = f"{below} or {above}" if below else f"{above}"
            raise ValueError(
                f"shard: {_where('batch', path)} has {rows} rows along its leading (batch) axis "
                f"(shape {tuple(x.shape)}), which do not split evenly into n={n} instances "
                f"({rows} % {n} = {rows % n}). Use a batch size that is a multiple of {n} "
                f"({suggestion}, say), or drop the last incomplete batch."
            )
        seen.append((path, rows, tuple(x.shape)))
        return x.reshape(n, rows // n, *x.shape[1:])

    out = pytree.tree_map_with_path(split, batch)
    if len({rows for _, rows, _ in seen}) > 1:
        leaves = ", ".join(f"{_where('batch', path)} has {rows} rows (shape {shape})" for path, rows, shape in seen)
        raise ValueError(
            "shard: the leaves of batch have different batch sizes (their leading axes), so each would be split its "
            f"own way: {leaves}. Every leaf must hold the same examples along axis 0: slice them to one batch size."
        )
    return out


def unshard(tree: PyTree) -> PyTree:
    """Merges the two leading axes of every leaf: ``(n, b, ...)`` -> ``(n * b, ...)``.

    The inverse of :func:`shard`: use it on per-instance outputs of a pmap (per-example
    predictions, say) to get them back in global batch order.

    Example:
        >>> import torch
        >>> from torchpmap.training import shard, unshard
        >>> x = torch.arange(12).reshape(6, 2)
        >>> torch.equal(unshard(shard(x, n=3)), x)
        True
    """

    def merge(path: pytree.KeyPath, leaf: Any) -> torch.Tensor:
        x = _as_tensor(leaf, path, "unshard", "tree")
        if x.dim() < 2:
            raise ValueError(
                f"unshard: the leaf at {_where('tree', path)} has shape {tuple(x.shape)}; it needs an "
                "instance axis and a per-instance batch axis, i.e. shape (n, b, ...)"
            )
        return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])

    return pytree.tree_map_with_path(merge, tree)


# --------------------------------------------------------------------------- prefetch

_BATCH, _END, _ERROR = "batch", "end", "error"


def _prefetch_target(n: int) -> torch.device | None:
    """The one torch device that the ``n`` instances of a default pmap run on, if there is one."""
    targets = {d.torch_device for d in _devices.local_devices()[:n]}
    return targets.pop() if len(targets) == 1 else None


def _put(q: queue.Queue[tuple[str, Any]], item: tuple[str, Any], stop: threading.Event) -> bool:
    """Puts ``item`` unless the consumer has gone away; False if it has."""
    while not stop.is_set():
        try:
            q.put(item, timeout=0.05)
            return True
        except queue.Full:
            continue
    return False


def prefetch_to_device(
    iterator: Iterable[PyTree], size: int = 2, n: int | None = None
) -> Generator[PyTree, None, None]:
    """Shards upcoming batches and moves them to the device in a background thread.

    While the training step runs on the current batch, a producer thread takes the next
    batches from ``iterator``, applies :func:`shard` to them and moves them to the device
    the instances run on, keeping at most ``size`` of them ready. Batches come out in the
    order ``iterator`` yields them.

    * An exception raised by ``iterator`` (or by :func:`shard`) in the producer is
      re-raised in the consumer, at the batch where it happened.
    * The thread stops when the consumer stops: when the returned iterator is exhausted,
      closed (``.close()``), or garbage-collected after a ``break``. It is started lazily,
      by the first ``next()``.
    * Device: when all instances run on one torch device (one GPU, or the CPU however
      many logical devices it has), the batches are moved there. On CUDA each host tensor
      is pinned and copied on a stream of the producer's own, so that the copy overlaps
      the step running on the GPU; the step's stream waits for it on the GPU, never on
      the host. When the instances span several
      torch devices, the batches stay where ``iterator`` put them and ``pmap`` moves each
      instance's slice to its device.

    Args:
        iterator: any iterable of global batches (pytrees with the batch along axis 0).
        size: how many batches to keep ready (the bound of the queue), at least 1.
        n: the number of instances to shard into; defaults to
            ``torchpmap.local_device_count()``.

    Example:
        >>> import torch
        >>> from torchpmap.training import prefetch_to_device
        >>> batches = ((torch.full((4,), float(i)), torch.arange(4)) for i in range(3))
        >>> for x, y in prefetch_to_device(batches, size=2, n=2):
        ...     print(x.tolist(), tuple(y.shape))
        [[0.0, 0.0], [0.0, 0.0]] (2, 2)
        [[1.0, 1.0], [1.0, 1.0]] (2, 2)
        [[2.0, 2.0], [2.0, 2.0]] (2, 2)
    """
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(
            f"prefetch_to_device: size must be a positive int (how many batches to keep ready), got {size!r}"
        )
    n = _instances(n, "prefetch_to_device")
    return _prefetch(iter(iterator), size, n, _prefetch_target(n))


def _prefetch(
    source: Iterator[PyTree], size: int, n: int, device: torch.device | None
) -> Generator[PyTree, None, None]:
    ready: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=size)
    stop = threading.Event()
    copies = _CudaCopies(device) if device is not None and device.type == "cuda" else None

    def produce() -> None:
        try:
            for batch in source:
                moved = shard(batch, n)
                if copies is not None:
                    moved = copies.start(moved)
                elif device is not None:
                    moved = pytree.tree_map(lambda x: x if x.device == device else x.to(device), moved)
                if not _put(ready, (_BATCH, moved), stop):
                    return
            _put(ready, (_END, None), stop)
        except BaseException as error:  # noqa: BLE001 -- handed to the consumer, which re-raises it
            _put(ready, (_ERROR, error), stop)

    producer = threading.Thread(target=produce, name="torchpmap-prefetch", daemon=True)
    producer.start()
    try:
        while True:
            kind, value = ready.get()
            if kind == _END:
                return
            if kind == _ERROR:
                raise value
            yield copies.finish(value) if copies is not None else value
    finally:
        stop.set()  # the producer sees it within one put timeout and returns


class _CudaCopies:
    """Host-to-GPU copies that overlap the step running on the GPU.

    The producer thread pins each host tensor (page-locked memory, which a copy engine
    reads without the CPU) and copies it on a stream of its own, so that the copy does not
    queue behind the kernels already on the consumer's stream; an event marks its end.
    The consumer's stream waits for that event (on the GPU, not the host) before it uses
    the batch, and the batch's memory is recorded as used on that stream, so that the
    caching allocator does not hand it out again while the step still reads it.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def start(self, tree: PyTree) -> tuple[PyTree, Any]:
        def move(x: torch.Tensor) -> torch.Tensor:
            if x.device == self.device:
                return x
            if x.device.type == "cpu" and not x.is_pinned():
                x = x.pin_memory()
            return x.to(self.device, non_blocking=True)

        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            moved = pytree.tree_map(move, tree)
            done = torch.cuda.Event()
            done.record(self.stream)
        return moved, done

    def finish(self, started: tuple[PyTree, Any]) -> PyTree:
        moved, done = started
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(done)
        for x in pytree.tree_leaves(moved):
            if isinstance(x, torch.Tensor) and x.device == self.device:
                x.record_stream(consumer)
        return moved


# --------------------------------------------------------------------------- training step


def _split_buffers(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """The model's buffers: (floating point ones, the others such as counters)."""
    floating: dict[str, torch.Tensor] = {}
    other: dict[str, torch.Tensor] = {}
    for name, b in model.named_buffers():
        (floating if b.is_floating_point() or b.is_complex() else other)[name] = b.detach()
    return floating, other


class _ModelAndLoss(torch.nn.Module):
    """The model and the loss as one module, for ``functional_call``: ``model(**inputs)``
    for a dict (a tokenizer's batch), else ``model(inputs)``, then ``loss_fn(output,
    seen_by_loss)``, all with the step's tensors in place of the model's own."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[[Any, Any], Any]):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, inputs: Any, seen_by_loss: Any) -> Any:
        output = self.model(**inputs) if isinstance(inputs, Mapping) else self.model(inputs)
        return self.loss_fn(output, seen_by_loss)


def _pair(batch: Any) -> tuple[Any, Any]:
    if isinstance(batch, (tuple, list)) and len(batch) == 2:
        return batch[0], batch[1]
    what = f"a {type(batch).__name__}" + (f" of {len(batch)} items" if isinstance(batch, (tuple, list)) else "")
    raise TypeError(
        f"data_parallel_step: step(batch) takes a pair (inputs, targets), got {what}. For another batch "
        "structure (a dict, several inputs, extra fields for the loss), pass model_inputs=lambda batch: ... "
        "to data_parallel_step; loss_fn then receives (outputs, batch)."
    )


def data_parallel_step(
    model: torch.nn.Module,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    model_inputs: Callable[[Any], Any] | None = None,
    grad_scaler: torch.amp.GradScaler | None = None,
    axis_name: AxisName = "batch",
    devices: Sequence[DeviceLike] | None = None,
    jit: bool | Mapping[str, Any] = False,
    randomness: Randomness = "different",
    has_aux: bool = False,
    shard_params: AxisName | bool | None = None,
    max_grad_norm: float | None = None,
    reshard_after_forward: bool = True,
) -> Callable[[PyTree], Any]:
    """A data-parallel training step for an ``nn.Module``, a loss and a torch optimizer.

    Returns ``step(batch) -> loss``. ``batch`` is a sharded pair ``(inputs, targets)``, each
    with shape ``(n, b, ...)`` as :func:`shard` or :func:`prefetch_to_device` make it: ``n``
    instances of ``b`` examples (``n`` may exceed the number of devices; the instances then
    run vectorized). Inputs that are a dict (a tokenizer's batch) are passed to the model as
    keyword arguments. ``step``:

    1. runs ``loss_fn(model(inputs_i), targets_i)`` and its gradient on every instance
       ``i`` inside :func:`torchpmap.pmap`, through ``torch.func.functional_call`` and
       ``torch.func.grad_and_value`` (only parameters with ``requires_grad`` get one);
       In one process (eager on any number of devices, ``jit=True`` on one;
       ``randomness`` not ``"per_instance"``, no enabled GradScaler, and
       ``torchpmap.config.bitwise_placement`` off) the gradient is instead taken
       outside the map, of the mean of the instances' losses, by
       ``torch.autograd.grad`` (on several devices each device's contribution is added
       in the devices' order): the same gradient (to rounding), with each weight's
       gradient one product over every example of a device as in plain PyTorch on the
       whole batch, instead of one per instance and their mean (measured on the 2-core
       CPU machine, otherwise idle, with a 64-256-256-10 MLP of 8 instances: 1.88-1.89x
       plain PyTorch's step before, 1.60-1.65x after, 1.44-1.48x with ``torch.autograd.grad``;
       see ``docs/performance.md``);
    2. averages gradients and losses over ``axis_name`` with :func:`torchpmap.pmean`
       (``out_axes=None``: they come back once); across processes, large gradients are
       all-reduced bucket by bucket while the backward still runs, as DDP does
       (``torchpmap.config.bucket_bytes``; same result as ``pmean``, see
       ``docs/multiprocess.md``);
    3. with an optimizer, writes the averaged gradients into ``p.grad`` (replacing what
       was there, so no ``zero_grad()`` is needed) and calls ``optimizer.step()``: the
       optimizer and its state (momentum, Adam moments, schedulers) work unchanged.
       Without one (``optimizer=None``), it *adds* them to ``p.grad``, as
       ``loss.backward()`` does, and steps nothing: clip, accumulate over micro-batches,
       scale or skip the step yourself, exactly as with DDP;
    4. returns the averaged loss, a detached scalar tensor (with ``has_aux=True``,
       ``loss_fn`` returns ``(loss, aux)``, ``aux`` any pytree of tensors such as
       metrics, and the step returns ``(loss, aux)`` with ``aux`` averaged over every
       instance as the loss is, in the same exchange).

    As after ``loss.backward()`` in plain PyTorch, a parameter that the loss does not
    reach (an unused branch of the model) gets no gradient: with an optimizer its
    ``p.grad`` is None after the step (so that ``AdamW`` neither decays nor moves it),
    without one it is left as it was. Every instance must reach the same parameters
    (the same program on every instance); processes that reach different ones raise. A
    loss that reaches none of the parameters, and an optimizer that holds none of the
    model's parameters, are errors: such a step could change nothing.

    Across processes (``torchrun``), the first call first copies process 0's parameters
    and buffers into every process, as ``DistributedDataParallel`` does when it wraps
    the model, so that processes that built their models from different random seeds
    train one model (``torchpmap.distributed.broadcast``).

    Any other batch structure: pass ``model_inputs``, a function from one instance's
    batch (any pytree, every leaf sharded as above) to the model's inputs (a dict for
    keyword arguments); ``loss_fn`` then receives ``(outputs, batch)``, the whole batch,
    for auxiliary losses, multi-output models or extra fields.

    For a mean-reduced loss and equal shards the update equals the one a single process
    takes on the whole batch (when nothing else depends on the split, see below).

    What behaves as on separate devices:

    * **Buffers** (batch-norm running statistics): each instance updates its own copy from
      its own shard, exactly as one replica per device would. After the step, floating
      point buffers are set to their mean over the instances where any instance changed
      them (a running maximum that starts at ``-inf`` ends at the mean of the instances'
      maxima); elements that no instance changed keep their bits. The
      mean keeps every replica's statistics instead of those of one shard: a running mean
      becomes exactly the full-batch running mean (the mean of equal shards' means is the
      full mean); a running variance becomes the mean of the per-shard variances, which
      leaves out the spread between shard means (what ``SyncBatchNorm`` would include).
      Other buffers (``num_batches_tracked``) change the same way on every instance;
      instance 0's value is kept. In train mode, batch norm normalizes with the
      statistics of the instance's own shard, so gradients differ from a single process
      on the whole batch, as with one replica per device.
    * **Randomness** (dropout): every instance draws its own dropout mask, as separate
      devices would; results are reproducible under ``torch.manual_seed`` but are not the
      masks a single-process run would draw. With the default ``randomness="different"``
      the masks also depend on the placement (one device, several, processes); with
      ``randomness="per_instance"`` each instance draws from its own stream and the
      masks, hence the whole training run, are the same on every placement (a Python hop
      per torch call: see ``docs/device-threads.md``; not with ``jit=True``).
    * ``model.train()`` / ``model.eval()`` are respected: in eval mode dropout is off
      and batch norm uses (and does not update) its running statistics.
    * **Devices**: with several devices, each device's instances run in a thread of
      their own, and the threads take turns between collectives, so ``model`` itself is
      used by all of them (``functional_call`` swaps the tensors in and out within one
      turn): every change to it (hooks, train/eval mode, dropout probability) is seen.
      With ``jit=True`` a change of a module's mode, plain attributes (numbers,
      strings, booleans) or forward hooks traces the step anew; other Python state the
      forward reads is kept as traced (see docs/from-jax.md).

    Args:
        model: the module; its parameters and buffers are read at every step, so the
            step always uses the current values.
        loss_fn: ``loss_fn(model_output, targets) -> scalar``, e.g.
            ``torch.nn.functional.cross_entropy`` (``loss_fn(model_output, batch)`` with
            ``model_inputs``). Use a mean over the examples. It may call ``model`` again
            (a consistency term): that call is differentiated too, as in plain PyTorch.
        optimizer: a ``torch.optim`` optimizer over ``model``'s parameters, or None to
            only accumulate the averaged gradients into ``p.grad``.
        model_inputs: ``model_inputs(batch) -> inputs`` for a batch that is not an
            ``(inputs, targets)`` pair (see above).
        grad_scaler: a ``torch.amp.GradScaler`` for float16 autocast: the gradients are
            those of the scaled loss (the returned loss is not scaled); with an
            optimizer, the step calls ``grad_scaler.step(optimizer)`` (which skips a step
            whose gradients hold inf/NaN) and ``grad_scaler.update()``; without one, call
            them yourself, as with DDP.
        axis_name: the name of the mapped axis that the averages run over.
        devices: passed to :func:`torchpmap.pmap` (default: all local devices).
        jit: passed to :func:`torchpmap.pmap`: compile the per-instance step (forward,
            gradient and averages) with ``torch.compile`` (see ``pmap``). Dropout then
            draws from the compiled code's random generator (on one device, in each
            process, and on several devices in one process, where each device's program
            draws from its device thread's own stream).
        has_aux: ``loss_fn`` returns ``(loss, aux)``; the step returns ``(loss, aux)``
            with ``aux`` averaged over every instance (as ``torch.func.grad``'s
            ``has_aux``; Flax's steps return their ``pmean``'d metrics this way).
        shard_params: ``True`` or the step's ``axis_name``: ZeRO-3 / FSDP, see below.
            None or False (the default): every instance uses the module's parameters.
        max_grad_norm: with an optimizer, clip the averaged gradients to this global
            L2 norm before the optimizer steps, as ``torch.nn.utils.clip_grad_norm_``
            over every parameter does (with ``grad_scaler``, after
            ``grad_scaler.unscale_(optimizer)``, as PyTorch's AMP recipe clips). Sharded
            or not, the norm is that of the whole gradient (with ``shard_params``, the
            rows' squared norms are summed over every instance, across devices and
            processes). Without an optimizer, clip ``p.grad`` yourself.
        reshard_after_forward: with ``shard_params``, whether each layer lets its
            gathered weights go after its forward and gathers them again for its
            backward (True, the default: the least memory, as FSDP2's option of that
            name), or every parameter is gathered once, before the forward, and kept
            for the backward (False: fewer, larger exchanges and no layer run twice;
            the whole weights live through the step).

    **Sharded parameters** (``shard_params=True``): every parameter that requires grad
    is flattened, zero-padded to ``N * s`` elements (``s = ceil(numel / N)``, ``N`` the
    instances of every process) and split into ``N`` rows; instance ``i`` holds row
    ``i``, and each device the rows of its own instances (a flat layout, as ZeRO-3's and
    FSDP's flat parameters: any shape, any ``N``). In a step each of PyTorch's own layers
    (``Linear``, ``Conv*d``, ``ConvTranspose*d``, ``Bilinear``, ``Embedding``,
    ``LayerNorm``, ``GroupNorm``, ``RMSNorm``) gathers its rows (an ``all_gather``) as
    it runs and lets the gathered weight go after it; its backward gathers them again
    and runs the layer once more (activation checkpointing of that layer). The other
    trained parameters are gathered before the forward. The step differentiates with
    respect to the rows: ``all_gather``'s transpose is ``psum_scatter``, so each
    instance receives its row of the averaged gradient, and the optimizer steps the
    rows. Between steps each device holds ``1/N`` of the parameters, their gradients
    and the optimizer's state (plus the last row's padding); during a step, besides
    that, the gradient's rows and one layer's weight and gradient at a time (and the
    activations); ``reshard_after_forward=False`` gathers every parameter once, before
    the forward, instead (faster, the whole weights held through the step). The weights
    equal the replicated step's to rounding. What changes:

    * the returned step is a :class:`ShardedStep` (``torchpmap.training.ShardedStep``);
      after its first call the module's trained parameters are *emptied* (0 elements,
      the same ``Parameter`` objects; calling the model raises, naming the fix) and
      ``step.gather_params()`` writes their whole values back, e.g. to evaluate or save
      ``model.state_dict()``; the next call takes them, with any change, back into its
      rows. ``step.bytes_per_device()`` counts what each device holds;
    * the optimizer is moved onto the rows (each parameter replaced in its param groups
      by its per-device pieces, existing state split likewise): schedulers and
      ``grad_scaler`` work unchanged (across processes, an inf or NaN in any process'
      rows skips the step on every process), and ``optimizer.state_dict()`` is the
      sharded state. Only optimizers whose update is elementwise step correctly on
      rows: exactly ``SGD``, ``Adam``, ``AdamW``, ``Adagrad``, ``Adadelta``, ``Adamax``,
      ``ASGD``, ``NAdam``, ``RAdam``, ``RMSprop`` and ``Rprop``; any other (``LBFGS``, a
      subclass) is refused with a ``TypeError``;
    * an optimizer is required (the step applies the split gradients itself); clip
      with ``max_grad_norm``; every batch must have the first call's number of instances.

    Example:
        >>> import torch
        >>> from torchpmap.training import data_parallel_step, shard
        >>> _ = torch.manual_seed(0)
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.Adam(model.parameters(), lr=0.1)
        >>> step = data_parallel_step(model, torch.nn.functional.mse_loss, opt)
        >>> x = torch.randn(32, 2); y = x @ torch.tensor([[2.], [-1.]]) + 0.5
        >>> losses = [step(shard((x, y), n=4)).item() for _ in range(200)]
        >>> losses[-1] < 1e-3 < losses[0]
        True
        >>> [round(v, 2) for v in model.weight.flatten().tolist()], round(model.bias.item(), 2)
        ([2.0, -1.0], 0.5)
    """

    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"data_parallel_step: model must be a torch.nn.Module, got {type(model).__name__}. For a plain "
            "function of parameters, write the step with torchpmap.pmap and torch.func.grad (see the "
            "data-parallel guide)."
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"data_parallel_step: optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )
    if not callable(loss_fn):
        raise TypeError(f"data_parallel_step: loss_fn must be callable, got {type(loss_fn).__name__}")
    Tensors = dict[str, torch.Tensor]

    if grad_scaler is not None and not isinstance(grad_scaler, torch.amp.GradScaler):
        raise TypeError(
            f"data_parallel_step: grad_scaler must be a torch.amp.GradScaler or None, got {type(grad_scaler).__name__}"
        )
    if optimizer is not None:
        _check_optimizer_holds_the_model(model, optimizer)
    sharded_axis = _sharded_axis(shard_params, axis_name, optimizer)
    if reshard_after_forward is not True and sharded_axis is None:
        raise ValueError(
            f"data_parallel_step: reshard_after_forward={reshard_after_forward!r} is an option of the sharded "
            "step; without shard_params every instance holds the whole parameters. Pass shard_params=True too, "
            "or leave reshard_after_forward out."
        )
    _check_max_grad_norm(max_grad_norm, optimizer)

    stateful = recurrent.modules_needing_state(model)
    with_loss = _ModelAndLoss(model, loss_fn)

    def run_model(
        params: Tensors, frozen: Tensors, floating: Tensors, other: Tensors, batch: Any,
        module: torch.nn.Module | None = None,
    ) -> tuple[torch.Tensor, PyTree, Tensors]:
        """One instance's loss (and aux) and its own copy of the buffers after the forward.
        The copy is made inside the transform that calls this, so that modules may update
        it in place (batch norm does). RNNs called without a state get one of zeros
        batched like their input (see torchpmap._engines.recurrent). ``module``: the
        model and loss as one module (a sharded step's shadow of it), by default
        ``with_loss``."""
        inputs, seen_by_loss = (model_inputs(batch), batch) if model_inputs is not None else batch
        state = {k: v.clone() for k, v in {**floating, **other}.items()}
        tensors = {f"model.{k}": v for k, v in {**params, **frozen, **state}.items()}
        target = with_loss if module is None else module
        # functional_call leaves a module that sits at two paths (one nn.Linear used twice
        # in a Sequential) holding the swapped-in tensor: its slots are put back after
        held = [(m, dict(m._parameters), dict(m._buffers)) for m in target.modules()]
        try:
            with recurrent.zero_states_supplied(stateful):
                # the loss runs with the model's tensors swapped in too: a loss_fn that calls
                # the model again (a consistency term) is differentiated through both calls
                out = functional_call(target, tensors, (inputs, seen_by_loss))
        finally:
            for m, own_params, own_buffers in held:
                m._parameters.update(own_params)
                m._buffers.update(own_buffers)
        loss, aux = _loss_and_aux(out, has_aux)
        return loss, aux, state

    def instance_step(
        params: Tensors, frozen: Tensors, floating: Tensors, other: Tensors, batch: Any, scale: torch.Tensor | None
    ) -> tuple[Tensors, torch.Tensor, buffer_means.Sent, Tensors, PyTree]:
        # Across processes (one instance each), the gradients' all-reduce starts bucket by
        # bucket while the backward runs, as DDP's; elsewhere this is pmean.
        grad_mean = GradientMean(axis_name)
        reached: list[str] = []  # the parameters the loss depends on, in the model's order

        def loss_of(params: Tensors) -> tuple[torch.Tensor, tuple[Tensors, torch.Tensor, PyTree]]:
            loss, aux, state = run_model(grad_mean.watch(params), frozen, floating, other, batch)
            reached.extend(_reached(loss, params))
            if grad_mean.buckets:
                # Bucketed gradients: the loss and buffer means start now, with the buckets'
                # agreement, and travel while the backward runs (the processes meet only
                # at the buckets' waits). Which parameters get a gradient is part of what
                # the processes agree on.
                unused = [k for k in params if k not in reached]
                grad_mean.average_later(
                    [loss.detach(), *pytree.tree_leaves(buffer_means.sent(state, floating)),
                     *(a.detach() for a in pytree.tree_leaves(aux))],
                    note=f"; parameters the loss does not reach: {unused}" if unused else "",
                )
            return (loss if scale is None else loss * scale), (state, loss, aux)

        grads, (_, (state, loss, aux)) = instance_grad_and_value(loss_of, params)
        counters = {k: state[k] for k in other}
        if grad_mean.buckets:  # the gradients are on their way already, bucket by bucket
            grads = grad_mean(grads)
            loss, *means = grad_mean.averages()
            buffer_change = {k: (means[2 * i], means[2 * i + 1]) for i, k in enumerate(floating)}
            aux = pytree.tree_unflatten(means[2 * len(floating):], pytree.tree_flatten(aux)[1])
            grads = {k: grads[k] for k in reached}
        else:  # one pmean of everything: across devices or processes, one exchange instead of three
            buffer_change = buffer_means.sent(state, floating)
            grads = {k: grads[k] for k in reached}  # as after loss.backward(): none for the others
            if has_aux:
                grads, loss, buffer_change, aux = pmean((grads, loss, buffer_change, aux), axis_name)
            else:
                grads, loss, buffer_change = pmean((grads, loss, buffer_change), axis_name)
        return grads, loss, buffer_change, counters, aux

    # Floating buffers are mapped (one copy per instance, updated separately); the
    # others are broadcast: an in-place update must be the same on every instance.
    p_step = pmap(
        instance_step,
        axis_name=axis_name,
        in_axes=(None, None, 0, None, 0, None),
        out_axes=None,
        devices=devices,
        jit=jit,
        randomness=randomness,
    )

    # One process (eager on any number of devices, jit on one): the gradient is taken outside
    # the map, of the mean loss, so that each weight's gradient is one product over every
    # example of a device (as in plain PyTorch on the whole batch) instead of one per
    # instance and their mean. On several devices each device's slice reads views of its
    # own, whose gradients are added in the devices' order (see DeviceParams).
    sliced: list[DeviceParams | None] = [None]  # the present call's, on several devices

    def instance_loss(
        params: Tensors, frozen: Tensors, floating: Tensors, other: Tensors, batch: Any
    ) -> tuple[torch.Tensor, tuple[buffer_means.Sent, Tensors, PyTree]]:
        per_device = sliced[0]
        if per_device is not None:
            params = per_device.own(params)
        loss, aux, state = run_model(params, frozen, floating, other, batch)
        buffer_change = buffer_means.sent(state, floating)
        aux = pytree.tree_map(lambda a: a.detach(), aux)
        if has_aux:
            buffer_change, aux = pmean((buffer_change, aux), axis_name)
        else:
            buffer_change = pmean(buffer_change, axis_name)
        return loss, (buffer_change, {k: state[k].detach() for k in other}, aux)

    p_loss = pmap(
        instance_loss,
        axis_name=axis_name,
        in_axes=(None, None, 0, None, 0),
        out_axes=(0, None),
        devices=devices,
        jit=jit,
        randomness=randomness,
    )

    def folded_step(
        params: Tensors, frozen: Tensors, floating: Tensors, other: Tensors, batch: Any, scale: torch.Tensor | None
    ) -> tuple[Tensors, torch.Tensor, buffer_means.Sent, Tensors, PyTree]:
        reached: list[str] = []

        def mean_loss(
            params: Tensors,
        ) -> tuple[torch.Tensor, tuple[torch.Tensor, tuple[buffer_means.Sent, Tensors, PyTree]]]:
            losses, rest = p_loss(params, frozen, floating, other, batch)
            loss = losses.mean()
            reached.extend(_reached(loss, params))
            return (loss if scale is None else loss * scale), (loss.detach(), rest)

        # Plain autograd, not torch.func.grad: under a grad transform, ops whose backward
        # kernel is not itself differentiable run their differentiable math instead
        # (the float32 nn.LSTM's mkldnn backward: step by step, ~6x plain PyTorch's step).
        leaves = {k: p.detach().requires_grad_() for k, p in params.items()}
        per_device = DeviceParams() if len(devices if devices is not None else _devices.devices()) > 1 else None
        sliced[0] = per_device
        try:
            with torch.enable_grad():
                objective, (loss, (buffer_change, counters, aux)) = mean_loss(leaves)
                if per_device is not None:
                    grads = per_device.gradients(objective, reached, leaves)
                else:
                    # allow_unused: a compiled forward's node lists every parameter it was given
                    taken = torch.autograd.grad(objective, [leaves[k] for k in reached], allow_unused=True)
                    grads = dict(zip(reached, taken))
        finally:
            sliced[0] = None
        found = {k: g for k, g in grads.items() if g is not None}  # as after loss.backward()
        return found, loss, buffer_change, counters, aux

    def folds() -> bool:
        """Whether this call takes the one-device step: decided at the call, where pmap
        resolves the devices it runs on (an enclosing device thread may pin them).

        Not under an enabled GradScaler: the scaled float16 backward overflows (and the
        scaler skips the step) by the size of its products, which the fold changes (one
        product of the mean over every sample, where the other placements take each
        instance's scaled loss, as DDP's ranks do): one device would skip other steps
        than two devices or two processes.

        Not for a model with an ``nn.Embedding(scale_grad_by_freq=True)``: its gradient
        divides by how often each index occurs, which over all samples at once (the fold)
        counts the other instances' occurrences too, where each instance (and DDP's
        ranks) counts its own."""
        if randomness == "per_instance" or config.bitwise_placement or _devices.process_count() != 1:
            return False
        if grad_scaler is not None and grad_scaler.is_enabled():
            return False
        if jit and len(devices if devices is not None else _devices.devices()) != 1:
            return False
        return not _counts_index_frequencies(model)  # last: it walks the model's modules

    started = [False]  # across processes: process 0's parameters and buffers copied at the first call

    def start() -> None:
        if not started[0]:
            _start_from_process_zero(model, axis_name)
            started[0] = True

    def prepare(batch: PyTree) -> tuple[PyTree, int]:
        """The batch as the instances take it, and its number of instances."""
        if torch.is_inference_mode_enabled():
            raise RuntimeError(
                "data_parallel_step: called under torch.inference_mode(), where no gradient can be taken. A "
                "training step takes gradients: call it outside inference_mode; to evaluate, "
                "call the model itself, or a pmap of it, under inference_mode."
            )
        _refuse_backward_hooks(model)
        if model_inputs is None:
            batch = _pair(batch)
        leaves = pytree.tree_leaves(batch)
        if not leaves or not isinstance(leaves[0], (torch.Tensor, ShardedTensor)):
            raise TypeError(
                "data_parallel_step: the batch holds no tensors; shard it first, e.g. torchpmap.training.shard(batch)"
            )
        return batch, leaves[0].shape[0]

    def write_buffers(means: buffer_means.Sent, counters: Tensors, floating: Tensors) -> None:
        for k, mean in means.items():
            buffer_means.write(model.get_buffer(k), mean)
        for k, value in counters.items():
            model.get_buffer(k).copy_(value)

    if sharded_axis is not None:
        assert optimizer is not None  # checked by _sharded_axis
        return ShardedStep(
            model, optimizer, grad_scaler, run_model=run_model, module=with_loss, prepare=prepare, start=start,
            write_buffers=write_buffers, split_buffers=lambda: _split_buffers(model), axis_name=sharded_axis,
            devices=devices, jit=jit, randomness=randomness, has_aux=has_aux, max_grad_norm=max_grad_norm,
            reshard_after_forward=reshard_after_forward,
        )

    def step(batch: PyTree) -> Any:
        start()
        batch, n = prepare(batch)
        named = dict(model.named_parameters())
        params = {k: p.detach() for k, p in named.items() if p.requires_grad}
        frozen = {k: p.detach() for k, p in named.items() if not p.requires_grad}
        floating, other = _split_buffers(model)
        per_instance = {k: b.unsqueeze(0).expand(n, *b.shape) for k, b in floating.items()}
        scale = None
        if grad_scaler is not None and grad_scaler.is_enabled():
            scale = grad_scaler.scale(torch.ones((), device=next(iter(named.values())).device))  # the current scale
        run = folded_step if folds() else p_step
        if run is p_step:
            sparse_gradients.refuse(model)
        try:
            with instance_autograd.checked_by_caller():  # prepare refused them
                grads, loss, buffer_change, counters, aux = run(params, frozen, per_instance, other, batch, scale)
        except SharedWrite as refused:
            _explain_model_write(refused)
            raise
        with torch.no_grad():
            if optimizer is not None:  # frozen since an earlier step: no gradient, as after zero_grad()
                for k in frozen:
                    named[k].grad = None
            for k in params:
                if k not in grads:  # the loss does not reach it: no gradient, as after loss.backward()
                    if optimizer is not None:
                        named[k].grad = None
                    continue
                g, grad = grads[k].to(named[k].device), named[k].grad
                if optimizer is None and grad is not None:
                    grad.add_(g)  # accumulate, as loss.backward() does
                else:
                    named[k].grad = g
            write_buffers(buffer_change, counters, floating)
        if optimizer is not None and max_grad_norm is not None:
            if grad_scaler is not None:
                grad_scaler.unscale_(optimizer)  # clip the true gradients (PyTorch's AMP recipe)
            torch.nn.utils.clip_grad_norm_([named[k] for k in params], max_grad_norm)
        if optimizer is not None and grad_scaler is not None:
            grad_scaler.step(optimizer)
            grad_scaler.update()
        elif optimizer is not None:
            optimizer.step()
        if has_aux:
            return loss.detach(), pytree.tree_map(lambda a: a.detach(), aux)
        return loss.detach()

    return step


def _refuse_backward_hooks(model: torch.nn.Module) -> None:
    """Raises NotImplementedError when a module of ``model`` (or every module) has a
    backward hook. The step differentiates with torch.func, whose transforms run no module
    backward hook: on one device the hooks were silently never called, on several devices
    torch raised about ``setup_context``. Checked at every step (a hook may come later)."""
    for name, module in model.named_modules():
        if instance_autograd.has_backward_hooks(module):
            kinds = [kind for kind, hooks in (("backward hook", module._backward_hooks),
                                              ("backward pre-hook", module._backward_pre_hooks)) if hooks]
            where = f"the module at {name!r}" if name else "the model"
            raise NotImplementedError(
                f"data_parallel_step: {where} ({type(module).__name__}) has "
                f"a {' and a '.join(kinds)} (register_full_backward_hook, register_backward_hook or "
                "register_full_backward_pre_hook). The step takes its gradients with torch.func, which runs no "
                "module backward hook, so the hook would never be called. Remove the hook (its handle's .remove()) "
                "before the step; to look at the gradients, read the parameters' .grad after step(batch), or use "
                "a forward hook on the outputs."
            )
    if private.global_backward_hooks():
        raise NotImplementedError(
            "data_parallel_step: a backward hook is registered for every module "
            "(torch.nn.modules.module.register_module_full_backward_hook or ..._pre_hook). The step takes its "
            "gradients with torch.func, which runs no module backward hook, so the hook would never be called. "
            "Remove it (its handle's .remove()) before the step, or read the parameters' .grad after step(batch)."
        )


def _sharded_axis(
    shard_params: AxisName | bool | None, axis_name: AxisName, optimizer: torch.optim.Optimizer | None
) -> AxisName | None:
    """The axis that ``shard_params`` splits the parameters over (None: replicated), checked."""
    if shard_params is None or shard_params is False:
        return None
    if shard_params is not True and shard_params != axis_name:
        raise ValueError(
            f"data_parallel_step: shard_params={shard_params!r} names another axis than the step's axis_name="
            f"{axis_name!r}. The parameters are split over the data axis that the step maps and averages over "
            f"(ZeRO-3, FSDP): pass shard_params=True or shard_params={axis_name!r}. To split weights over a model "
            "axis (tensor parallelism), write the step with torchpmap.shard_map."
        )
    if optimizer is None:
        raise ValueError(
            f"data_parallel_step: shard_params={shard_params!r} needs an optimizer: the gradients come back split "
            "like the parameters, and the step applies them to the shards itself. For gradients in p.grad (to "
            "clip, accumulate or step yourself), leave shard_params out."
        )
    check_elementwise(optimizer, f"data_parallel_step(shard_params={shard_params!r})")
    return axis_name


def _check_max_grad_norm(max_grad_norm: float | None, optimizer: torch.optim.Optimizer | None) -> None:
    """Raises unless ``max_grad_norm`` is None, or a positive number with an optimizer."""
    if max_grad_norm is None:
        return
    if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, (int, float)) or not max_grad_norm > 0:
        raise ValueError(
            f"data_parallel_step: max_grad_norm={max_grad_norm!r} must be a positive number (the largest L2 norm "
            "of the whole gradient, e.g. 1.0), or None for no clipping"
        )
    if optimizer is None:
        raise ValueError(
            f"data_parallel_step: max_grad_norm={max_grad_norm!r} clips the gradients before the optimizer steps, "
            "but optimizer=None: the step only adds the gradients into p.grad. Clip them yourself "
            "(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)) before your optimizer.step(), or pass "
            "the optimizer."
        )


def _check_optimizer_holds_the_model(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Raises unless ``optimizer`` holds at least one of ``model``'s parameters, and no
    trainable tensor that is not one of them: the step differentiates the model's
    parameters only, so such a tensor (a learnable temperature that ``loss_fn`` uses)
    would never get a gradient and never train."""
    mine = {id(p) for p in model.parameters()}
    held = [p for group in optimizer.param_groups for p in group["params"]]
    if not any(id(p) in mine for p in held):
        raise ValueError(
            f"data_parallel_step: the optimizer holds none of the model's parameters ({len(held)} tensors of its own, "
            f"{len(mine)} in the model), so the step would never change the model. Build it over this model's "
            "parameters, e.g. torch.optim.SGD(model.parameters(), ...), after moving the model to its device "
            "(.to() on a parameter that changes device makes a new tensor)."
        )
    outside = [p for p in held if id(p) not in mine and p.requires_grad]
    if outside:
        shapes = first_few([str(tuple(p.shape)) for p in outside])
        raise ValueError(
            f"data_parallel_step: the optimizer also holds {len(outside)} trainable tensor(s) that are not parameters "
            f"of the model (shapes {shapes}). The step differentiates the model's parameters only, so they would "
            "never get a gradient and never train. Make them parameters of the model (e.g. model.temperature = "
            "torch.nn.Parameter(...), used by loss_fn through the model), or give them an optimizer and a step of "
            "their own."
        )


def _loss_and_aux(out: Any, has_aux: bool) -> tuple[torch.Tensor, PyTree]:
    """``loss_fn``'s result as (loss, aux), checked."""
    if not has_aux:
        return _scalar_loss(out), ()
    if not (isinstance(out, tuple) and len(out) == 2):
        what = f"a {type(out).__name__}" + (f" of {len(out)} items" if isinstance(out, (tuple, list)) else "")
        raise TypeError(
            f"data_parallel_step(has_aux=True): loss_fn must return a pair (loss, aux), got {what}. Return the "
            "auxiliary values (metrics) as the second item, or drop has_aux=True."
        )
    loss, aux = out
    for path, leaf in pytree.tree_leaves_with_path(aux):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"data_parallel_step(has_aux=True): the auxiliary value at aux{pytree.keystr(path)} is of type "
                f"{type(leaf).__name__} ({leaf!r}); aux must be a pytree of tensors (they are averaged over the "
                "instances): wrap numbers with torch.tensor(...)"
            )
    return _scalar_loss(loss), aux


def _scalar_loss(loss: Any) -> torch.Tensor:
    """An instance's loss: a tensor of one number, of any shape (as ``loss.backward()``
    takes it), as a scalar. One device took the mean of every element of a loss of
    several (a ``reduction="none"`` loss, or ``torch.stack([ce, penalty])``: their mean,
    not their sum), where several devices raised."""
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss.reshape(()) if loss.dim() else loss
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(
            f"data_parallel_step: loss_fn must return a scalar tensor for each instance's shard, got {got}. "
            "Reduce it inside loss_fn (.mean() or .sum() of a reduction='none' loss; the sum of several terms)."
        )
    return loss


def _explain_model_write(refused: SharedWrite) -> None:
    """Adds to ``refused`` what it means in a ``data_parallel_step``, where the shared
    arguments are the model's own parameters and buffers, and what to do."""
    for argument, what in (("params", "trained parameter"), ("frozen", "frozen parameter"), ("other", "buffer")):
        prefix = f"argument {argument!r}"
        if refused.argument.startswith(prefix) and hasattr(refused, "add_note"):  # Python >= 3.11
            where = refused.argument[len(prefix):].removeprefix(" at ")
            refused.add_note(
                f"torchpmap: in data_parallel_step, that is the model's {what} {where}: its forward writes into it "
                "in place (nn.Embedding(max_norm=...) renormalizes the rows it looks up, for one), and every "
                "instance of the step shares the model's tensors. Do that write outside the step (before calling "
                "it, under torch.no_grad()), or compute the new value in the forward without writing it (e.g. "
                "F.embedding on a renormalized copy of the weight). The model's tensors may hold the write."
            )
            return


def _counts_index_frequencies(model: torch.nn.Module) -> bool:
    """Whether an embedding of ``model`` scales its gradient by its indices' frequencies
    in the batch (``scale_grad_by_freq``), which the one-device fold would count over every
    instance's batch."""
    return any(isinstance(m, torch.nn.Embedding) and m.scale_grad_by_freq for m in model.modules())


def _start_from_process_zero(model: torch.nn.Module, axis_name: Hashable) -> None:
    """Across processes: copies process 0's parameters and buffers into this process'
    model, in place (as DDP does when it wraps a model); a no-op in one process."""
    from torchpmap import distributed as _distributed

    if _devices.process_count() == 1:
        return
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    first = _distributed.broadcast({k: t.detach() for k, t in tensors.items()}, axis_name=axis_name)
    with torch.no_grad():
        for k, t in tensors.items():
            t.copy_(first[k])
