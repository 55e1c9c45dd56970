"""Running a dump: the forward passes, the writer, publishing, and the truncation report."""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..codecs import float8
from ..errors import (
    AlreadyPublishedError,
    DumpError,
    NameNotFoundError,
    ShardsError,
    WriterBusyError,
    WriterError,
)
from ..fileio import check_free_space
from ..humanize import human_bytes
from ..progress import Progress
from ..protocol.common import FLOAT8
from ..protocol.metadata import Metadata
from ..reader import Shards
from ..reader import open as open_shards
from ..writer import ShardWriter, finalize, rank_shards, sealed_shards, world_from_env
from .config import DumpConfig
from .model import Encoded, check_model, device_of, load_model, record_dtype
from .plan import DumpPlan, batches, output_root, plan, space_needed

if TYPE_CHECKING:
    import torch

    from .recorder import Recorder


def dump(
    config: DumpPlan | DumpConfig | Mapping[str, Any] | str | os.PathLike[str],
    *,
    root: str | os.PathLike[str] | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    restart: bool = False,
    finalize_when_done: bool = True,
    progress: bool | None = None,
    durable: bool = True,
    check_space: bool = True,
    log: Callable[[str], None] | None = None,
) -> Path | None:
    """Record the activations of ``config`` into ``<root>/<hash>``; return its path once published.

    ``config``: a `DumpPlan` (reused when its model is loaded), a `DumpConfig`, a dict, or a file.
    ``root``: the folder of caches; default the config's ``root``, else the shards root
    (`output_root`).

    Before anything is written: the configuration is checked against the loaded model
    (`check_model`: blocks, positions, width, device and dtype; `ConfigError` naming the
    field), and ``check_space`` refuses with `DiskFullError` when this writer's remaining
    bytes (`space_needed`) exceed the free space under the root (``check_space=False``, or
    ``--no-space-check``, if you know better). A corpus of no examples is a `ConfigError`
    when planning (`plan`).

    Resumes from sealed shards unless ``restart``: after any interruption, run it again.
    With several writers, each rank writes its shards and then tries to publish: the last
    one to finish succeeds and returns the path; the others return None. Already
    published: returns the path at once.
    """
    say = log or _print
    # The hash first (no weights needed for Hugging Face folders): a published cache is done.
    the_plan = config if isinstance(config, DumpPlan) else plan(config, weights=False)
    md = the_plan.metadata
    out_root = output_root(the_plan.config, root).path
    final = out_root / md.hash
    if final.exists():
        say(f"already published: {final}")
        return final
    rank, world_size = world_from_env(rank, world_size)
    if check_space:
        share = rank_shards(md.n_shards, rank, world_size)
        what = f"dumping shards [{share.start}, {share.stop}) of {md.n_shards}"
        needed = space_needed(the_plan, out_root, rank, world_size, restart=restart)
        check_free_space(out_root, needed, what, "pass --no-space-check (check_space=False)")
    run = _start(the_plan, out_root, rank, world_size, restart=restart, durable=durable, say=say)
    t0 = time.perf_counter()
    done = _record_all(run, progress)
    path = run.writer.close()
    dt = time.perf_counter() - t0
    say(
        f"{run.who}wrote {done} examples in {dt:.1f} s ({done / max(dt, 1e-9):.1f} examples/s, "
        f"{human_bytes(done * md.example_nbytes / max(dt, 1e-9))}/s of activations)"
    )
    if path is None and finalize_when_done:
        path = try_finalize(out_root, md, say=say)
    if path is not None:
        say(f"published {path}")
        say(truncation_line(open_shards(path)))
    return path


@dataclasses.dataclass
class _Run:
    """One writer's dump under way: the plan with its model loaded, the recorder and the writer."""

    plan: DumpPlan
    device: torch.device
    recorder: Recorder
    writer: ShardWriter
    #: Tokenize and write between forward passes, in this thread (`model_takes_every_core`).
    inline: bool
    #: ``"rank r of W: "`` with several writers, for messages.
    who: str


def _start(
    the_plan: DumpPlan,
    out_root: Path,
    rank: int,
    world_size: int,
    *,
    restart: bool,
    durable: bool,
    say: Callable[[str], None],
) -> _Run:
    """Load and check the model (before the writer makes its staging folder), then open the writer."""
    cfg, md = the_plan.config, the_plan.metadata
    device = device_of(cfg)
    if the_plan.loaded.model is None:
        the_plan = dataclasses.replace(the_plan, loaded=load_model(cfg))
    check_model(cfg, the_plan.loaded, device, md.d_model, the_plan.recording)
    from .recorder import Recorder, model_takes_every_core

    inline = model_takes_every_core(device)
    model = the_plan.loaded.model.to(device)
    recorder = Recorder(model, the_plan.recording, blocks=cfg.model.blocks, dtype=record_dtype(cfg.dtype))
    writer = ShardWriter(
        out_root,
        md,
        rank=rank,
        world_size=world_size,
        resume=not restart,
        allow_nonfinite=cfg.allow_nonfinite,
        stats=True,
        columns=the_plan.columns,
        text=the_plan.text_fields,
        durable=durable,
        background=not inline,
    )
    start, stop, resume_at = writer.start, writer.stop, writer.next_example
    who = f"rank {rank} of {world_size}: " if world_size > 1 else ""
    if resume_at > start:
        say(f"{who}resuming at example {resume_at} ({resume_at - start} of {stop - start} already sealed)")
    say(
        f"{who}dumping examples [{resume_at}, {stop}) of {md.n_examples} on {device}: {md.n_layers} "
        + (f"layers {list(md.layers)}" if md.sites is None else "sites")
        + f" x {md.tokens_per_ex} tokens x {md.d_model} ({md.dtype}) -> {writer.staging}"
    )
    return _Run(the_plan, device, recorder, writer, inline, who)


def _record_all(run: _Run, progress: bool | None) -> int:
    """Record this writer's remaining examples batch by batch; the examples written.

    Three stages overlap: the next batch is tokenized in a thread of its own (`_tokenize`;
    on a GPU the tokenizer, not the model, would otherwise pace the dump) while this one
    runs through the model, and the previous one is written by a third (`AsyncWriter`).
    A model on the CPU with a thread on every core (``run.inline``) leaves no core for
    them: each batch is then tokenized, recorded and written in turn, in this thread.
    On any error or interruption the writer is aborted: sealed shards stay in staging for
    the next run, and the caller reports the reason once (the command line: one line, with
    the resume hint).
    """
    from .recorder import AsyncWriter

    md, cfg = run.plan.metadata, run.plan.config
    writer = run.writer
    grid = list(batches(writer.next_example, writer.stop, md.examples_per_shard, cfg.batch_size))
    done = 0
    t0 = time.perf_counter()
    sink = AsyncWriter(writer, background=not run.inline)
    tokenizer = ThreadPoolExecutor(1, "saev-shards-tokenizer")
    try:
        with Progress(writer.stop - writer.next_example, "dump", unit="ex", enabled=progress) as bar:
            upcoming = tokenizer.submit(_tokenize, run, *grid[0]) if grid and not run.inline else None
            for i, (a, b) in enumerate(grid):
                if run.inline:
                    enc = _tokenize(run, a, b)
                else:
                    assert upcoming is not None
                    enc = upcoming.result()
                    if i + 1 < len(grid):
                        upcoming = tokenizer.submit(_tokenize, run, *grid[i + 1])
                acts, extras = _record_batch(run, a, b, enc)
                sink.submit(acts, **extras)
                done += b - a
                rate = done * md.example_nbytes / max(time.perf_counter() - t0, 1e-9)
                bar.update(b - a, extra=f"{human_bytes(rate)}/s")
            sink.join()
    except BaseException:
        tokenizer.shutdown(wait=True, cancel_futures=True)  # at most the batch being tokenized
        sink.abort()
        raise
    tokenizer.shutdown()
    return done


def _tokenize(run: _Run, a: int, b: int) -> Encoded:
    """Examples ``[a, b)`` tokenized (`TextEncoder.encode`); the tokenizer's own errors as `DumpError`."""
    try:
        return run.plan.loaded.encoder.encode([ex.text for ex in run.plan.corpus.examples[a:b]])
    except ShardsError:
        raise
    except Exception as err:  # the tokenizer's own code
        raise _failed(run, a, b, "the tokenizer", err) from err


def _failed(run: _Run, a: int, b: int, what: str, err: Exception) -> DumpError:
    return DumpError(
        f"{what} failed on examples [{a}, {b}) of {run.plan.metadata.n_examples} ({type(err).__name__}: {err}); "
        f"the shards sealed before them are kept in {run.writer.staging}"
    )


def _record_batch(run: _Run, a: int, b: int, enc: Encoded) -> tuple[Any, dict[str, Any]]:
    """Examples ``[a, b)``, tokenized as ``enc``, through the model: the activations (a
    float8_e4m3 cache's quantized on the model's device, so one byte per value crosses to
    the host) and what `ShardWriter.write` takes with them (columns, text, scales)."""
    import torch

    md = run.plan.metadata
    chunk = run.plan.corpus.examples[a:b]
    extras: dict[str, Any] = {}
    try:
        inputs = {k: v.to(run.device) for k, v in enc.inputs.items()}
        acts = run.recorder.record(**inputs, lengths=torch.as_tensor(enc.lengths))
        if md.dtype == FLOAT8:
            acts, extras["scales"] = float8.quantize_tensor(acts)
    except ShardsError:
        raise
    except Exception as err:  # the model's own code
        raise _failed(run, a, b, "the model", err) from err
    ds = run.plan.config.dataset
    columns: dict[str, Any] = {"lengths": enc.lengths, "true_lengths": enc.true_lengths, "token_ids": enc.token_ids}
    for name, col_dtype in ds.columns.items():
        columns[name] = np.array([ex.fields[name] for ex in chunk], dtype=np.dtype(col_dtype))
    text: dict[str, list[Any]] = {"id": [ex.id for ex in chunk], "text": [ex.text for ex in chunk]}
    for name in ds.text_fields:
        text[name] = [ex.fields[name] for ex in chunk]
    return acts, {**extras, "columns": columns, "text": text}


def try_finalize(root: Path, md: Metadata, *, say: Callable[[str], None] = print) -> Path | None:
    """Publish a multi-writer cache if every shard is sealed and no writer is running; else None."""
    try:
        return finalize(root, md)
    except AlreadyPublishedError:
        return root / md.hash
    except WriterBusyError:
        say("other writers are still running; the last one to finish publishes")
        return None
    except WriterError as err:
        sealed = set(sealed_shards(root, md))
        missing = [k for k in range(md.n_shards) if k not in sealed]
        if not missing:  # every shard is sealed, so finalize failed for another reason: say it whole
            say(f"not published: every shard is sealed, but finalizing failed: {err}")
        else:
            say(
                f"not published yet: {len(sealed)} of {md.n_shards} shards sealed; {shard_ranges(missing)} still to "
                "be written by the other writers (the last to finish publishes; or run again with --finalize)"
            )
        return None


def shard_ranges(shards: Sequence[int]) -> str:
    """``"shard 4"``, ``"shards 0-2, 4, 6-15"``: ascending shard indices as runs."""
    runs: list[list[int]] = []
    for k in shards:
        if runs and k == runs[-1][1] + 1:
            runs[-1][1] = k
        else:
            runs.append([k, k])
    text = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)
    return ("shard " if len(shards) == 1 else "shards ") + text


def truncation(shards: Shards) -> dict[str, Any]:
    """Truncation statistics of a dumped cache, from its ``true_lengths`` and ``lengths`` columns
    (`NameNotFoundError`, a `KeyError`, for a cache without them).

    ``truncated_count``: examples with more tokens than fit (``true_lengths > T``);
    ``truncated_fraction``: that over ``n_examples``; ``dropped_tokens`` and
    ``dropped_token_fraction``: tokens cut off, and their share of all tokens.
    """
    cols = shards.columns
    if "true_lengths" not in cols or "lengths" not in cols:
        raise NameNotFoundError(
            f"{shards.path}: no true_lengths and lengths columns (a cache not written by dump); "
            f"its columns: {sorted(cols) or 'none'}"
        )
    true = np.asarray(cols["true_lengths"], np.int64)
    kept = np.asarray(cols["lengths"], np.int64)
    n = len(true)
    count = int((true > kept).sum())
    dropped = int((true - kept).sum())
    total = int(true.sum())
    return {
        "T": shards.metadata.tokens_per_ex,
        "n_examples": n,
        "truncated_count": count,
        "truncated_fraction": count / n if n else 0.0,
        "dropped_tokens": dropped,
        "dropped_token_fraction": dropped / total if total else 0.0,
        "mean_true_length": float(true.mean()) if n else 0.0,
    }


def truncation_line(shards: Shards) -> str:
    t = truncation(shards)
    return (
        f"truncation to T={t['T']}: {t['truncated_count']} of {t['n_examples']} examples "
        f"({100 * t['truncated_fraction']:.1f}%), {100 * t['dropped_token_fraction']:.1f}% of tokens dropped "
        f"(mean true length {t['mean_true_length']:.1f})"
    )


def _print(msg: str) -> None:
    print(msg, flush=True)
