"""The process exchange: one process' door to the other processes' slices of a split axis.

The engine across processes (:mod:`torchpmap._engines.multi_process`) runs this process'
slice of the axis; a :class:`ProcessExchange` gathers every process' slice for a
collective (:func:`torchpmap._collectives.binding.run_owning` then runs the same math as a
single process would on the whole axis, so forward results are bitwise those of one
process), or sums each process' partial sums in an all-reduce.

The exchange is differentiable: its ``*_with_grad`` methods are autograd Functions
(backward: every process' cotangent for this slice, summed, via all_to_all; the sum's
transpose is the same sum), so ``.backward()`` across processes and the gradient
conventions of the collectives (psum transposes to psum, ...) hold; its ``*_no_grad``
methods are the transfers themselves. A collective over a pytree moves all its leaves in
one transfer each way (packed as bytes): a data-parallel step makes one all-gather for the
``pmean`` of its gradients, not one per parameter. Every transfer carries the processes'
agreement (:mod:`torchpmap._engines.process_agreement`), and every wait goes through
:func:`torchpmap._state.process_group.wait`, which turns a failed or dead peer into an
error naming its rank instead of a hang.
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Hashable, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist

from torchpmap._engines import process_agreement as agreement
from torchpmap._engines.process_exchange_rules import (
    by_dtype,
    differentiable,
    split_flat,
    sums_by_all_reduce,
    transpose_gather,
)
from torchpmap._state import process_group as pg
from torchpmap._state.axis_env import Exchange
from torchpmap._state.faults import ExchangeMismatch, SizeMismatch


@dataclasses.dataclass(eq=False)
class ProcessExchange:
    """One process' door to the other processes' slices of a split axis.

    Every transfer is checked before its payload is used: each process' header (a digest
    of what it is doing, the pmap call and transfer, its local size and payload size)
    travels with or before its payload, and every process compares all of them (see
    :mod:`torchpmap._engines.process_agreement`). So processes that reach an exchange with
    different dtypes, shapes, collectives or parameters (a ``ppermute`` perm), or out of
    step, all raise the same :class:`ExchangeMismatch` (naming every side) instead of
    computing on each other's bytes, and payloads of different byte counts never reach
    gloo or NCCL (which would abort the process). Different local sizes raise
    :class:`SizeMismatch`. A call without transfers compares headers at its end
    (:meth:`settle`).

    Attributes:
        group: the process group of the axis (None: all processes).
        index: this process' position in the group (its coordinate along the axis).
        size: the number of processes in the group.
        label: how error messages name the group.
        call: the number of the pmap call this exchange serves (:attr:`ProcessState.calls`).
        local_size: this process' number of instances in the call.
        axis_name: the call's axis name, for messages.
        program: the call's ``(digest, description)`` (``MappedCall.program``): headers
            carry the digest, errors the description.
        transfers: how many transfers the call has made so far (headers carry it).
        pending: sums agreed on in :meth:`sums_in_order` whose headers have not
            travelled yet.
        posted: a gather on its way, not waited for yet (:meth:`post_gather`).
        posted_result: its stacks, once waited for.
    """

    group: Any
    index: int
    size: int
    label: str
    call: int = 0
    local_size: int = 0
    axis_name: Hashable = None
    program: tuple[int, str] | None = None
    transfers: int = 0
    pending: _Agreement | None = None
    posted: _Posted | None = None
    posted_result: list[torch.Tensor] | None = None

    #: A reduction sends each process' own partial result, not all its instances' values
    #: (see torchpmap._collectives.binding.run_owning): traffic independent of the local size.
    reduces_locally = True

    #: :meth:`sums_in_order` sums start and run while computation goes on (gradient buckets, in the backward).
    starts_sums = True

    def settle(self) -> None:
        """At the end of a call that made no transfer: the processes compare headers
        (local sizes, and that none of them made a transfer this one did not)."""
        self.settle_posted()
        if self.transfers == 0:
            self._transfer("end", "the end of the pmap call", None, None)

    def all_gather_with_grad(self, ts: Sequence[torch.Tensor], what: str, partial: bool = False) -> list[torch.Tensor]:
        """For each ``ts[k]``: every process' value stacked along a new dim 0 (in group
        order), all tensors in one transfer. ``partial``: the values are this process'
        partial results, shaped independently of its local size.

        Differentiable: the gradient of ``ts[k]`` is the sum of every process' cotangent
        for this process' entry of stack ``k`` (all tensors again in one transfer).
        """
        return list(_GatherProcesses.apply(self, what, partial, *ts))

    def all_gather_no_grad(self, ts: Sequence[torch.Tensor], what: str, partial: bool = False) -> list[torch.Tensor]:
        """``all_gather_with_grad`` without autograd: one all-gather of every tensor's bytes."""
        layout = _Layout.of(ts)
        return layout.unpack(self._transfer("gather" if partial else "gather-all", what, layout, ts))

    def sum_with_grad(self, ts: Sequence[torch.Tensor], what: str) -> list[torch.Tensor] | None:
        """For each ``ts[k]`` (this process' partial sum): the sum over the processes, by one
        all-reduce per dtype, the same bits in every process; None when ``ts`` is too small
        for that to pay (see :func:`~torchpmap._engines.process_exchange_rules.sums_by_all_reduce`):
        the caller then gathers the partials. Differentiable: the gradient of a partial sum
        is the sum of every process' cotangent (the same all-reduce)."""
        if not sums_by_all_reduce(ts):
            return None
        return list(_SumProcesses.apply(self, what, *ts))

    def sum_no_grad(self, ts: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
        """:meth:`sum_with_grad` without autograd."""
        return split_flat(ts, self.sum_no_grad_flat(ts, what))

    def sum_no_grad_flat(self, ts: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
        """The sums of :meth:`sum_no_grad` as the flat buffers the all-reduces filled, one per
        dtype (:func:`~torchpmap._engines.process_exchange_rules.by_dtype`). The headers travel
        first, alone (an all-reduce cannot carry them), and are compared before the
        all-reduce starts."""
        self._transfer("sum", what, _Layout.of(ts), None)
        return _start_all_reduce(ts, self.group, f"{what} across {self.label}").wait_flat()

    def sums_in_order(self, groups: Sequence[Sequence[torch.Tensor]], what: str) -> OrderedSums:
        """Sums over the processes that start later: one per group of tensors (only their
        shapes and dtypes are read here), each as soon as its values exist, always in
        group order (see :class:`OrderedSums`).

        The processes agree on them before the first starts: in the headers of the
        transfer that :meth:`OrderedSums.also_gather` posts, or in a round of their own
        when the first sum starts. A process whose groups differ (another model, another
        bucket size) raises there, on every process alike, before any sum starts."""
        sizes = ", ".join(str(len(g)) for g in groups)
        flat = [t for g in groups for t in g]
        self.pending = _Agreement(f"{what} (in {len(groups)} parts of {sizes} tensors)", _Layout.of(flat))
        expected = [[(t.shape, t.dtype) for t in g] for g in groups]
        return OrderedSums(self, expected, f"{what} across {self.label}")

    def post_gather(self, ts: Sequence[torch.Tensor], what: str) -> None:
        """Starts the gather of ``ts`` (this process' partial results) and returns without
        waiting; the headers also carry the pending agreement. :meth:`settle_posted`
        waits for it, before any other transfer of this exchange."""
        self._wait_posted()
        riding, self.pending = self.pending, None
        self.posted = self._post("gather", what, _Layout.of(ts), ts, riding)

    def _wait_posted(self) -> None:
        if self.posted is not None:
            posted, self.posted = self.posted, None
            self.posted_result = cast(_Layout, posted.layout).unpack(self._finish(posted))

    def settle_posted(self) -> None:
        """Waits for the posted gather, if any, checks every process' header and keeps its
        stacks in :attr:`posted_result`; then the pending agreement, if any, in a header
        round of its own."""
        self._wait_posted()
        if self.pending is not None:
            agreeing, self.pending = self.pending, None
            self._transfer("sum", agreeing.what, agreeing.layout, None)

    def scatter_sum(self, grads: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
        """``grads[k]`` has one entry per process along dim 0; returns, for each ``k``, the
        sum over processes of their entries for this process (the transpose of
        :meth:`all_gather_with_grad`), all tensors in one all-to-all."""
        return self.scatter_sum_no_grad(grads, f"the gradient of {what}")

    def scatter_sum_no_grad(self, ts: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
        """For each ``ts[k]`` (one row per process along dim 0): the sum, in process order,
        of every process' row for this process, all tensors in one all-to-all."""
        layout = _Layout.of([t[0] for t in ts])
        received = self._transfer("scatter", what, layout, ts)
        # each contiguous, as a lone tensor's; in its own dtype (torch.sum widens integers)
        return [r.sum(0, dtype=r.dtype) for r in layout.unpack(received)]

    def scatter_sum_with_grad(self, ts: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
        """:meth:`scatter_sum_no_grad` (a reduce-scatter of this process' partial sums: it
        receives its own share only), differentiable: the gradient of ``ts[k]`` is every
        process' cotangent, stacked (an all-gather)."""
        return list(_ScatterSumProcesses.apply(self, what, *ts))

    # ------------------------------------------------------------------ the agreement check

    def _transfer(
        self, kind: str, what: str, layout: _Layout | None, ts: Sequence[torch.Tensor] | None
    ) -> torch.Tensor:
        """Moves ``ts`` (packed by ``layout``; a scatter's have one row per process) once every
        process' header agrees (see :mod:`torchpmap._engines.process_agreement`); returns the
        received rows, ``(size, layout.row)`` bytes, row ``p`` from process ``p``. Without
        ``ts`` only the headers travel (the digest still covers ``layout``'s tensors): the
        caller then moves the data itself, knowing that every process agreed on it."""
        self.settle_posted()
        return self._finish(self._post(kind, what, layout, ts))

    def _post(
        self,
        kind: str,
        what: str,
        layout: _Layout | None,
        ts: Sequence[torch.Tensor] | None,
        riding: _Agreement | None = None,
    ) -> _Posted:
        """The first half of :meth:`_transfer`: starts the collective that carries the
        headers (and the payload, when the transfer was announced). The digest also
        covers ``riding``'s tensors: sums that start later, agreed on here."""
        st = pg.state()
        chain = agreement.chain(st, self.group)
        self.transfers += 1
        form = (agreement.KINDS[kind], 0 if ts is None else cast(_Layout, layout).row)
        shapes, dtypes = (None, None) if layout is None else (layout.shapes, layout.dtypes)
        if riding is not None:
            what = f"{what}, agreeing on {riding.what}"
            # a transfer that carries an agreement carries tensors too (post_gather's)
            shapes, dtypes = cast(tuple, shapes) + riding.layout.shapes, cast(tuple, dtypes) + riding.layout.dtypes
        digest = agreement.digest_of(kind, what, shapes, dtypes, self.program[0] if self.program else 0)
        mine = agreement.Header(
            digest, self.call, self.transfers, self.local_size, form[1], 0, *chain.guess_after(digest)
        )
        device = ts[0].device if ts else st.local_device.torch_device
        posted = _Posted(kind, what, layout, ts, riding, mine, form, device, f"{what} across {self.label}", chain)
        if chain.announced is None:  # two rounds: the headers alone, now
            self._start_round(mine, None, None, (agreement.KINDS["end"], 0), device, posted)
        elif form == chain.announced:  # one round: header and payload together
            self._start_round(mine, layout if ts is not None else None, ts, form, device, posted)
        else:  # mine differs from the announced transfer: say so in its form, then two rounds
            renegotiate = dataclasses.replace(mine, flag=agreement.RENEGOTIATE)
            self._start_round(renegotiate, None, None, chain.announced, device, posted)
        return posted

    def _finish(self, p: _Posted) -> torch.Tensor:
        """The second half of :meth:`_transfer`: waits, compares the headers (raising on
        every process alike if they differ) and, when the headers travelled alone, moves
        the payload."""
        headers = self._wait_round(p)
        one_round = p.chain.announced is not None
        if one_round and any(h.flag for h in headers):  # someone renegotiated: the headers again, alone
            one_round = False
            if p.header_work is not None and p.work is not None:
                pg.wait(p.work, p.label)  # the announced payload's collective, done with
            self._start_round(p.mine, None, None, (agreement.KINDS["end"], 0), p.device, p)
            headers = self._wait_round(p)
        self._check(headers, p.mine, p.chain, p.kind, p.what, p.layout, p.riding)
        if one_round:
            if p.header_work is not None and p.work is not None:
                pg.wait(p.work, p.label)
            received = p.received
        else:
            received = self._payload(p.layout if p.ts is not None else None, p.ts, p.form, p.device, p.label)
        p.chain.completed(p.mine.digest, p.form, headers)
        return cast(torch.Tensor, received)

    def _start_round(
        self,
        header: agreement.Header,
        layout: _Layout | None,
        ts: Sequence[torch.Tensor] | None,
        form: agreement.Form,
        device: torch.device,
        posted: _Posted,
    ) -> None:
        """Starts one round of ``form``: every process' header, and its payload (zeros
        without ``ts``). Every process' header arrives in ``posted.headers``, its payload
        row in ``posted.received``; ``posted.work`` and ``posted.header_work`` are the
        collectives'.

        On the CPU, header and payload travel together, in one collective (a row starts
        with its header). With a payload on another device (CUDA), the headers travel on
        the CPU, through the group's CPU backend (gloo), beside the payload's collective:
        reading them needs no synchronisation with the device, so a step never waits for
        its kernels to be compared (see :func:`headers_on_host`)."""
        scatter = form[0] == agreement.KINDS["scatter"]
        rows, h = (self.size if scatter else 1), agreement.HEADER_BYTES
        if (device.type != "cpu" or HEADERS_APART) and headers_on_host(self.group):
            mine = header.as_tensor(torch.device("cpu")).view(torch.uint8).reshape(1, h)
            posted.headers, posted.header_work = self._start_collective(mine, scatter=False)
            if form[1] == 0:  # the headers alone
                posted.received, posted.work = torch.empty(self.size, 0, dtype=torch.uint8, device=device), None
                return
            if ts is None:
                send = torch.zeros(rows, form[1], dtype=torch.uint8, device=device)
            else:
                send = cast(_Layout, layout).pack(ts, rows)
            posted.received, posted.work = self._start_collective(send, scatter)
            return
        send = torch.empty(rows, h + form[1], dtype=torch.uint8, device=device)
        send[:, :h] = header.as_tensor(device).view(torch.uint8)
        if ts is None:
            send[:, h:].zero_()
        else:
            cast(_Layout, layout).pack_into(send[:, h:], ts)
        received, posted.work = self._start_collective(send, scatter)
        posted.headers, posted.received, posted.header_work = received[:, :h], received[:, h:], None

    def _wait_round(self, p: _Posted) -> list[agreement.Header]:
        """Waits for a round's headers (a host wait: no device synchronisation) and reads
        them. The payload's collective, if it travels apart, is waited for (the device
        ordered after it) by :meth:`_finish`."""
        if p.header_work is not None:
            pg.wait(p.header_work, p.label, host=True)
        else:
            pg.wait(p.work, p.label)
        return agreement.Header.from_bytes(cast(torch.Tensor, p.headers))

    def _payload(
        self,
        layout: _Layout | None,
        ts: Sequence[torch.Tensor] | None,
        form: agreement.Form,
        device: torch.device,
        label: str,
    ) -> torch.Tensor:
        """The payload alone, after the headers agreed (two rounds)."""
        if layout is None:
            return torch.empty(self.size, 0, dtype=torch.uint8, device=device)
        scatter = form[0] == agreement.KINDS["scatter"]
        sent = cast("Sequence[torch.Tensor]", ts)  # a layout comes with its tensors
        return self._collective(layout.pack(sent, rows=self.size if scatter else 1), scatter, label)

    def _collective(self, send: torch.Tensor, scatter: bool, label: str) -> torch.Tensor:
        """``send``: ``(1, n)`` bytes to every process (all-gather), or ``(size, n)``, row ``p``
        to process ``p`` (all-to-all); returns ``(size, n)``, row ``p`` from process ``p``."""
        received, work = self._start_collective(send, scatter)
        pg.wait(work, label)
        return received

    def _start_collective(self, send: torch.Tensor, scatter: bool) -> tuple[torch.Tensor, Any]:
        """:meth:`_collective`, started: the buffer it fills and its work."""
        if scatter:
            received = torch.empty_like(send)
            return received, dist.all_to_all_single(received, send, group=self.group, async_op=True)
        received = send.new_empty(self.size, send.shape[1])  # one flat buffer: gloo's fastest all-gather
        return received, _all_gather_flat(received.view(-1), send.view(-1), group=self.group, async_op=True)

    def _check(
        self,
        headers: list[agreement.Header],
        mine: agreement.Header,
        chain: agreement.Chain,
        kind: str,
        what: str,
        layout: _Layout | None,
        riding: _Agreement | None = None,
    ) -> None:
        """Raises, on every process alike, unless every header agrees with ``mine``."""
        if all(h.agrees_with(mine) for h in headers):
            return
        chain.forget()
        in_step = len({(h.call, h.transfer) for h in headers}) == 1
        if in_step and len({h.local_size for h in headers}) > 1:
            self._raise_size_mismatch([h.local_size for h in headers])
        told = self._gather_text(_explain(mine, kind, what, layout, riding, self.program), what)
        raise self._mismatch(headers, told, in_step)

    def _raise_size_mismatch(self, found: list[int]) -> None:
        who = ", ".join(f"rank {r}: {s}" for r, s in zip(self._ranks(), found))
        raise SizeMismatch(
            f"pmap over axis {self.axis_name!r} across {self.label}: every process must pass the same number of local "
            f"instances (the size of its local portion of the mapped axis), but they differ: {who} (this is rank "
            f"{pg.state().rank}). Split the global batch evenly over the processes."
        )

    def _mismatch(self, headers: list[agreement.Header], told: list[str], in_step: bool) -> ExchangeMismatch:
        ranks, st = self._ranks(), pg.state()
        by_text: dict[str, list[int]] = {}
        for r, text in zip(ranks, told):
            by_text.setdefault(text, []).append(r)
        sides = "; ".join(
            f"process{'es' if len(rs) > 1 else ''} {', '.join(map(str, rs))} {text}" for text, rs in by_text.items()
        )
        message = (
            f"pmap over axis {self.axis_name!r} across {self.label}: the processes reached exchanges that do not "
            f"match: {sides} (this is rank {st.rank}). Every process must run the same collectives, in the same "
            "order, on values of the same shapes and dtypes: look for a branch on the rank or on process-local data. "
        )
        if in_step:
            message += "Nothing was exchanged; the processes are still in step."
        else:  # one process is an exchange or a call ahead: everything after would pair up wrongly
            message += "The processes are out of step: restart them."
            st.poisoned = st.poisoned or f"mismatched exchanges: {sides}"
        return ExchangeMismatch(message, ranks=[r for r, h in zip(ranks, headers) if not h.agrees_with(headers[0])])

    def _gather_text(self, text: str, what: str) -> list[str]:
        """Every process' ``text``, in group order (two watched transfers: lengths, then bytes)."""
        device = pg.state().local_device.torch_device
        data = torch.tensor(list(text.encode()), dtype=torch.uint8, device=device)
        length = torch.tensor([data.numel()], device=device)
        lengths = length.new_empty(self.size)
        pg.wait(_all_gather_flat(lengths, length, group=self.group, async_op=True), f"explaining {what}")
        longest = int(lengths.max())
        padded = torch.zeros(longest, dtype=torch.uint8, device=device)
        padded[: data.numel()] = data
        received = padded.new_empty(self.size * longest)
        pg.wait(_all_gather_flat(received, padded, group=self.group, async_op=True), f"explaining {what}")
        rows = received.view(self.size, longest).cpu()
        return [bytes(rows[p, : int(n)].tolist()).decode(errors="replace") for p, n in enumerate(lengths.tolist())]

    def _ranks(self) -> Sequence[int]:
        return range(self.size) if self.group is None else dist.get_process_group_ranks(self.group)


def _implements_exchange(exchange: ProcessExchange) -> Exchange:
    """For the type checker: a :class:`ProcessExchange` is an
    :class:`~torchpmap._state.axis_env.Exchange` (mypy checks this return), and so its
    :class:`OrderedSums` an :class:`~torchpmap._state.axis_env.OrderedSums`."""
    return exchange


@dataclasses.dataclass(eq=False)
class PendingSum:
    """Sums over the processes that have started (:func:`_start_all_reduce`).

    Attributes:
        ts: the tensors summed (their shapes and dtypes).
        started: for each dtype, the flat buffer being summed in place and the
            collective's work.
        label: how a wait names the sum.
    """

    ts: list[torch.Tensor]
    started: list[tuple[torch.Tensor, Any]]
    label: str

    def wait_flat(self) -> list[torch.Tensor]:
        """The flat buffers, once every all-reduce finished (they belong to the caller). A
        failed or dead process raises here (see :func:`torchpmap._state.process_group.wait`)."""
        for _, work in self.started:
            pg.wait(work, self.label)
        return [flat for flat, _ in self.started]

    def wait(self) -> list[torch.Tensor]:
        """The sums, shaped as the tensors summed (views of the flat buffers)."""
        return split_flat(self.ts, self.wait_flat())


def _start_all_reduce(ts: Sequence[torch.Tensor], group: Any, label: str) -> PendingSum:
    """Starts one all-reduce (sum) per dtype of ``ts``, on a copy (the inputs stay as they
    were), and returns without waiting. Only once every process agreed on ``ts``' shapes
    and dtypes: a collective of other byte counts would abort the process."""
    started = []
    for which in by_dtype(ts):
        flat = torch.cat([ts[k].reshape(-1) for k in which])
        started.append((flat, dist.all_reduce(flat, group=group, async_op=True)))
    return PendingSum(list(ts), started, label)


@dataclasses.dataclass(eq=False)
class OrderedSums:
    """Sums over the processes that every process agreed on beforehand
    (:meth:`ProcessExchange.sums_in_order`) and that start as their values arrive.

    Group ``k`` starts once its values and those of every group before it exist: the
    all-reduces start in group order in every process whatever order the values come in
    (a collective pairs with the other processes' collective of the same rank in their
    sequence), as DDP reduces its buckets in order.

    The processes agree on the groups before the first starts (their headers are
    compared then, if no earlier transfer carried them: see :meth:`also_gather`).

    Attributes:
        exchange: the exchange that agreed on them.
        expected: each group's shapes and dtypes, as agreed.
        label: how waits and errors name the sums.
        started: the started groups' sums, in order.
        ready: values that arrived before an earlier group's, by group.
    """

    exchange: ProcessExchange
    expected: list[list[tuple[torch.Size, torch.dtype]]]
    label: str
    started: list[PendingSum] = dataclasses.field(default_factory=list)
    ready: dict[int, list[torch.Tensor]] = dataclasses.field(default_factory=dict)

    def also_gather(self, ts: Sequence[torch.Tensor], what: str) -> None:
        """Before the first group starts: starts the gather of ``ts`` (this process'
        partial results), whose headers also carry the agreement on the groups, and
        returns without waiting (:meth:`gathered` returns the stacks)."""
        if self.started or self.ready:
            raise RuntimeError(f"torchpmap: internal error: {self.label} started before also_gather")
        self.exchange.post_gather(ts, what)

    def gathered(self) -> list[torch.Tensor]:
        """The stacks of :meth:`also_gather`'s tensors over the processes (waits for them)."""
        self.exchange.settle_posted()
        result, self.exchange.posted_result = self.exchange.posted_result, None
        if result is None:
            raise RuntimeError(f"torchpmap: internal error: nothing gathered with {self.label}")
        return result

    def start(self, k: int, ts: Sequence[torch.Tensor]) -> None:
        """Group ``k``'s values (plain tensors) are ready: starts it if every group before
        it has started, and then the groups after it that were waiting."""
        if k < len(self.started) or k in self.ready:
            return
        if [(t.shape, t.dtype) for t in ts] != self.expected[k]:
            raise RuntimeError(
                f"torchpmap: internal error: part {k + 1} of {self.label} is not what the processes agreed on"
            )
        if not self.started:
            self.exchange.settle_posted()  # every process agreed before the first sum starts
        self.ready[k] = list(ts)
        while len(self.started) in self.ready:
            n = len(self.started)
            started = _start_all_reduce(self.ready.pop(n), self.exchange.group, f"{self.label}, part {n + 1}")
            self.started.append(started)

    def wait(self, k: int, divisor: int = 1, after: Sequence[torch.Tensor] = ()) -> list[torch.Tensor]:
        """Group ``k``'s sums (it must have started), divided by ``divisor`` in place
        (``after`` exists already: it orders a compiled program's ops)."""
        return split_flat(self.started[k].ts, self.wait_flat(k, divisor))

    def wait_flat(self, k: int, divisor: int = 1) -> list[torch.Tensor]:
        """Group ``k``'s sums as the flat buffers the all-reduces filled, one per dtype,
        divided by ``divisor`` in place."""
        flats = self.started[k].wait_flat()
        if divisor != 1:
            for flat in flats:
                flat.div_(divisor)
        return flats


def _explain(
    header: agreement.Header,
    kind: str,
    what: str,
    layout: _Layout | None,
    riding: _Agreement | None = None,
    program: tuple[int, str] | None = None,
) -> str:
    """How an error names one side: the collective, the tensors (and those of the sums
    agreed on with it), the call and its program."""
    of = f", a {program[1]}" if program is not None else ""
    if kind == "end":
        return f"reached the end of pmap call #{header.call}{of} without any exchange"
    sent = "" if layout is None else " on " + _describe_tensors(layout)
    if riding is not None:
        sent += f" (the later sums on {_describe_tensors(riding.layout)})"
    return f"called {what}{sent} (exchange {header.transfer} of pmap call #{header.call}{of})"


def _describe_tensors(layout: _Layout, at_most: int = 4) -> str:
    """``float32[1, 4], int64[1]`` (and how many more)."""
    named = [f"{str(d).removeprefix('torch.')}{list(s)}" for s, d in zip(layout.shapes, layout.dtypes)]
    more = len(named) - at_most
    return ", ".join(named[:at_most]) + (f" and {more} more tensors" if more > 0 else "")


@dataclasses.dataclass(eq=False)
class _Posted:
    """A transfer whose first collective has started (:meth:`ProcessExchange._post`).

    Attributes:
        kind, what, layout, ts: the transfer (see :meth:`ProcessExchange._transfer`).
        riding: sums that start later, agreed on in these headers.
        mine: this process' header.
        form: the transfer's form (kind code, payload bytes per row).
        device: where its buffers live.
        label: how waits name it.
        chain: what the group had agreed about this transfer when it started.
        received: every process' payload row, as the collective fills it.
        work: the payload's collective (with the headers in it, on the CPU).
        headers: every process' header row (``HEADER_BYTES`` each).
        header_work: the headers' own collective when they travel apart (on the host,
            beside a payload on a device), else None.
    """

    kind: str
    what: str
    layout: _Layout | None
    ts: Sequence[torch.Tensor] | None
    riding: _Agreement | None
    mine: agreement.Header
    form: agreement.Form
    device: torch.device
    label: str
    chain: agreement.Chain
    received: torch.Tensor | None = None
    work: Any = None
    headers: torch.Tensor | None = None
    header_work: Any = None


@dataclasses.dataclass(frozen=True)
class _Agreement:
    """Sums that every process must agree on before they start (:meth:`ProcessExchange.sums_in_order`).

    Attributes:
        what: how headers and errors name them.
        layout: their tensors' shapes and dtypes (the digest covers them).
    """

    what: str
    layout: _Layout


# torch >= 2.10 names the flat all-gather all_gather_single (all_gather_into_tensor is deprecated there)
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


#: ``TORCHPMAP_HEADERS_APART=1``: headers travel apart from CPU payloads too (a testing
#: aid: the protocol of CUDA payloads, run where there is no GPU).
HEADERS_APART = os.environ.get("TORCHPMAP_HEADERS_APART", "") == "1"


def headers_on_host(group: Any) -> bool:
    """Whether ``group`` (None: the world) moves CPU tensors, so that the headers of a
    transfer between devices can travel on the host: gloo does, and so does a group made
    with a CPU backend beside NCCL (``"cpu:gloo,cuda:nccl"``, what
    :func:`torchpmap.distributed.initialize` makes for NCCL). A group of NCCL alone
    cannot: its headers travel on the device, in the payload's collective, and are read
    back with one device synchronisation per transfer."""
    st = pg.state()
    if _host_headers_of[0] is not st:  # a new initialize(): new groups
        _host_headers.clear()
        _host_headers_of[0] = st
    key = id(group) if group is not None else None
    known = _host_headers.get(key)
    if known is None:
        backend = str(dist.get_backend(group))
        known = _host_headers[key] = "gloo" in backend and (":" not in backend or "cpu:gloo" in backend)
    return known


_host_headers: dict[int | None, bool] = {}
_host_headers_of: list[Any] = [None]  # the process state the answers belong to


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where the bytes of several tensors sit in one row of a ``uint8`` buffer, so that
    tensors of any dtypes and shapes travel in one collective.

    Each tensor starts at a multiple of its element size and a row spans a multiple of the
    largest, so that a segment can be viewed back as its dtype in place (a lone tensor
    needs no padding, and packing it copies nothing).
    """

    shapes: tuple[torch.Size, ...]
    dtypes: tuple[torch.dtype, ...]
    offsets: tuple[int, ...]
    nbytes: tuple[int, ...]
    row: int

    @classmethod
    def of(cls, ts: Sequence[torch.Tensor]) -> _Layout:
        align = max(t.element_size() for t in ts)
        offsets, nbytes, end = [], [], 0
        for t in ts:
            start = -(-end // t.element_size()) * t.element_size()
            offsets.append(start)
            nbytes.append(t.numel() * t.element_size())
            end = start + nbytes[-1]
        row = -(-end // align) * align
        return cls(tuple(t.shape for t in ts), tuple(t.dtype for t in ts), tuple(offsets), tuple(nbytes), row)

    def pack(self, ts: Sequence[torch.Tensor], rows: int) -> torch.Tensor:
        """``ts[k]`` of shape ``(rows, *shapes[k])`` (or ``shapes[k]`` when rows == 1) ->
        a ``(rows, row)`` byte buffer whose row ``r`` holds entry ``r`` of every tensor."""
        if len(ts) == 1:  # a lone tensor is its own buffer: no copy
            return _bytes(ts[0], rows)
        buffer = torch.empty(rows, self.row, dtype=torch.uint8, device=ts[0].device)
        self.pack_into(buffer, ts)
        return buffer

    def pack_into(self, buffer: torch.Tensor, ts: Sequence[torch.Tensor]) -> None:
        """:meth:`pack` into ``buffer``, a ``(rows, row)`` byte view (after a header)."""
        rows = buffer.shape[0]
        for t, start, n in zip(ts, self.offsets, self.nbytes):
            buffer[:, start : start + n].copy_(_bytes(t, rows))

    def unpack(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """A ``(m, row)`` byte buffer -> tensor ``k`` of every row, ``(m, *shapes[k])``, contiguous.

        Each is a tensor of its own (a copy), except a lone tensor's, which may stay a
        view of ``buffer``: no two results share memory (the compiled ops' rule)."""
        m, apart = buffer.shape[0], len(self.shapes) > 1
        out = []
        for shape, dtype, start, n in zip(self.shapes, self.dtypes, self.offsets, self.nbytes):
            t = buffer[:, start : start + n].view(dtype).reshape(m, *shape)
            # one row (a group of one process) is contiguous already: contiguous() would not copy
            out.append(
                t.clone(memory_format=torch.contiguous_format) if apart and t.is_contiguous() else t.contiguous()
            )
        return out


def _bytes(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` as a ``(rows, bytes per row)`` uint8 view (a copy only if ``t`` is not contiguous)."""
    return t.contiguous().reshape(rows, t.numel() // rows).view(torch.uint8)


class _Summing(torch.autograd.Function):
    """``(exchange, what, *ts)``: a sum over the processes of their partial sums ``ts``,
    whose transpose sends the cotangents of the floating-point tensors only (zeros where
    a result got no gradient, so that every process sends the same layout)."""

    generate_vmap_rule = False

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.exchange, ctx.what = inputs[0], inputs[1]
        ctx.differentiable = [differentiable(t) for t in inputs[2:]]


class _SumProcesses(_Summing):
    """Each process' partial sums -> their sums over the processes; the transpose is the
    same sum of the cotangents."""

    @staticmethod
    def forward(exchange: ProcessExchange, what: str, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(exchange.sum_no_grad(ts, what))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        summed = lambda gs: ctx.exchange.sum_no_grad(gs, f"the gradient of {ctx.what}")  # noqa: E731
        return None, None, *transpose_gather(grads, ctx.differentiable, summed)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, exchange: ProcessExchange, what: str, *ts: torch.Tensor) -> tuple[Any, Any]:
        # a sum across processes is elementwise: a batched tensor is summed as it lies
        return _SumProcesses.apply(exchange, what, *ts), tuple(in_dims[2:])


class _ScatterSumProcesses(_Summing):
    """Each process' partial sums of every process' share -> the sum of its own share over
    the processes; the transpose stacks every process' cotangent."""

    @staticmethod
    def forward(exchange: ProcessExchange, what: str, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(exchange.scatter_sum_no_grad(ts, what))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        stacked = lambda gs: ctx.exchange.all_gather_with_grad(gs, f"the gradient of {ctx.what}")  # noqa: E731
        return None, None, *transpose_gather(grads, ctx.differentiable, stacked)

    @staticmethod
    def vmap(info: Any, in_dims: tuple, exchange: ProcessExchange, what: str, *ts: torch.Tensor) -> tuple[Any, Any]:
        # an enclosing map's batch (the same instances of it in every process of this group)
        # rides behind the processes' rows
        t_dims = in_dims[2:]
        moved = [t if d is None else t.movedim(d, 1) for t, d in zip(ts, t_dims)]
        return _ScatterSumProcesses.apply(exchange, what, *moved), tuple(None if d is None else 0 for d in t_dims)


class _GatherProcesses(torch.autograd.Function):
    """``ts`` of every process -> their stacks; backward sums the cotangents per slice.

    Each direction is one transfer for all tensors. Backward sends the cotangents of the
    floating-point tensors only (zeros where a result got no gradient): their dtypes, the
    same in every process, decide the layout, so every process packs the same one.
    """

    generate_vmap_rule = False

    @staticmethod
    def forward(exchange: ProcessExchange, what: str, partial: bool, *ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(exchange.all_gather_no_grad(ts, what, partial))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.exchange, ctx.what = inputs[0], inputs[1]
        ctx.differentiable = [differentiable(t) for t in inputs[3:]]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        scatter = lambda gs: ctx.exchange.scatter_sum(gs, ctx.what)  # noqa: E731
        return None, None, None, *transpose_gather(grads, ctx.differentiable, scatter)

    @staticmethod
    def vmap(
        info: Any, in_dims: tuple, exchange: ProcessExchange, what: str, partial: bool, *ts: torch.Tensor
    ) -> tuple[Any, Any]:
        # An enclosing map batches some ts (a pmap over one mesh axis nested in a pmap over
        # another): gather the whole batch at once; the processes of this group hold the
        # same instances of the enclosing axis, so entry b matches entry b.
        t_dims = in_dims[3:]
        moved = [t if d is None else t.movedim(d, 0) for t, d in zip(ts, t_dims)]
        return _GatherProcesses.apply(exchange, what, partial, *moved), tuple(None if d is None else 1 for d in t_dims)
