"""`TokenLoader`: batches of token vectors, every chosen token once per epoch, in a chosen order.

The loader orchestrates; the work lives beside it: the selection (`selection`), the plan
of an epoch (`plan`, pure numpy), the order as a strategy (`order`), the world (`..world`),
the host run (`host_run`, with `windows` and `pools`) and the device-side shuffle
(`device`). `ShuffledLoader` and `OrderedLoader` are the token loader with the shuffled and
the ordered strategy.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import os
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from .. import world
from ..codecs import gather
from ..errors import LoaderError
from ..humanize import html_table
from ..protocol.jsonfile import is_int, short_repr
from ..reader import Shards
from .ahead import IndexAhead
from .batch import Batch
from .device import DeviceRun
from .host_run import HostRun
from .order import FIRST_WINDOW_BYTES, Order, parse_order, windows_free
from .plan import BLOCK_BYTES, EpochPlan, ReadSpans, index_window, plan_epoch
from .schedule import Config, Epoch, Schedule
from .selection import TokenSelection, as_shards, check_layers_not_mixed, choose_sites, parse_out_dtype
from .spares import Spares
from .state import check_same, check_state, fingerprint_of, settings_of
from .summary import summary_rows
from .tensors import require_torch
from .threads import MAX_DEFAULT_THREADS, default_gather_threads, default_read_threads, usable_cores

__all__ = [
    "MAX_DEFAULT_THREADS",
    "OrderedLoader",
    "ShuffledLoader",
    "TokenLoader",
    "default_gather_threads",
    "default_read_threads",
    "usable_cores",
]

#: Every running epoch in this process. An iterator still alive when the interpreter exits
#: is closed at exit, while the modules its threads use still exist: closing it later, when
#: the interpreter finalizes the generator, would print "Exception ignored in ..." noise.
_LIVE_RUNS: weakref.WeakSet[HostRun | DeviceRun] = weakref.WeakSet()


@atexit.register
def _close_live_runs() -> None:
    for run in list(_LIVE_RUNS):
        with contextlib.suppress(Exception):
            run.close()


class TokenLoader:
    """Batches ``(B, D)`` of single token vectors; every chosen token once per epoch.

    ``layers``: None (all recorded), a layer value or a sequence of them; more than one layer
    needs ``stack_layers=True`` or ``mix_layers=True`` (a batch never mixes layers by accident,
    so on a cache of several layers choose one, stack them, or say so). ``tokens``:
    ``"content"``, ``"cls"`` or ``"all"``. ``ignore_labels`` skips content tokens whose label is
    listed; ``skip_padding`` skips positions ``>= lengths[i]`` when the cache has a lengths
    column. ``out_dtype``: None (stored; bfloat16 comes back as torch.bfloat16), ``"float32"``,
    ``"bfloat16"`` or ``"float16"``. ``rank``/``world_size``: this process's share (default: the
    `saev_shards.world` precedence without SLURM arrays); ``drop_last=True`` gives every rank
    the same number of full batches.

    ``order``: ``"shuffled"`` (a new order from ``(seed, epoch)`` each epoch) or ``"ordered"``
    (strict ``(example, layer, token)`` order). ``stack_layers=True``: each row is one
    ``(example, token)`` at every chosen layer, batches ``(B, L, D)``. ``sites`` (a cache that
    records sites, protocol 3.2), instead of ``layers``: one site (``"module:input"``,
    ``"module:output"`` or a `Site`) gives batches ``(B, D)``; a list of sites gives every
    row at each of them, ``(B, S, D)`` in the order listed (a transcoder's input and output
    pair: ``(B, 2, D)``). ``device``: None
    gathers on the host (``pin_memory`` pins the batches); ``"cuda"`` copies whole windows to
    the GPU and shuffles there, batches come out on it (``"cpu"`` runs that path on the CPU).

    Token masks: ``exclude_token_ids`` drops the positions whose ``token_ids`` column value is
    listed (BOS, padding); ``max_norm_multiple=k`` drops the positions whose vector at any
    chosen layer has a norm above ``k`` times its layer's median norm (`saev_shards.reader.norms`:
    exact, computed once per process with a progress bar when ``progress``). Both are
    deterministic; every remaining token is still yielded once per epoch and resumes
    exactly; `dropped` counts what they took.

    Iterating runs one epoch. Breaking out of the loop, `close`, or garbage collection stops
    the background threads. Memory: on the host, windows the page cache holds are read in
    place (a local cache on Linux is mapped once; `loaders.mapped`), and windows on disk are
    read into two buffers of about ``buffer_bytes`` each, which take memory once written; with
    ``device`` two windows on the device and in pinned memory; plus ``gather_threads +
    prefetch`` batches in flight.
    """

    def __init__(
        self,
        shards: Shards | str | os.PathLike[str],
        batch_size: int = 4096,
        layers: int | Sequence[int] | None = None,
        tokens: str = "content",
        seed: int = 0,
        drop_last: bool = False,
        out_dtype: str | None = None,
        ignore_labels: Iterable[int] = (),
        skip_padding: bool = True,
        rank: int | None = None,
        world_size: int | None = None,
        pin_memory: bool = False,
        *,
        buffer_bytes: int = 1 << 30,
        block_bytes: int = BLOCK_BYTES,
        read_threads: int | None = None,
        prefetch: int = 4,
        gather_threads: int | None = None,
        order: str | Order = "shuffled",
        stack_layers: bool = False,
        mix_layers: bool = False,
        device: Any = None,
        exclude_token_ids: Iterable[int] = (),
        max_norm_multiple: float | None = None,
        progress: bool | None = None,
        sites: Any = None,
    ) -> None:
        require_torch(type(self).__name__)
        import torch

        self.shards = as_shards(shards)
        gather.load_in_background()  # numba's kernels; numpy's code (the same batches) until they load
        choice = choose_sites(self.shards, sites, layers)
        if choice is not None:
            layers = choice.layers if choice.stacked else choice.layers[0]
            stack_layers = bool(stack_layers) or (choice.stacked and not mix_layers)
        sizes = {"buffer_bytes": buffer_bytes, "block_bytes": block_bytes, "read_threads": read_threads}
        _check_counts(batch_size, seed, {**sizes, "prefetch": prefetch, "gather_threads": gather_threads})
        self.order = parse_order(order)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        #: Where this process's share came from (`saev_shards.world.World`).
        self.world = world.detect(rank, world_size, slurm_array=False, error=LoaderError)
        self.rank, self.world_size = self.world.rank, self.world.world_size
        self.selection = TokenSelection(
            self.shards, layers, tokens, ignore_labels, skip_padding, exclude_token_ids, max_norm_multiple, progress
        )
        self.layers = self.selection.layer_values
        self.out_dtype = parse_out_dtype(self.shards, out_dtype)
        self.stack_layers = bool(stack_layers)
        check_layers_not_mixed(self.shards, self.layers, self.stack_layers, bool(mix_layers))
        #: The sites asked for (``sites=``), in the order batches hold them; None without.
        self.sites = None if choice is None else choice.sites
        #: Stacked sites asked in another order than stored: where each one sits in a gathered row.
        self._site_order = choice.order(self.layers) if choice is not None and self.stack_layers else None
        self.device = None if device is None else _parse_device(device)
        self.pin_memory = bool(pin_memory) and torch.cuda.is_available() and self.device is None
        self.buffer_bytes, self.block_bytes = int(buffer_bytes), int(block_bytes)
        self._spans = ReadSpans(self.shards, self.selection, self.block_bytes, self.stack_layers)
        self._window_rows, self._first_window_rows = _window_rows(self.shards, self.buffer_bytes, self.order)
        if read_threads is None:
            read_threads = default_read_threads(self.device is not None, getattr(self.order, "sequential", False))
        gathering = default_gather_threads() if gather_threads is None else int(gather_threads)
        chosen = (self.shards, self.selection, self._spans, self.batch_size, self.out_dtype, self.pin_memory)
        self._config = Config(*chosen, int(read_threads), int(prefetch), gathering)
        total = self._spans.total
        self.n_tokens = len(self.world.share(total))  # rows this rank yields per epoch (before drop_last)
        # Batches per epoch: with drop_last the same on every rank.
        full = (total // self.world_size) // self.batch_size
        self._len = full if self.drop_last else -(-self.n_tokens // self.batch_size)
        self._next_epoch, self._resume_batch = 0, 0
        self._position: tuple[int, int] | None = None  # (epoch, batches yielded) of the live iteration
        self._runs: weakref.WeakSet[HostRun | DeviceRun] = weakref.WeakSet()
        #: What epochs borrow and give back: buffers, threads, device slots, the cache mapped in place.
        self._spares = Spares(self._config)
        #: The next epoch's plan and first window's index, computed while an epoch ends.
        self._ahead = IndexAhead()

    # -- size and identity -------------------------------------------------------------
    def __len__(self) -> int:
        """Batches per epoch on this rank."""
        return self._len

    @property
    def read_threads(self) -> int:
        return self._config.read_threads

    @property
    def gather_threads(self) -> int:
        return self._config.gather_threads

    @property
    def settings(self) -> dict[str, Any]:
        """Everything that decides the batches (the cache's hash included), as JSON values:
        `state_dict` carries it so that `load_state_dict` can name the setting that differs."""
        return settings_of(self)

    @property
    def dropped(self) -> dict[str, int]:
        """Token positions the token masks drop per epoch and chosen layer, by mask
        (``{"exclude_token_ids": n, "max_norm_multiple": m}``; empty without masks): what
        remains is yielded exactly once per epoch, as always."""
        return self.selection.dropped

    @property
    def norm_medians(self) -> dict[int, float]:
        """Layer value -> its median norm, for the chosen layers (with ``max_norm_multiple``; else empty)."""
        nf = self.selection.norm_filter
        if nf is None:
            return {}
        md = self.shards.metadata
        return {md.layers[p]: float(nf.medians[p]) for p in nf.layer_positions}

    @property
    def fingerprint(self) -> str:
        """Digest of `settings`; `load_state_dict` checks it."""
        return fingerprint_of(self.settings)

    # -- how it shows itself ----------------------------------------------------------
    def summary_rows(self) -> list[tuple[str, str]]:
        """What a notebook shows of this loader (`_repr_html_`): one ``(name, value)`` per line."""
        return summary_rows(self)

    def __repr__(self) -> str:
        rows = dict(self.summary_rows())
        return f"<saev_shards.{type(self).__name__} {rows['batches']} x {len(self):,} per epoch, {rows['cache']}>"

    def _repr_html_(self) -> str:
        """A short table of what the loader yields, for a notebook."""
        return html_table(
            f"saev_shards.{type(self).__name__}", self.summary_rows(), "iterate for one epoch; state_dict() to resume"
        )

    # -- epochs and resuming -----------------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter()`` run epoch ``epoch`` from its first batch."""
        if not (is_int(epoch, numpy_ok=True) and 0 <= epoch < 2**63):
            raise LoaderError(f"epoch: expected an integer >= 0, found {short_repr(epoch)}")
        self._next_epoch = int(epoch)
        self._resume_batch = 0
        self._position = None

    def state_dict(self) -> dict[str, Any]:
        """Where the next ``iter()`` starts: mid-epoch while an iteration is under way."""
        if self._position is not None:
            epoch, batch = self._position
            if batch >= self._len:
                epoch, batch = epoch + 1, 0
        else:
            epoch, batch = self._next_epoch, self._resume_batch
        return {
            "epoch": epoch,
            "batch": batch,
            "seed": self.seed,
            "fingerprint": self.fingerprint,
            "settings": self.settings,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume exactly where `state_dict` was taken (same cache and settings).

        Accepts exactly what `state_dict` gives: ``epoch`` an integer >= 0, ``batch`` an
        integer in ``[0, len(self)]`` (never a float, a bool or a string: 1.9 would replay a
        batch), ``seed`` an integer, ``fingerprint`` 16 hex digits, ``settings`` (optional:
        states saved before it still load) an object; `LoaderError` names every field that is
        not, and the setting that differs when the state is another loader's."""
        epoch, batch = check_state(state, self._len)
        check_same(state, self.seed, self.fingerprint, self.settings)
        self._next_epoch, self._resume_batch = (epoch + 1, 0) if batch == self._len else (epoch, batch)
        self._position = None

    def plan(self, epoch: int) -> EpochPlan:
        """The windows of epoch ``epoch`` on this rank (cheap: no data is read)."""
        order = self.order.block_order(len(self._spans), self.seed, epoch)
        return plan_epoch(
            self._spans,
            order,
            self.rank,
            self.world_size,
            self._window_rows,
            self.batch_size,
            self.drop_last,
            self._first_window_rows,
        )

    def epoch_examples(self, epoch: int, limit: int | None = None) -> npt.NDArray[np.int64]:
        """Example of each of the first ``limit`` rows this rank yields in epoch ``epoch``.

        Computed from the plan alone (no activation is read), so the shuffle quality of any
        cache can be measured from its metadata; batch ``i`` holds entries ``[i*B, (i+1)*B)``.
        """
        plan = self.plan(epoch)
        need = plan.n_units if limit is None else min(limit, plan.n_units)
        pieces, got = [], 0
        for window in plan.windows:
            if got >= need:
                break
            index = index_window(self.selection, self._spans, window, self._window_rng(epoch, window.index))
            pieces.append(index.examples)
            got += len(index)
        return np.concatenate(pieces)[:need] if pieces else np.zeros(0, dtype=np.int64)

    def _window_rng(self, epoch: int, window: int) -> np.random.Generator | None:
        return self.order.window_rng(self.seed, epoch, window, self.rank, self.world_size)

    # -- iteration ---------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        epoch, start = self._next_epoch, self._resume_batch
        self._next_epoch, self._resume_batch = epoch + 1, 0
        self._position = (epoch, start)
        return self._iterate(epoch, start)

    def _iterate(self, epoch: int, start: int) -> Iterator[Batch]:
        cfg = self._config
        rows = self._buffer_rows()
        run: HostRun | DeviceRun
        release: Callable[[], None]
        if self.device is not None:
            schedule = Schedule(self.plan(epoch), start, 1)
            slots = self._spares.take_slots(self.device, schedule.n_slots, rows)
            run = DeviceRun(cfg, Epoch(schedule, epoch, self._window_rng), slots)
            release = lambda: self._spares.give_slots(slots)  # noqa: E731
        else:
            # Windows in the page cache are read in place; the others into these buffers, which
            # take memory only once written (numpy's pages are the kernel's until touched).
            spares = self._spares
            cfg.mapped = spares.cache_map()
            # This epoch's plan and first index, if computed while the last one ended (`ahead`).
            ahead = self._ahead.take(epoch, cfg.mapped if start == 0 else None)
            schedule = Schedule(self.plan(epoch) if ahead is None else ahead[0], start, cfg.chunk_batches)
            buffers = spares.take_buffers(schedule.n_slots, rows) if len(schedule) else []
            values, scales = [b for b, _ in buffers], [s for _, s in buffers if s is not None]
            pools = spares.take_pools()
            index_next = functools.partial(self._ahead.queue, self, epoch + 1, pools.read)
            run_epoch = Epoch(schedule, epoch, self._window_rng, None if ahead is None else ahead[1], index_next)
            run = HostRun(cfg, run_epoch, values, scales, pools)

            def release() -> None:
                spares.give_buffers(buffers)
                spares.give_pools(pools)

        self._runs.add(run)
        _LIVE_RUNS.add(run)
        order = self._site_order
        try:
            for i, batch in enumerate(run, start=start + 1):
                if self._position is not None and self._position[0] == epoch:
                    self._position = (epoch, i)
                yield batch if order is None else _reordered(batch, order)
        finally:
            run.close()
            release()

    def _buffer_rows(self) -> int:
        """``(T, D)`` slices one window buffer holds: a window and one more block."""
        return min(self._window_rows + self._spans.max_rows, int(self._spans.rows.sum()))

    def close(self) -> None:
        """Stop every running iteration (threads joined), free the window buffers and unmap the
        cache read in place (iterating again starts over)."""
        for run in list(self._runs):
            run.close()
            if isinstance(run, HostRun):  # a suspended iterator gives its threads back only when it resumes
                run.pools.shutdown()
        self._ahead.clear()
        self._spares.clear()

    def __del__(self) -> None:
        # Not contextlib.suppress: it may be gone at interpreter shutdown (`Shards.__del__`).
        try:  # noqa: SIM105
            self.close()
        except Exception:  # noqa: S110
            pass

    def __enter__(self) -> TokenLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _window_rows(shards: Shards, buffer_bytes: int, order: Order) -> tuple[int, int | None]:
    """``(T, D)`` slices of a window of ``buffer_bytes``, and of the first window where cutting it
    smaller changes no batch (`order.windows_free`: `order.FIRST_WINDOW_BYTES`), else None."""
    md = shards.metadata
    slice_bytes = max(1, md.tokens_per_ex * md.d_model * md.itemsize)
    first = max(1, FIRST_WINDOW_BYTES // slice_bytes) if windows_free(order) else None
    return max(1, buffer_bytes // slice_bytes), first


def _reordered(batch: Batch, order: tuple[int, ...]) -> Batch:
    """``batch`` with its stacked sites in the order asked (a gathered row holds them in storage order)."""
    import torch

    index = torch.as_tensor(order, device=batch.acts.device)
    acts = batch.acts.index_select(1, index)
    if batch.acts.device.type == "cpu" and batch.acts.is_pinned():  # pin_memory=True: keep the promise
        acts = acts.pin_memory()
    layers = batch.layers.index_select(1, index.to(batch.layers.device))
    return Batch(acts, batch.examples, batch.tokens, layers, batch.labels)


def _check_counts(batch_size: object, seed: int, counts: dict[str, int | None]) -> None:
    """`LoaderError` for a ``batch_size`` that is not an integer >= 1, a negative ``seed``, or one
    of ``counts`` below 1 (a thread count of None is the default)."""
    if not is_int(batch_size, numpy_ok=True) or batch_size < 1:  # type: ignore[operator]
        raise LoaderError(f"batch_size: expected an integer >= 1, found {batch_size!r}")
    if int(seed) < 0:
        raise LoaderError(f"seed: expected an integer >= 0, found {seed}")
    for name, value in counts.items():
        if value is not None and int(value) < 1:
            raise LoaderError(f"{name}: expected an integer >= 1, found {value}")


def _parse_device(device: Any) -> Any:
    import torch

    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise LoaderError(f"device: expected None, 'cpu', 'cuda' or a torch.device, found {device!r}") from err
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise LoaderError(f"device={device!r}: expected a CUDA GPU, found torch.cuda.is_available() = False")
    if parsed.type not in ("cpu", "cuda"):
        raise LoaderError(f"device: expected 'cpu' or 'cuda', found {device!r}")
    return parsed


class ShuffledLoader(TokenLoader):
    """Shuffled batches ``(B, D)`` of single token vectors: `TokenLoader` with ``order="shuffled"``.

    Each epoch has a new order drawn from ``(seed, epoch)``: spans of ``block_bytes`` permuted
    over the whole cache, loaded into windows of ``buffer_bytes``, every vector of a window
    permuted (docs/loaders.md: shuffle quality). Same arguments as `TokenLoader`.
    """


#: The OrderedLoader's default window: a page-cached window is read in place (no buffer), and
#: each window costs its index, residency checks and hand-offs (about a millisecond of CPU on a
#: busy 2-core machine, where 64 MiB windows kept the loader at 0.90-0.95 of 256 MiB ones); from
#: a cold cache two of them are buffers (512 MiB), and the first window is 64 MiB
#: (`order.FIRST_WINDOW_BYTES`), so the first batch waits for no more than it did with 64 MiB.
ORDERED_BUFFER_BYTES = 256 << 20


def _ordered_signature() -> inspect.Signature:
    """`TokenLoader`'s signature without ``seed`` and ``order``, with the ordered walk's defaults."""
    params = []
    for name, param in inspect.signature(TokenLoader.__init__).parameters.items():
        if name in ("self", "seed", "order"):
            continue
        # The ordered walk's windows decide nothing but memory and the work done per window.
        params.append(param.replace(default=ORDERED_BUFFER_BYTES) if name == "buffer_bytes" else param)
    return inspect.Signature(params)


class OrderedLoader(TokenLoader):
    """Batches ``(B, D)`` in strict ``(example, layer, token)`` order, identical every epoch.

    `TokenLoader` with ``order="ordered"``: the same arguments, less ``seed``, with
    ``buffer_bytes=256 << 20`` (its first window 64 MiB: the batches are the same however the
    windows are cut). Reads are sequential spans prefetched by background threads;
    batches run across shard boundaries. With ``rank`` and ``world_size`` each rank walks one
    contiguous part of the order.
    """

    __signature__ = _ordered_signature()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        bound = self.__signature__.bind(*args, **kwargs)  # TypeError for a bad call, as usual
        bound.apply_defaults()
        super().__init__(**bound.arguments, order="ordered")
