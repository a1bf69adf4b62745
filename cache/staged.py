"""The staged row mover: host threads gather missed rows, the copy engines carry them, one kernel scatters.

A prefetch (on its stream ``P``) only compacts, on the device, what must move: the filled
rows and their slots, the dirty victims and their slots (ascending rows), and three counts
(fills, write-backs, rows read in place), copied to pinned memory behind an event. It then
hands a job to two host threads and returns: the training thread never waits for the device.

Fill thread, per job (stream ``F``)::

    wait for the counts' event                        (host, this thread only)
    wait until the write-back thread has copied this job's victims out of their slots
    copy the fill rows' ids to the host; then, per chunk of staging_rows rows:
        gather the rows (and their optimizer state) from the backing store into a pinned
        buffer (HostRows: one parallel call per segment of tables, GIL released)
        F: copy the buffer to a device buffer (DMA), scatter it into the slots (index_copy_)
    record the job's fill event on F

Write-back thread, per job (stream ``W``)::

    wait for the counts' event
    W: gather every victim's slot row into one device buffer (HBM to HBM), record an event
       -> the fill thread may now go on (its scatters wait for that event on F)
    copy the victims' row ids to the host; per chunk: W copies it to a pinned buffer (DMA),
    the host scatters it into the backing store (HostRows), the next chunk's DMA running
    meanwhile
    take the next job

The write-back thread takes jobs in order, so when it says a job's victims are out of their
slots, every earlier job's write-backs are in the backing store. That one wait of the fill
thread therefore gives guarantee 3 (a victim leaves before its slot is refilled) and 2 (a
row written back by an earlier prefetch is in the backing store before this fill reads it),
and, since a batch's forward waits for its fill, guarantee 1 for the rows it reads in place.
A job's fills and write-backs run at once, on the two copy engines (H2D and D2H) and on the
host, and the host gathers chunk k+1 while chunk k is on the bus. A batch's forward
(:meth:`StagedMover.wait_filled`) waits on the host until the fill thread has issued its
scatters (the back-pressure point: the step waits when the mover falls behind), then on the
device for the fill event only. F is one stream and the fill thread takes jobs in order, so
a fill event also covers every earlier fill.

Bounded memory: two pinned fill buffers and two pinned write-back buffers of
``staging_rows`` rows each, two device fill buffers of that size, one device victim buffer
that grows to the most write-backs one prefetch made (at most the number of slots), and
host row-id buffers of the most rows one job moved. At most ``MAX_JOBS`` prefetches may be
in the mover at once; the next one waits (back-pressure). All reused.

In CPU simulation the same code runs with plain copies for the DMA and no streams or events:
the threads' own order and their waits stand in for them.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable

import torch

from tiered_tbe.base.sorting import compact, stable_sort
from tiered_tbe.cache._kernels import OUTCOME_FILLED
from tiered_tbe.cache.host_rows import HostRows, set_copy_threads
from tiered_tbe.cache.mover import Moves, RowMover

# Rows per staging buffer (a 128-dim fp32 row with its Adagrad state: 17 MB). A batch of the
# benchmark moves ~80K rows: three chunks, the host gathering one while the last is on the bus.
DEFAULT_STAGING_ROWS = 32768
# Prefetches in the mover at once, at most (a depth-8 pipeline, the batch training, one more).
MAX_JOBS = 10


class _Job:
    """One prefetch's moves, on their way. Device lists [N] padded past the counts."""

    def __init__(self, fill_rows, fill_slots, back_rows, back_slots, counts):
        self.fill_rows, self.fill_slots = fill_rows, fill_slots  # int64: ascending rows, their slots
        self.back_rows, self.back_slots = back_rows, back_slots  # int64: ascending victim rows, their slots
        self.counts = counts  # int64 [2] (fills, write-backs): a pinned host copy on CUDA
        self.counts_ready = None  # event after the counts' copy (CUDA)
        self.fill_event = None  # on the fill stream, after the job's scatters (CUDA)
        self.gathered_event = None  # on the write-back stream, after the victims left their slots (CUDA)
        self.gathered = threading.Event()  # set once gathered_event is recorded
        self.filled = threading.Event()  # set once fill_event is recorded (simulation: the fills are done)
        self.parts_done = 0

    def read_counts(self) -> tuple[int, int]:
        if self.counts_ready is not None:
            self.counts_ready.synchronize()
        fills, write_backs = self.counts.tolist()
        return fills, write_backs


class StagedMover(RowMover):
    """Moves rows through host threads, pinned staging buffers and the copy engines (module docstring).

    Args:
        weights, state: the cache's slot rows, [S, row_width] and fp32 [S, state_width].
        tables: the cached tables (``CachedTable``), backed by host-readable memory.
        device: the cache's device.
        rows_end: one past the largest global row.
        threads: threads each host thread uses for a gather or a scatter (torch's and numba's,
            set in that thread); None keeps the libraries' defaults (all cores).
        staging_rows: rows per staging buffer (default ``DEFAULT_STAGING_ROWS``).

    ``stats`` counts rows moved and the host seconds spent gathering and scattering;
    ``delay`` (tests only) is called with ``"fill"`` or ``"write_back"`` before each host copy.
    """

    name = "staged"
    hands_off_device_lists = True  # the threads read the fill and write-back lists after the prefetch

    def __init__(self, weights: torch.Tensor, state: torch.Tensor, tables, device: torch.device, rows_end: int,
                 threads: int | None = None, staging_rows: int | None = None):
        if threads is not None and threads < 1:
            raise ValueError(f"mover threads must be >= 1, got {threads}")
        if staging_rows is not None and staging_rows < 1:
            raise ValueError(f"staging_rows must be >= 1, got {staging_rows}")
        self.weights, self.state = weights, state
        self.has_state = state.shape[1] > 0
        self.host = HostRows(tables)
        self.is_cuda = device.type == "cuda"
        if self.is_cuda and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())  # the threads set it as theirs
        self.device = device
        self.rows_end = rows_end
        self.threads = threads
        self.staging_rows = staging_rows or DEFAULT_STAGING_ROWS
        self.delay: Callable[[str], None] | None = None
        self.stats = dict(rows_filled=0, rows_written=0, gather_s=0.0, scatter_s=0.0)
        self.fill_stream = torch.cuda.Stream(device) if self.is_cuda else None
        self.back_stream = torch.cuda.Stream(device) if self.is_cuda else None
        self._condition = threading.Condition()
        self._submitted = 0  # jobs handed to the threads
        self._finished = 0  # jobs both threads are done with
        self._error: BaseException | None = None
        self._free_jobs = threading.Semaphore(MAX_JOBS)
        self._last_job: _Job | None = None
        self._queues: tuple[queue.SimpleQueue, queue.SimpleQueue] | None = None
        self._buffers: dict[str, torch.Tensor] = {}
        self._fill_copied: list = [None, None]  # the fill thread's: event after each pinned fill buffer's DMA

    # ------------------------------------------------------------------ the prefetch's side

    def enqueue(self, moves: Moves) -> tuple[torch.Tensor, ...]:
        """Compact the moves on the current stream (device work only; the slot cache graphs it
        with the prefetch): ``(fill_rows, fill_slots, back_rows, back_slots, counts)``, int64."""
        filled = moves.outcome == OUTCOME_FILLED
        fill_rows, fill_slots = compact(filled, moves.unique_rows, moves.slot_of_unique.long())
        # The dirty victims are distinct rows (Moves.write_back_keys): sorted, they are the prefix.
        back_keys, order = stable_sort(moves.write_back_keys)
        counts = torch.stack([filled.sum(), moves.victim_was_dirty.sum(dtype=torch.int64)])
        return fill_rows, fill_slots, back_keys.long(), moves.slot_of_unique[order].long(), counts

    def hand_off(self, enqueued: tuple[torch.Tensor, ...]) -> _Job:
        """Hand :meth:`enqueue`'s lists to the threads, their counts behind an event (no host sync)."""
        job = _Job(*enqueued)
        if self.is_cuda:  # the threads read the counts from pinned memory, after its event
            device_counts, job.counts = job.counts, torch.empty(2, dtype=torch.int64, pin_memory=True)
            job.counts.copy_(device_counts, non_blocking=True)
            job.counts_ready = torch.cuda.current_stream(self.device).record_event()
        self._submit(job)
        return job

    def _submit(self, job: _Job) -> None:
        self._raise_if_failed()
        self._free_jobs.acquire()  # back-pressure: at most MAX_JOBS in the mover
        self._submitted += 1
        self._last_job = job
        fill_queue, back_queue = self._start_threads()
        back_queue.put(job)
        fill_queue.put(job)

    def move_rows(self, fill_rows, fill_slots, back_rows, back_slots) -> None:
        """Move rows as one prefetch would, and wait until they have landed (for benchmarks):
        backing rows ``fill_rows`` into slots ``fill_slots``, slots ``back_slots`` out to backing
        rows ``back_rows`` (int64 device tensors; rows ascending and distinct, slots distinct;
        a slot in both lists is read out before it is filled)."""
        counts = torch.tensor([fill_rows.numel(), back_rows.numel()], dtype=torch.int64)
        job = _Job(fill_rows, fill_slots.long(), back_rows, back_slots.long(), counts)
        if self.is_cuda:
            job.counts_ready = torch.cuda.current_stream(self.device).record_event()
        self._submit(job)
        self.drain()

    def wait_filled(self, job: _Job | None) -> None:
        """The current stream waits for ``job``'s fills; the host waits while the fill thread is
        behind. (Every earlier write-back is then in the backing store: see the module docstring.)"""
        if job is None:
            return
        job.filled.wait()
        self._raise_if_failed()
        if job.fill_event is not None:
            torch.cuda.current_stream(self.device).wait_event(job.fill_event)

    def drain(self) -> None:
        with self._condition:
            self._condition.wait_for(lambda: self._finished == self._submitted or self._error is not None)
        self._raise_if_failed()
        job = self._last_job
        if job is not None and job.fill_event is not None:
            torch.cuda.current_stream(self.device).wait_event(job.fill_event)

    def close(self) -> None:
        self.drain()
        if self._queues is not None:
            for q in self._queues:
                q.put(None)
            self._queues = None

    def write_back(self, sorted_rows, sorted_slots, selected) -> None:
        """Flush through the same staging: chunks of ``staging_rows`` rows gathered from their
        slots, copied to the host and scattered into the backing store; returns when done."""
        self.drain()  # every slot holds its final row, no write-back is pending
        count = int(selected.sum())  # a host sync: flush and write_back are asked for
        if count == 0:
            return
        rows, slots = compact(selected.bool(), sorted_rows, sorted_slots.long())
        stream = self.back_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))  # the updates so far are in the slots
        chunk = self.staging_rows
        weights, state = self._buffer_pair("victims", 2 * chunk, stream)
        with self._on(stream):
            host_rows = self._rows_to_host(rows, count, stream, "back_rows")

            def gather(begin, end):  # into half (begin // chunk) % 2 of the device buffer
                half = (begin // chunk) % 2 * chunk
                out_weights, out_state = weights[half: half + end - begin], state[half: half + end - begin]
                torch.index_select(self.weights, 0, slots[begin:end], out=out_weights)
                if self.has_state:
                    torch.index_select(self.state, 0, slots[begin:end], out=out_state)
                return out_weights, out_state

            self._to_backing(host_rows, count, gather, stream)
        self._used_on(stream, rows, slots)

    # ------------------------------------------------------------------ the threads

    def _start_threads(self):
        if self._queues is None:
            self._queues = (queue.SimpleQueue(), queue.SimpleQueue())
            reference = weakref.ref(self)
            for work, q in ((StagedMover._fill, self._queues[0]), (StagedMover._write_back_job, self._queues[1])):
                threading.Thread(target=_worker, args=(q, reference, work), daemon=True,
                                 name=f"tiered_tbe {work.__name__.strip('_')}").start()
            weakref.finalize(self, _stop, self._queues)
        return self._queues

    def _fill(self, job: _Job) -> None:
        """The fill thread's part of a job (module docstring)."""
        num_fills, _ = job.read_counts()
        job.gathered.wait()  # this job's victims are out, and every earlier job's write-backs are in
        self._raise_if_failed()
        stream = self.fill_stream
        with self._on(stream):
            if stream is not None and job.gathered_event is not None:
                stream.wait_event(job.gathered_event)
            if num_fills:
                if stream is not None:
                    stream.wait_event(job.counts_ready)  # the lists were made on the prefetch's stream
                rows = self._rows_to_host(job.fill_rows, num_fills, stream, "fill_rows")
                chunk = self.staging_rows
                copied = self._fill_copied  # per pinned buffer: event after its last DMA (any job)
                for index, begin in enumerate(range(0, num_fills, chunk)):
                    end, buffer = min(begin + chunk, num_fills), index % 2
                    pinned_weights, pinned_state = self._buffer_pair(f"fill_pinned{buffer}", chunk, None, pinned=True)
                    device_weights, device_state = self._buffer_pair(f"fill_device{buffer}", chunk, stream)
                    if copied[buffer] is not None:
                        copied[buffer].synchronize()  # the DMA out of this pinned buffer is done
                    if self.delay is not None:
                        self.delay("fill")
                    started = time.perf_counter()
                    self.host.gather(rows[begin:end], pinned_weights, pinned_state)
                    self.stats["gather_s"] += time.perf_counter() - started
                    m = end - begin
                    device_weights[:m].copy_(pinned_weights[:m], non_blocking=True)
                    if self.has_state:
                        device_state[:m].copy_(pinned_state[:m], non_blocking=True)
                    copied[buffer] = stream.record_event() if stream is not None else None
                    self.weights.index_copy_(0, job.fill_slots[begin:end], device_weights[:m])
                    if self.has_state:
                        self.state.index_copy_(0, job.fill_slots[begin:end], device_state[:m])
                self.stats["rows_filled"] += num_fills
                self._used_on(stream, job.fill_rows, job.fill_slots)
            if stream is not None:
                job.fill_event = stream.record_event()

    def _write_back_job(self, job: _Job) -> None:
        """The write-back thread's part of a job (module docstring)."""
        _, num_back = job.read_counts()
        stream = self.back_stream
        with self._on(stream):
            if num_back:
                if stream is not None:
                    stream.wait_event(job.counts_ready)
                weights, state = self._buffer_pair("victims", num_back, stream)
                slots = job.back_slots[:num_back]
                torch.index_select(self.weights, 0, slots, out=weights[:num_back])
                if self.has_state:
                    torch.index_select(self.state, 0, slots, out=state[:num_back])
                if stream is not None:
                    job.gathered_event = stream.record_event()
            job.gathered.set()  # the victims are out of their slots: the fills may land
            if num_back:
                rows = self._rows_to_host(job.back_rows, num_back, stream, "back_rows")
                self._to_backing(rows, num_back, lambda begin, end: (weights[begin:end], state[begin:end]), stream)
                self._used_on(stream, job.back_rows, job.back_slots)

    def _to_backing(self, rows: torch.Tensor, count: int, gather: Callable, stream) -> None:
        """Copy ``count`` rows to the host in chunks and scatter them into the backing store:
        ``gather(begin, end)`` returns (enqueues, on ``stream``) the device rows of a chunk; the
        next chunk's DMA runs while the host scatters this one."""
        chunk = self.staging_rows
        starts = list(range(0, count, chunk))
        copied = [None, None]

        def copy_out(index):
            begin = starts[index]
            end, buffer = min(begin + chunk, count), index % 2
            device_weights, device_state = gather(begin, end)
            pinned_weights, pinned_state = self._buffer_pair(f"back_pinned{buffer}", chunk, None, pinned=True)
            pinned_weights[: end - begin].copy_(device_weights, non_blocking=True)
            if self.has_state:
                pinned_state[: end - begin].copy_(device_state, non_blocking=True)
            copied[buffer] = stream.record_event() if stream is not None else None

        copy_out(0)
        for index, begin in enumerate(starts):
            if index + 1 < len(starts):
                copy_out(index + 1)  # its buffer's last scatter (chunk index - 1) is done
            buffer = index % 2
            if copied[buffer] is not None:
                copied[buffer].synchronize()
            if self.delay is not None:
                self.delay("write_back")
            end = min(begin + chunk, count)
            pinned_weights, pinned_state = self._buffer_pair(f"back_pinned{buffer}", chunk, None, pinned=True)
            started = time.perf_counter()
            self.host.scatter(rows[begin:end], pinned_weights[: end - begin], pinned_state[: end - begin])
            self.stats["scatter_s"] += time.perf_counter() - started
        self.stats["rows_written"] += count

    # ------------------------------------------------------------------ bookkeeping

    def _job_part_done(self, job: _Job, part: Callable) -> None:
        """Called by each thread when its part of ``job`` is over (also after an error)."""
        with self._condition:
            if part is StagedMover._write_back_job:
                job.gathered.set()  # (already, unless it failed)
            else:
                job.filled.set()
            job.parts_done += 1
            if job.parts_done == 2:
                self._finished += 1
                job.fill_rows = job.fill_slots = job.back_rows = job.back_slots = None
                self._free_jobs.release()
            self._condition.notify_all()

    def _fail(self, error: BaseException) -> None:
        with self._condition:
            self._error = self._error or error
            self._condition.notify_all()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError("the staged row mover failed; the cache's rows may be incomplete") from self._error

    def _on(self, stream):
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    @staticmethod
    def _used_on(stream, *tensors) -> None:
        """Tensors made on another stream and used on ``stream``: the allocator waits for it."""
        if stream is not None:
            for tensor in tensors:
                tensor.record_stream(stream)

    def _rows_to_host(self, rows: torch.Tensor, count: int, stream, name: str) -> torch.Tensor:
        """The first ``count`` entries of the device list ``rows`` (int64), on the host."""
        if stream is None:
            return rows[:count]
        host = self._buffers.get(name)
        if host is None or host.numel() < count:
            host = self._buffers[name] = torch.empty(max(count, self.staging_rows), dtype=torch.int64,
                                                     pin_memory=True)
        host[:count].copy_(rows[:count], non_blocking=True)
        stream.record_event().synchronize()  # an event: torch's (global) sync debug mode flags stream syncs
        return host[:count]

    def _buffer_pair(self, name: str, rows: int, stream, pinned: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Reused staging ``(weights [>= rows, row_width], state [>= rows, state_width])``, on the
        host (pinned on CUDA) or on the device (made on ``stream``); grown when too small."""
        pair = self._buffers.get(name)
        if pair is None or pair[0].shape[0] < rows:
            capacity = max(rows, self.staging_rows) if pair is None else max(rows, 2 * pair[0].shape[0])
            if not pinned:
                capacity = min(capacity, max(rows, self.weights.shape[0]))  # never past the slots
            on_host = pinned or not self.is_cuda
            options = dict(device="cpu", pin_memory=self.is_cuda) if on_host else dict(device=self.device)
            with self._on(stream if not on_host else None):
                pair = (torch.empty(capacity, self.weights.shape[1], dtype=self.weights.dtype, **options),
                        torch.empty(capacity, self.state.shape[1], dtype=torch.float32, **options))
            self._buffers[name] = pair
        return pair


def _worker(jobs: queue.SimpleQueue, mover_reference, work: Callable) -> None:
    """A mover thread: run ``work(mover, job)`` for each job until told to stop or the mover is gone.
    It holds the mover only while working, so an unused mover can be collected (and stops it)."""
    configured = False
    while True:
        job = jobs.get()
        mover = mover_reference() if job is not None else None
        if mover is None:
            return
        try:
            if not configured:
                if mover.is_cuda:
                    torch.cuda.set_device(mover.device)
                if mover.threads is not None:
                    set_copy_threads(mover.threads)  # this thread's (torch's and numba's counts are per thread)
                configured = True
            if mover._error is None:
                work(mover, job)
        except BaseException as error:  # noqa: BLE001 - handed to the training thread, which raises it
            mover._fail(error)
        finally:
            mover._job_part_done(job, work)
        del mover, job


def _stop(queues) -> None:
    for q in queues:
        q.put(None)
