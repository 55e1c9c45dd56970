"""A dump configuration: a declarative schema, parsed at the edge into frozen dataclasses.

Each field of `DumpConfig`, `ModelConfig` and `DatasetConfig` declares what it accepts
(``expected``, a predicate) beside its default, so the checks live where the fields are
declared. `parse_config` checks every field of every section and the few rules that span
fields (`_RULES`) into one `errors.Problems`, and raises one `ConfigError` listing every
problem at once, each named by its key (``model.pad_id: expected an integer, found 'x'``).

What can only be known from the model (how many blocks it has, its maximum positions, its
width) is checked when the model is loaded (`saev_shards.dump.model.check_model`), still
before anything is written.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import tomllib

from ..errors import ConfigError, Problems
from ..protocol.common import COLUMN_DTYPES, DTYPES_BY_PROTOCOL, FIELD_NAME_RE, PROTOCOL
from ..protocol.jsonfile import is_int
from ..protocol.sites import Site, as_site, site_problem
from ..selection import string_layers_problem

#: The protocol's default shard budget (protocol.md section 3).
DEFAULT_PATCHES_PER_SHARD = 2_400_000
#: Column names the dump itself writes; a dataset's own columns may not reuse them.
RESERVED_COLUMNS = ("lengths", "true_lengths", "token_ids")
RESERVED_TEXT = ("id", "text")
#: Weight dtypes a model may be cast to after loading.
WEIGHTS_DTYPES = ("float32", "bfloat16", "float16")
DATASET_KINDS = ("stdlib", "jsonl", "lines")

Check = Callable[[Any], bool]


def _spec(expected: str, check: Check, default: Any = dataclasses.MISSING, *, path: bool = False) -> Any:
    """A field that accepts what ``check`` accepts (``expected`` says so in errors).

    ``path``: a file or folder, made relative to the configuration file's folder.
    """
    meta = {"expected": expected, "check": check, "path": path}
    if isinstance(default, (dict, list)):
        factory = dict if isinstance(default, dict) else list
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _opt(check: Check) -> Check:
    return lambda v: v is None or check(v)


def _str(v: Any) -> bool:
    return isinstance(v, str)


def _bool(v: Any) -> bool:
    return isinstance(v, bool)


def _int_at_least(low: int) -> Check:
    return lambda v: is_int(v) and v >= low


def _one_of(*choices: str) -> Check:
    return lambda v: isinstance(v, str) and v in choices


def _names(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)


def _layers(v: Any) -> bool:
    return (
        isinstance(v, (list, tuple)) and len(v) > 0 and all(is_int(x) and x >= 0 for x in v) and len(set(v)) == len(v)
    )


def _sites(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and len(v) > 0  # each entry: `_layers_or_sites`


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

    path: str | None = _spec("a folder path", _opt(_str), None, path=True)
    package: str | None = _spec("a package name", _opt(_str), None)
    factory: str | None = _spec("'module:function'", _opt(_str), None)
    kwargs: Mapping[str, Any] = _spec("a table of keyword arguments", lambda v: isinstance(v, Mapping), {})
    name: str | None = _spec("a string", _opt(_str), None)
    family: str | None = _spec("a string", _opt(_str), None)
    blocks: str | None = _spec("a dotted module name", _opt(_str), None)
    cls_token: bool | None = _spec("true or false", _opt(_bool), None)
    pad_id: int = _spec("an integer", is_int, 0)
    weights_dtype: str | None = _spec(" or ".join(WEIGHTS_DTYPES), _opt(_one_of(*WEIGHTS_DTYPES)), None)


@dataclasses.dataclass(frozen=True)
class DatasetConfig:
    """Which texts to record: ``kind`` is ``stdlib`` (`corpus.stdlib_corpus`), ``jsonl`` or ``lines``.

    For ``jsonl``: ``columns`` maps numeric record fields to a column dtype (e.g.
    ``{label = "int64"}``) and ``text_fields`` lists fields stored as JSON Lines text.
    """

    kind: str = _spec(" or ".join(repr(k) for k in DATASET_KINDS), _one_of(*DATASET_KINDS), "stdlib")
    path: str | None = _spec("a file path", _opt(_str), None, path=True)
    text_field: str = _spec("a field name", _str, "text")
    id_field: str | None = _spec("a field name", _opt(_str), None)
    columns: Mapping[str, str] = _spec("a table {field = dtype}", lambda v: isinstance(v, Mapping), {})
    text_fields: tuple[str, ...] = _spec("a list of field names", _names, ())
    min_chars: int = _spec("an integer >= 0", _int_at_least(0), 40)


@dataclasses.dataclass(frozen=True)
class DumpConfig:
    """A whole dump configuration (docs/dump.md shows the file format).

    ``root`` None: the cache goes to the shards root (``$SAEV_SHARDS_ROOT``, else
    ``$SAEV_SCRATCH/saev/shards``; see `saev_shards.dump.output_root`).

    ``sites`` (protocol 3.2): record the input or the output of modules rather than block
    outputs, each ``"module:input"`` or ``"module:output"``. With ``layers``, a module name is
    relative to each listed block (``"intermediate:input"`` in block 3 of BERT is
    ``encoder.layer.3.intermediate:input``; ``":output"`` is the block's own output), slots
    block by block; without ``layers``, names are the model's full dotted names.
    The cache's ``metadata.sites`` names every slot in full, and its ``layers`` are the slot
    numbers ``0 .. S-1`` (`expand_sites`).
    """

    model: ModelConfig
    dataset: DatasetConfig
    T: int = _spec("an integer >= 1 (tokens per example)", _int_at_least(1))
    layers: tuple[int, ...] = _spec("distinct block indices >= 0, e.g. [1, 3]", _layers, ())
    sites: tuple[Site, ...] = _spec(
        "a list of sites such as [\"intermediate:input\", \"output.dense:output\"] ('module:input' or 'module:output')",
        _sites,
        (),
    )
    dtype: str = _spec(
        f"one of {list(DTYPES_BY_PROTOCOL[PROTOCOL])}", _one_of(*DTYPES_BY_PROTOCOL[PROTOCOL]), "float16"
    )
    budget: int | None = _spec("an integer >= 0 (examples)", _opt(_int_at_least(0)), None)
    root: str | None = _spec("a folder path", _opt(_str), None, path=True)
    batch_size: int = _spec("an integer >= 1", _int_at_least(1), 32)
    patches_per_shard: int = _spec("an integer >= 1", _int_at_least(1), DEFAULT_PATCHES_PER_SHARD)
    device: str = _spec("a string such as 'auto', 'cpu' or 'cuda:0'", _str, "auto")
    allow_nonfinite: bool = _spec("true or false", _bool, False)


_SECTIONS: dict[str, type[Any]] = {"model": ModelConfig, "dataset": DatasetConfig}


def _kind_of(path: str) -> str:
    return "jsonl" if path.endswith((".jsonl", ".ndjson")) else "lines"


def _expand_shorthand(key: str, value: Any) -> Any:
    """``model = "/folder"`` and ``dataset = "stdlib"`` / ``dataset = "file.jsonl"``."""
    if key == "model" and isinstance(value, str):
        return {"path": value}
    if key == "dataset" and isinstance(value, str):
        return {"kind": "stdlib"} if value == "stdlib" else {"kind": _kind_of(value), "path": value}
    return value


def _check_fields(cls: type[Any], obj: Mapping[str, Any], prefix: str, problems: Problems) -> dict[str, Any]:
    """The values of ``obj`` whose keys ``cls`` declares and whose checks pass; problems for the rest."""
    declared = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(obj) - set(declared))
    if unknown:
        problems.add(f"{prefix}unknown keys {unknown} (allowed: {sorted(declared)})", field=prefix[:-1] or None)
    good: dict[str, Any] = {}
    for name, f in declared.items():
        if name in _SECTIONS and not prefix:
            continue  # sections are checked on their own
        if name not in obj:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                problems.add(
                    f"missing key {prefix}{name!r}" if prefix else f"missing key {name!r}", field=prefix + name
                )
            continue
        value = obj[name]
        as_string = string_layers_problem(f"{prefix}{name}", value) if name == "layers" else None
        if as_string is not None:
            problems.add(as_string, field=prefix + name)
        elif not f.metadata["check"](value):
            problems.expected(prefix + name, f.metadata["expected"], repr(value))
        else:
            good[name] = value
    return good


# Rules that span fields: each adds its problems (none when the rule holds).


def _one_model_source(
    top: Mapping[str, Any], model: Mapping[str, Any], ds: Mapping[str, Any], problems: Problems
) -> None:
    sources = [k for k in ("path", "package", "factory") if model.get(k) is not None]
    if len(sources) != 1 and "model" in top:
        problems.add(f"model: give exactly one of path, package or factory, found {sources or 'none'}", field="model")


def _dataset_path(top: Mapping[str, Any], model: Mapping[str, Any], ds: Mapping[str, Any], problems: Problems) -> None:
    kind = ds.get("kind", "stdlib")
    if kind in ("jsonl", "lines") and not isinstance(ds.get("path"), str):
        problems.add(f"dataset.path: a {kind} dataset needs a file path", field="dataset.path")


def _dataset_columns(
    top: Mapping[str, Any], model: Mapping[str, Any], ds: Mapping[str, Any], problems: Problems
) -> None:
    columns = ds.get("columns", {})
    columns = columns if isinstance(columns, Mapping) else {}
    for name, dt in columns.items():
        if not isinstance(name, str) or not FIELD_NAME_RE.fullmatch(name) or name in RESERVED_COLUMNS:
            problems.add(f"dataset.columns: bad or reserved column name {name!r}", field="dataset.columns")
        try:
            ok = np.dtype(dt).newbyteorder("<").str in COLUMN_DTYPES or np.dtype(dt).str in COLUMN_DTYPES
        except TypeError:
            ok = False
        if not ok:
            problems.add(
                f"dataset.columns.{name}: dtype {dt!r} is not one of {list(COLUMN_DTYPES)}",
                field=f"dataset.columns.{name}",
            )
    text_fields = ds.get("text_fields", [])
    if _names(text_fields):
        for name in text_fields:
            if not FIELD_NAME_RE.fullmatch(name) or name in RESERVED_TEXT or name in columns:
                problems.add(
                    f"dataset.text_fields: bad, reserved or duplicate name {name!r}", field="dataset.text_fields"
                )
    if ds.get("kind", "stdlib") == "stdlib" and (columns or text_fields):
        problems.add("dataset: columns and text_fields apply to jsonl datasets only", field="dataset")


def _layers_or_sites(
    top: Mapping[str, Any], model: Mapping[str, Any], ds: Mapping[str, Any], problems: Problems
) -> None:
    if "layers" not in top and "sites" not in top:
        problems.add("missing key 'layers' (block indices; or sites, the modules to record)", field="layers")
    sites = top.get("sites")
    if isinstance(sites, (list, tuple)):
        for i, site in enumerate(sites):
            if as_site(site) is None:
                problems.add(f"sites[{i}]: {site_problem(site)}", field="sites")
        parsed = [as_site(site) for site in sites]
        repeated = sorted({str(p) for p in parsed if p is not None and parsed.count(p) > 1})
        if repeated:
            problems.add(f"sites: each site once, found {repeated} more than once", field="sites")


def expand_sites(cfg: DumpConfig, block_list: str) -> tuple[Site, ...]:
    """The full sites a configuration records, one per slot: with ``layers``, each of ``sites``
    in each listed block of the block list ``block_list`` (block by block); without, ``sites``."""
    if not cfg.layers:
        return cfg.sites
    return tuple(
        Site(f"{block_list}.{block}" + (f".{site.module}" if site.module else ""), site.io)
        for block in cfg.layers
        for site in cfg.sites
    )


_RULES = (_one_model_source, _dataset_path, _dataset_columns, _layers_or_sites)


def parse_config(obj: object, *, base: str | os.PathLike[str] | None = None, where: str = "config") -> DumpConfig:
    """Turn a parsed configuration object into a `DumpConfig`, or raise `ConfigError` listing every problem.

    ``base``: the folder relative paths are relative to (the configuration file's).
    """
    if not isinstance(obj, Mapping):
        raise ConfigError(f"{where}: expected an object (table), found {type(obj).__name__}")
    with Problems(ConfigError, head=f"{where}: ") as problems:
        top = _check_fields(DumpConfig, obj, "", problems)
        sections: dict[str, Mapping[str, Any]] = {}
        good_sections: dict[str, dict[str, Any]] = {}
        for key, cls in _SECTIONS.items():
            raw = _expand_shorthand(key, obj.get(key, {"kind": "stdlib"} if key == "dataset" else {}))
            if not isinstance(raw, Mapping):
                problems.expected(key, "a table or a string", type(raw).__name__)
                raw = {}
            sections[key] = raw
            good_sections[key] = _check_fields(cls, raw, f"{key}.", problems)
        if "model" not in obj:
            problems.add("missing key 'model'", field="model")
        for rule in _RULES:
            rule(obj, sections["model"], sections["dataset"], problems)
    base_dir = Path(base) if base is not None else None

    def build(cls: type[Any], values: dict[str, Any]) -> Any:
        for f in dataclasses.fields(cls):
            value = values.get(f.name)
            if f.metadata.get("path") and isinstance(value, str) and base_dir is not None and not os.path.isabs(value):
                values[f.name] = str(base_dir / value)
            if f.name in ("kwargs", "columns") and f.name in values:
                values[f.name] = dict(values[f.name])
            if f.name in ("layers", "text_fields") and f.name in values:
                values[f.name] = tuple(values[f.name])
            if f.name == "sites" and f.name in values:
                values[f.name] = tuple(as_site(v) for v in values[f.name])
        return cls(**values)

    config: DumpConfig = build(
        DumpConfig,
        {**top, **{key: build(cls, good_sections[key]) for key, cls in _SECTIONS.items()}},
    )
    return config


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


def as_config(config: DumpConfig | Mapping[str, Any] | str | os.PathLike[str]) -> DumpConfig:
    """A `DumpConfig` from a config object, a dict, or a TOML/JSON file path."""
    if isinstance(config, DumpConfig):
        return config
    if isinstance(config, Mapping):
        return parse_config(config)
    return load_config(config)
