"""Everything a dump decides before any model runs: the corpus, the metadata (and so the
hash), where the cache goes, how the work is cut into batches, and how many bytes it needs.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ConfigError, RecorderError, RootNotSetError, ShardsError
from ..humanize import human_bytes
from ..protocol.metadata import Metadata
from ..protocol.sites import Site
from ..protocol.staging import staging_dir
from ..store import Root, shards_root
from ..writer import rank_shards, sealed_shards
from ..writer import space_needed as writer_space_needed
from . import corpus as corpus_mod
from .config import RESERVED_TEXT, DumpConfig, as_config, expand_sites
from .model import Loaded, check_limits, load_model, what_failed


def load_corpus(cfg: DumpConfig) -> corpus_mod.Corpus:
    """The examples the dump records, in order (at most ``cfg.budget``)."""
    ds = cfg.dataset
    if ds.kind == "stdlib":
        return corpus_mod.stdlib_corpus(cfg.budget, min_chars=ds.min_chars)
    assert ds.path is not None
    try:
        if ds.kind == "jsonl":
            fields = (*ds.columns, *ds.text_fields)
            return corpus_mod.jsonl_corpus(
                ds.path, text_field=ds.text_field, id_field=ds.id_field, fields=fields, limit=cfg.budget
            )
        return corpus_mod.lines_corpus(ds.path, limit=cfg.budget, min_chars=ds.min_chars)
    except (OSError, ValueError) as err:
        raise ConfigError(f"dataset: {err}") from None


def check_columns(cfg: DumpConfig, corpus: corpus_mod.Corpus) -> None:
    """`ConfigError` naming the first value of a ``dataset.columns`` field that its dtype
    cannot hold exactly (a string, a list, ``2.5`` in an ``int64`` column, a value out of
    range): found when planning, so it stops ``--dry-run`` and never a dump mid-way."""
    for name, dt in cfg.dataset.columns.items():
        dtype = np.dtype(dt)
        for i, ex in enumerate(corpus.examples):
            value = ex.fields[name]
            try:
                stored = np.array(value, dtype=dtype).item()
                exact = not isinstance(value, (str, bytes)) and (
                    stored == value or (isinstance(value, float) and math.isnan(value) and math.isnan(stored))
                )
            except (ValueError, TypeError, OverflowError):
                exact = False
            if not exact:
                raise ConfigError(
                    f"dataset.columns.{name}: expected {dtype.name} values, found {value!r} in example {i} "
                    f"(id {ex.id!r}) of {cfg.dataset.path}"
                )


def output_root(cfg: DumpConfig, root: str | os.PathLike[str] | None = None) -> Root:
    """Where the cache goes: ``root`` (``--root``) > the config's ``root`` > the shards root
    (``$SAEV_SHARDS_ROOT``, else ``$SAEV_SCRATCH/saev/shards``), where ``ls``, ``info`` and
    ``ss.open(prefix)`` look. `RootNotSetError` when none of them is set."""
    if root is not None:
        return Root(Path(root).expanduser().absolute(), "--root")
    if cfg.root is not None:
        return Root(Path(cfg.root).expanduser().absolute(), "the config's root")
    try:
        return shards_root()
    except RootNotSetError:
        raise RootNotSetError(
            "no folder for the cache: set root in the config, pass --root DIR, or set SAEV_SHARDS_ROOT "
            "or SAEV_SCRATCH (the cache then goes to the shards root, where ls, info and ss.open look)"
        ) from None


@dataclasses.dataclass
class DumpPlan:
    """Everything decided before any model runs: the metadata (and so the hash) and the work."""

    config: DumpConfig
    corpus: corpus_mod.Corpus
    loaded: Loaded
    metadata: Metadata
    blocks: dict[int, str]

    @property
    def recording(self) -> tuple[int, ...] | dict[int, Site]:
        """What the recorder records (`recorder.Recorder`'s ``layers``): the block indices, or
        for a dump of sites each slot's layer value and site."""
        return recording(self.config, self.metadata)

    @property
    def columns(self) -> dict[str, tuple[Any, tuple[int, ...]]]:
        """The per-example columns this dump writes: name -> (dtype, per-example shape)."""
        return _columns_for(self.config)

    @property
    def text_fields(self) -> tuple[str, ...]:
        return (*RESERVED_TEXT, *self.config.dataset.text_fields)


#: The name `DumpPlan` had before (kept for imports written then).
Plan = DumpPlan


def plan(config: DumpConfig | Mapping[str, Any] | str | os.PathLike[str], *, weights: bool = True) -> DumpPlan:
    """Read the corpus, load the model (weights only with ``weights``) and build the metadata.

    What the model's config.json declares (its blocks, its maximum positions) is checked
    against ``layers`` and ``T`` here, so ``--dry-run`` reports those mistakes too, and so is
    a corpus of no examples (``budget = 0``, every line shorter than ``min_chars``, an empty
    file): a `ConfigError`, never an empty cache.

    A dump of ``sites`` always loads the weights: the sites' full names come from the
    model's modules, and their width (``d_model``, which need not be the model's) from one
    trial forward pass.
    """
    cfg = as_config(config)
    corpus = load_corpus(cfg)
    if not len(corpus):
        raise ConfigError(f"dataset: {_why_empty(cfg)}; a dump needs at least one example (nothing was written)")
    check_columns(cfg, corpus)
    loaded = load_model(cfg, weights=weights or bool(cfg.sites))
    problems = check_limits(cfg, loaded.limits)
    if problems:
        raise ConfigError("; ".join(problems))
    blocks: dict[int, str] = {}
    d_model = loaded.d_model
    sites: tuple[Site, ...] | None = None
    if loaded.model is not None:
        from .recorder import find_blocks, resolve_sites

        field = "sites" if cfg.sites else "layers"
        try:
            if cfg.sites:
                block_list = "" if not cfg.layers else cfg.model.blocks or find_blocks(loaded.model)
                sites = expand_sites(cfg, block_list)
            what: Sequence[int] | dict[int, Site] = cfg.layers if sites is None else dict(enumerate(sites))
            resolved = resolve_sites(loaded.model, what, cfg.model.blocks)
        except RecorderError as err:
            raise ConfigError(f"{field}: {err}") from None
        blocks = {k: name if sites is None else f"{name}:{io}" for k, (name, _, io) in resolved.items()}
        if d_model is None or cfg.model.factory is not None or sites is not None:
            d_model = _probe_d_model(cfg, loaded, what)
    if d_model is None:
        raise ConfigError("model: cannot tell d_model from config.json (hidden_size, n_embd or d_model)")
    patches = cfg.T - (1 if loaded.cls_token else 0)
    data = {
        "corpus": dict(corpus.description),
        "model": {"ckpt": loaded.ckpt, **loaded.identity},
        "dump": {
            "T": cfg.T,
            "budget": cfg.budget,
            "batch_size": cfg.batch_size,
            "blocks": cfg.model.blocks,
            "record": (
                "block outputs (residual stream), padding positions zeroed"
                if sites is None
                else "the inputs and outputs of modules named by metadata sites, padding positions zeroed"
            ),
            "truncation": "tokenizer" if loaded.encoder.hf else "prefix",
            "columns": {k: [np.dtype(v[0]).str, list(v[1])] for k, v in _columns_for(cfg).items()},
            "text": [*RESERVED_TEXT, *cfg.dataset.text_fields],
        },
    }
    if sites is not None:  # only then: the data (and so the hash) of a dump without sites is as before
        data["dump"]["sites"] = [str(site) for site in cfg.sites]
    try:
        md = Metadata(
            family=loaded.family,
            ckpt=loaded.ckpt,
            layers=cfg.layers if sites is None else tuple(range(len(sites))),
            sites=sites,
            patches_per_ex=patches,
            cls_token=loaded.cls_token,
            d_model=d_model,
            n_examples=len(corpus),
            patches_per_shard=cfg.patches_per_shard,
            data=data,
            dataset=corpus.name,
            dtype=cfg.dtype,
        )
    except ShardsError as err:
        raise ConfigError(str(err)) from None
    return DumpPlan(cfg, corpus, loaded, md, blocks)


def _why_empty(cfg: DumpConfig) -> str:
    """Why `load_corpus` found no examples, for the `ConfigError`."""
    ds = cfg.dataset
    if cfg.budget == 0:
        return "budget = 0 asks for no examples"
    if ds.kind == "jsonl":
        return f"{ds.path} holds no records"
    where = "the standard-library corpus" if ds.kind == "stdlib" else str(ds.path)
    return f"{where} has no text of at least min_chars = {ds.min_chars} characters"


def _columns_for(cfg: DumpConfig) -> dict[str, tuple[Any, tuple[int, ...]]]:
    cols: dict[str, tuple[Any, tuple[int, ...]]] = {
        "lengths": (np.int32, ()),
        "true_lengths": (np.int32, ()),
        "token_ids": (np.int32, (cfg.T,)),
    }
    for name, dt in cfg.dataset.columns.items():
        cols[name] = (np.dtype(dt), ())
    return cols


def recording(cfg: DumpConfig, md: Metadata) -> tuple[int, ...] | dict[int, Site]:
    """`recorder.Recorder`'s ``layers`` for a dump: the block indices, or each slot's site."""
    return cfg.layers if md.sites is None else dict(zip(md.layers, md.sites, strict=True))


def _probe_d_model(cfg: DumpConfig, loaded: Loaded, what: Sequence[int] | dict[int, Site]) -> int:
    """Run one short example to see the recorded width (factory models declare nothing; the
    sites of a dump of sites need not have the model's width)."""
    from .recorder import Recorder

    try:
        enc = loaded.encoder.encode(["probe"])
        acts = Recorder(loaded.model, what, blocks=cfg.model.blocks, dtype="float32").record(**enc.inputs)
    except ConfigError:
        raise
    except RecorderError as err:
        raise ConfigError(f"{'sites' if cfg.sites else 'layers'}: {err}") from None
    except Exception as err:  # the model's or the tokenizer's own code
        raise ConfigError(f"model: a trial forward pass of one short example failed ({what_failed(err)})") from None
    return int(acts.shape[-1])


def batches(start: int, stop: int, examples_per_shard: int, batch_size: int) -> Iterator[tuple[int, int]]:
    """``(first, stop)`` batches covering ``[start, stop)`` on a fixed grid inside each shard.

    The grid depends only on the shard and the batch size, so every example is computed in
    the same batch however the work is split between writers or resumed runs (the bytes
    of a batched forward pass may depend on the batch's other members).
    """
    e = start
    while e < stop:
        shard_start = (e // examples_per_shard) * examples_per_shard
        offset = e - shard_start
        first_of_batch = shard_start + (offset // batch_size) * batch_size
        end = min(first_of_batch + batch_size, shard_start + examples_per_shard, stop)
        yield e, end
        e = end


def _text_files(the_plan: DumpPlan, examples: Sequence[corpus_mod.Example]) -> list[int]:
    """Lower bounds of the text files (one per field) written for ``examples``: each line is
    a JSON string and a newline, the ids and texts as long as they are, other fields empty."""
    ids = sum(len(ex.id) + 3 for ex in examples)
    texts = sum(len(ex.text) + 3 for ex in examples)
    return [ids, texts] + [3 * len(examples)] * (len(the_plan.text_fields) - 2)


def space_needed(the_plan: DumpPlan, root: Path, rank: int, world_size: int, *, restart: bool = False) -> int:
    """Bytes writer ``rank`` of ``world_size`` still needs under ``root`` (`writer.space_needed`);
    the text files counted at their lower bounds (ids and texts as long as they are)."""
    examples = the_plan.corpus.examples
    return writer_space_needed(
        the_plan.metadata,
        root,
        rank,
        world_size,
        columns=the_plan.columns,
        text=lambda a, b: _text_files(the_plan, examples[a:b]),
        restart=restart,
    )


def describe(the_plan: DumpPlan, root: Path | Root, rank: int, world_size: int) -> str:
    """The ``--dry-run`` report: hash, where the cache goes, shards, bytes, this writer's
    share, and the state on disk."""
    where = root if isinstance(root, Root) else Root(Path(root).absolute(), "")
    root = where.path
    md = the_plan.metadata
    cols = the_plan.columns
    col_bytes = sum(md.n_examples * np.dtype(dt).itemsize * math.prod(shape) for dt, shape in cols.values())
    text_bytes = sum(len(ex.text) + len(ex.id) for ex in the_plan.corpus.examples)  # a lower bound
    share = rank_shards(md.n_shards, rank, world_size)
    eps = md.examples_per_shard
    final = root / md.hash
    if final.exists():
        state = "published"
    elif staging_dir(root, md).exists():
        state = f"in staging, {len(sealed_shards(root, md))} of {md.n_shards} shards sealed (a run resumes there)"
    else:
        state = "not started"
    last = md.shard_n_examples(md.n_shards - 1) if md.n_shards else 0
    lines = [
        f"hash      {md.hash}",
        f"path      {final}" + (f"  (root from {where.source})" if where.source else ""),
        (
            f"model     {md.family} {md.ckpt} layers {list(md.layers)} "
            f"(blocks {the_plan.blocks or 'resolved when the model loads'})"
            if md.sites is None
            else f"model     {md.family} {md.ckpt}, {md.n_layers} sites (layer: module:io) "
            + ", ".join(f"{layer}: {site}" for layer, site in zip(md.layers, md.sites, strict=True))
        ),
        f"dataset   {md.dataset}: {md.n_examples} examples",
        f"shape     ({md.n_examples}, {md.n_layers}, {md.tokens_per_ex}, {md.d_model}) {md.dtype}, "
        f"cls_token={str(md.cls_token).lower()}",
        f"shards    {md.n_shards} x {eps} examples (last {last}), "
        f"{human_bytes(md.shard_nbytes(0) if md.n_shards else 0)} each",
        f"bytes     {human_bytes(md.nbytes + md.scales_nbytes)} activations"
        + (f" (with {human_bytes(md.scales_nbytes)} of scales)" if md.scales_nbytes else "")
        + f" + {human_bytes(col_bytes)} columns "
        f"+ >= {human_bytes(text_bytes)} text",
        f"writer    rank {rank} of {world_size}: shards [{share.start}, {share.stop}), "
        f"examples [{share.start * eps}, {min(share.stop * eps, md.n_examples)})",
        f"state     {state}",
    ]
    return "\n".join(lines)
