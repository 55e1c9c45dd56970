"""Record the residual stream of chosen blocks, or the input or output of any module, of any
`torch.nn.Module` with forward hooks.

>>> rec = Recorder(model, layers=[3, 1], dtype="float16")     # doctest: +SKIP
>>> acts = rec.record(input_ids=ids, attention_mask=mask, lengths=lengths)  # doctest: +SKIP
>>> acts.shape                                               # doctest: +SKIP
torch.Size([B, 2, T, D])      # layer axis in the order of ``layers``: 3, then 1

Blocks are named by index into the model's list of blocks (found automatically, the
largest `torch.nn.ModuleList`, or named with ``blocks="encoder.layer"``), or by dotted
module name (``layers={0: "embeddings", 6: "encoder.layer.5"}``), or by site: the input or
the output of any module (``layers={0: "encoder.layer.3.intermediate:input", 1:
"encoder.layer.3.output.dense:output"}``, a transcoder's pair; protocol.md 2.1.1). An
output is the tensor a module returns (or the first element of a tuple); an input is the
first tensor its forward is called with (positionally, else the ``hidden_states``
keyword, else the first tensor keyword). Hooks are installed
for one forward pass and removed afterwards, also when the pass raises. The forward
pass runs under `torch.inference_mode` and stops as soon as every recorded block has
run. Values are cast to the stored dtype on the model's device, so only the stored
bytes cross to the host.

`AsyncWriter` hands recorded batches to a `ShardWriter` in a background thread: the
copy to host (on CUDA: on a side stream into pinned memory) and the writer's disk I/O
overlap the next forward pass.

torch is imported when this module is imported; ``import saev_shards`` never imports it.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import RecorderError, WriterError
from ..protocol.sites import Site, as_site
from ..selection import string_layers_problem
from ..writer import ShardWriter

#: Stored dtype names to torch dtypes.
TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class _StopForward(Exception):
    """Raised by the last hook to cut the forward pass short."""


def find_blocks(model: torch.nn.Module) -> str:
    """Dotted name of the model's block list: the `torch.nn.ModuleList` or `torch.nn.Sequential`
    with the most children (ties: ModuleList first, then the shortest name), e.g.
    ``encoder.layer`` (BERT, HF ViT), ``h`` (GPT-2), ``layers`` (Llama), ``blocks`` (timm ViT)."""
    best: tuple[int, bool, int, str] | None = None
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential)) and len(module) > 0:
            key = (-len(module), isinstance(module, torch.nn.Sequential), len(name), name)
            if best is None or key < best:
                best = key
    if best is None:
        raise RecorderError(f"{type(model).__name__} has no list of blocks (ModuleList, Sequential); name the modules")
    return best[3]


def resolve_modules(
    model: torch.nn.Module,
    layers: Sequence[int] | Mapping[int, str | tuple[str, str]],
    blocks: str | None = None,
) -> dict[int, tuple[str, torch.nn.Module]]:
    """Layer value -> ``(dotted name, module)``.

    ``layers`` is either a sequence of indices into the block list ``blocks`` (found with
    `find_blocks` when None; negative indices count from the end) or a mapping from layer
    value to dotted module name, or to a site (`resolve_sites` says which end of the module).
    """
    return {value: (name, module) for value, (name, module, _) in resolve_sites(model, layers, blocks).items()}


def resolve_sites(
    model: torch.nn.Module,
    layers: Sequence[int] | Mapping[int, str | tuple[str, str]],
    blocks: str | None = None,
) -> dict[int, tuple[str, torch.nn.Module, str]]:
    """Layer value -> ``(dotted name, module, "input" or "output")``.

    As `resolve_modules`; a mapping's value is a dotted module name (its output), or a site:
    a `Site`, a ``(name, io)`` pair or ``"name:io"`` with io ``"input"`` or ``"output"``
    (``""`` names the model itself).
    """
    as_string = string_layers_problem("layers", layers)
    if as_string is not None:
        raise RecorderError(as_string)
    named = dict(model.named_modules())
    out: dict[int, tuple[str, torch.nn.Module, str]] = {}
    if isinstance(layers, Mapping):
        for value, target in layers.items():
            site = as_site(target) if not isinstance(target, str) or ":" in target else None
            name, io = (site.module, site.io) if site is not None else (target, "output")
            if not isinstance(name, str):
                raise RecorderError(f"layer {value}: expected a module name or a site 'name:io', found {target!r}")
            if name not in named:
                near = [n for n in named if n.endswith("." + name.rsplit(".", 1)[-1])][:4]
                hint = f" (modules with that last part: {near})" if near else ""
                raise RecorderError(f"layer {value}: no module named {name!r} in {type(model).__name__}{hint}")
            out[int(value)] = (name, named[name], io)
        return out
    list_name = blocks if blocks is not None else find_blocks(model)
    block_list = named.get(list_name)
    if not isinstance(block_list, (torch.nn.ModuleList, torch.nn.Sequential)):
        raise RecorderError(f"{list_name!r} is not a ModuleList or Sequential in {type(model).__name__}")
    n = len(block_list)
    for layer in layers:
        if not -n <= int(layer) < n:
            raise RecorderError(f"layer {layer} out of range: {list_name} has {n} blocks")
        idx = int(layer) % n
        out[int(layer)] = (f"{list_name}.{idx}" if list_name else str(idx), block_list[idx], "output")
    return out


def _first_input(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The tensor a module's forward is called with: the first positional tensor, else the
    ``hidden_states`` keyword, else the first tensor keyword (None when there is none)."""
    for value in args:
        if isinstance(value, torch.Tensor):
            return value
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return kwargs["hidden_states"]
    return next((v for v in kwargs.values() if isinstance(v, torch.Tensor)), None)


def _hidden(output: Any) -> torch.Tensor:
    """The hidden states in a block's output: a tensor, or the first element of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    hidden = getattr(output, "last_hidden_state", None)
    if isinstance(hidden, torch.Tensor):
        return hidden
    raise RecorderError(f"cannot find the hidden states in a block output of type {type(output).__name__}")


class Recorder:
    """Capture the outputs of chosen blocks (or the inputs or outputs of any modules) as one
    ``(B, L, T, D)`` tensor per forward pass.

    Arguments:
        model: any module whose blocks output ``(B, T, D)`` hidden states (a tensor or a
            tuple whose first element is one).
        layers: layer values in the order of ``metadata.layers``: indices into the block
            list, or a mapping ``{layer value: dotted module name}`` (its output) or
            ``{layer value: site}`` (``"name:input"``, ``"name:output"``, a `Site`), so that
            ``Recorder(model, dict(zip(md.layers, md.sites)))`` records a cache's sites.
        blocks: dotted name of the block list (default: `find_blocks`).
        dtype: stored dtype (``"float16"``, ``"bfloat16"``, ``"float32"``); the cast runs
            on the model's device.
        stop_early: end the forward pass once the last recorded block has run (the
            model's own output is never needed).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        layers: Sequence[int] | Mapping[int, str | tuple[str, str]],
        *,
        blocks: str | None = None,
        dtype: str = "float16",
        stop_early: bool = True,
    ) -> None:
        if dtype not in TORCH_DTYPES:
            raise RecorderError(f"dtype must be one of {list(TORCH_DTYPES)}, found {dtype!r}")
        self.model = model
        resolved = resolve_sites(model, layers, blocks)
        self.modules = {value: (name, module) for value, (name, module, _) in resolved.items()}
        #: What each slot holds, in layer order: the module's dotted name and "input" or "output".
        self.sites = tuple(Site(name, io) for name, _, io in resolved.values())
        self.layers = tuple(self.modules)
        if len(set(self.layers)) != len(self.layers) or not self.layers:
            raise RecorderError(f"layers must be distinct and non-empty, found {list(self.layers)}")
        self.dtype = dtype
        self.stop_early = stop_early

    def record(self, *args: Any, lengths: Any = None, **kwargs: Any) -> torch.Tensor:
        """Run ``model(*args, **kwargs)``; return ``(B, L, T, D)`` in the stored dtype on the model's device.

        ``lengths`` (``(B,)`` integers): positions at or beyond ``lengths[b]`` are padding
        and are set to zero.
        """
        n_layers = len(self.layers)
        slots: list[torch.Tensor | None] = [None] * n_layers
        state: dict[str, Any] = {"out": None, "filled": 0}
        target = TORCH_DTYPES[self.dtype]

        def make_hook(slot: int, site: Site) -> Any:
            name = site.module if site.io == "output" else str(site)

            def hook(module: torch.nn.Module, inputs: Any, output: Any) -> None:
                store(_hidden(output))

            def pre_hook(module: torch.nn.Module, args: Any, kwargs: Any) -> None:
                hidden = _first_input(tuple(args), dict(kwargs))
                if hidden is None:
                    raise RecorderError(f"{name}: the module was called without a tensor argument")
                store(hidden)

            def store(hidden: torch.Tensor) -> None:
                if hidden.ndim != 3:
                    raise RecorderError(f"{name}: expected hidden states (B, T, D), found shape {tuple(hidden.shape)}")
                if slots[slot] is not None:
                    raise RecorderError(f"{name} ran twice in one forward pass; record a module that runs once")
                out = state["out"]
                if out is None:
                    b, t, d = hidden.shape
                    out = torch.empty((b, n_layers, t, d), dtype=target, device=hidden.device)
                    state["out"] = out
                elif hidden.shape != (out.shape[0], out.shape[2], out.shape[3]):
                    raise RecorderError(
                        f"{name}: {site.io} shape {tuple(hidden.shape)} differs from the other recorded sites' "
                        f"{(out.shape[0], out.shape[2], out.shape[3])}"
                    )
                out[:, slot].copy_(hidden)  # the cast happens here, on the model's device
                slots[slot] = out[:, slot]
                state["filled"] += 1
                if self.stop_early and state["filled"] == n_layers:
                    raise _StopForward

            return pre_hook if site.io == "input" else hook

        handles = []
        try:
            for slot, ((_, module), site) in enumerate(zip(self.modules.values(), self.sites, strict=True)):
                if site.io == "input":
                    handles.append(module.register_forward_pre_hook(make_hook(slot, site), with_kwargs=True))
                else:
                    handles.append(module.register_forward_hook(make_hook(slot, site)))
            with torch.inference_mode(), contextlib.suppress(_StopForward):
                self.model(*args, **kwargs)
        finally:
            for h in handles:
                h.remove()
        out = state["out"]
        missing = [self.layers[i] for i, s in enumerate(slots) if s is None]
        if out is None or missing:
            raise RecorderError(f"layers {missing} did not run in the forward pass")
        if lengths is not None:
            _zero_padding(out, lengths)
        assert isinstance(out, torch.Tensor)
        return out

    __call__ = record


def _zero_padding(out: torch.Tensor, lengths: Any) -> None:
    """Set positions at or beyond ``lengths[b]`` of ``out`` ``(B, L, T, D)`` to zero.

    On the CPU, integer lengths zero one slice per padded example, touching the padding
    only (a mask over the whole batch reads and writes every value: ~3x the CPU time
    here); elsewhere one masked fill (one kernel, not one per example). Both store +0.0.
    """
    given = np.asarray(lengths.cpu() if isinstance(lengths, torch.Tensor) else lengths)
    with torch.inference_mode():
        if out.device.type == "cpu" and given.dtype.kind in "iu" and given.size == out.shape[0]:
            n_tokens = out.shape[2]
            for b, n in enumerate(given.reshape(-1).tolist()):
                if n < n_tokens:
                    out[b, :, max(n, 0) :].zero_()
            return
        lengths_t = torch.as_tensor(given, device=out.device).reshape(-1, 1)
        positions = torch.arange(out.shape[2], device=out.device)
        padding = positions[None, :] >= lengths_t  # (B, T)
        out.masked_fill_(padding[:, None, :, None], 0)


def model_takes_every_core(device: torch.device) -> bool:
    """Whether a model on ``device`` computes with a thread on every core this process may
    use (the CPU, with as many torch threads as cores): then the dump tokenizes and writes
    between forward passes instead of beside them. Threads beside the model's take a core
    from one of its threads, and the others wait for it at each parallel region's end: on 2
    cores a few percent of work done beside the model cost about 10 % of its speed, done
    between its passes their own few percent."""
    if device.type != "cpu":
        return False
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return torch.get_num_threads() >= cores


class AsyncWriter:
    """Feed a `ShardWriter` from a background thread, in submission order.

    `submit` returns at once (blocking only when ``depth`` batches are already waiting):
    the copy to host and the writer's work run while the caller computes the next batch.
    CUDA tensors are copied on a side stream into pinned memory; the thread waits for that
    copy alone, never for the forward passes queued after it. All of the writer's methods
    are called from the thread, until `close` (which joins it).

    ``background=False`` writes each batch in `submit`, in the caller's thread (for a model
    on the CPU that keeps every core busy: `model_takes_every_core`).
    """

    def __init__(self, writer: ShardWriter, depth: int = 2, *, background: bool = True) -> None:
        self.writer = writer
        self.error: BaseException | None = None
        self._queue: queue.Queue[tuple[Any, Any, dict[str, Any]] | None] = queue.Queue(maxsize=depth)
        self._streams: dict[torch.device, Any] = {}
        self._thread: threading.Thread | None = None
        if background:
            self._thread = threading.Thread(target=self._run, name="saev-shards-recorder", daemon=True)
            self._thread.start()

    def submit(self, acts: torch.Tensor, **extras: Any) -> None:
        """Queue ``writer.write(acts, **extras)``; ``acts`` (and a tensor of ``scales``) must not
        be changed afterwards."""
        self._check()
        if self._thread is None:
            self.writer.write(acts.cpu(), **extras)
            return
        event = None
        if acts.is_cuda:
            stream = self._streams.get(acts.device)
            if stream is None:
                stream = self._streams[acts.device] = torch.cuda.Stream(acts.device)  # type: ignore[no-untyped-call]
            stream.wait_stream(torch.cuda.current_stream(acts.device))
            with torch.cuda.stream(stream):
                acts = self._to_pinned(acts, stream)
                scales = extras.get("scales")
                if isinstance(scales, torch.Tensor) and scales.is_cuda:  # a float8_e4m3 cache's
                    extras = {**extras, "scales": self._to_pinned(scales, stream)}
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
        while True:  # wait for room, but notice if the thread died meanwhile
            try:
                self._queue.put((acts, event, extras), timeout=0.5)
                return
            except queue.Full:
                self._check()

    @staticmethod
    def _to_pinned(tensor: torch.Tensor, stream: Any) -> torch.Tensor:
        """A pinned host copy of a CUDA tensor, made on ``stream`` (the current stream)."""
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)  # the allocator must not reuse it before the copy ends
        return host

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self.error is not None:
                continue  # drain without writing after a failure
            acts, event, extras = item
            try:
                if event is not None:
                    event.synchronize()
                self.writer.write(acts, **extras)
            except BaseException as err:
                self.error = err

    def _check(self) -> None:
        if self.error is not None:
            raise self.error
        if self._thread is not None and not self._thread.is_alive():
            raise WriterError("the recorder's writer thread has stopped")

    def join(self) -> None:
        """Wait until every submitted batch is handed to the writer; raise the first error."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        if self.error is not None:
            raise self.error

    def close(self) -> Any:
        """`join`, then close the writer (which publishes a single writer's cache)."""
        self.join()
        return self.writer.close()

    def abort(self) -> None:
        """Stop without publishing; sealed shards stay for a resumed run."""
        if self._thread is not None and self._thread.is_alive():
            self.error = self.error or WriterError("aborted")
            self._queue.put(None)
            self._thread.join()
        self.writer.abort()

    def __enter__(self) -> AsyncWriter:
        return self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
