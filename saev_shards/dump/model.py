"""The model side of a dump: find, load and identify the model and its tokenizer, and check
the configuration against them before anything is written.

Models come from local folders only (``local_files_only=True``, ``HF_HUB_OFFLINE=1``):
nothing is ever downloaded. A Hugging Face model's identity is the digest of its folder's
files, so the cache hash does not depend on where the folder lives.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from ..errors import ConfigError, RecorderError
from ..fileio import IO_CHUNK, BlockHasher, stream
from ..protocol.common import FLOAT8
from ..protocol.jsonfile import is_int
from ..protocol.sites import Site
from .config import DumpConfig, ModelConfig

if TYPE_CHECKING:
    import torch

#: Files of a model folder that do not change what the model computes.
_MODEL_FILE_SKIP = (".md", ".txt.lock")
#: Folder names that say nothing about the model (a package's ``model/``, a snapshot's
#: commit hash): the shorthand ``model = "<folder>"`` records the parent's name instead.
_GENERIC_FOLDER = re.compile(r"(models?|checkpoints?|weights|hf|snapshot|[0-9a-f]{40})")
#: config.json keys for the number of blocks, the maximum positions and the width, by family.
_N_BLOCKS_KEYS = ("num_hidden_layers", "n_layer", "num_layers")
_MAX_POSITIONS_KEYS = ("max_position_embeddings", "n_positions", "n_ctx")
_WIDTH_KEYS = ("hidden_size", "n_embd", "d_model")


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


def folder_ckpt(folder: Path) -> str:
    """What ``metadata.ckpt`` records for a model folder given by path: ``org/name`` for a
    Hugging Face cache snapshot (``models--org--name/snapshots/<commit>``), the parent's
    name for a folder named ``model``, ``weights`` or the like, else the folder's name."""
    folder = folder.absolute()
    parts = folder.parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        return parts[-3][len("models--") :].replace("--", "/")
    if _GENERIC_FOLDER.fullmatch(folder.name) and folder.parent.name:
        return folder.parent.name
    return folder.name


def files_digest(folder: Path) -> str:
    """xxh3_128 of the names, sizes and bytes of a model folder's top-level files (README etc. skipped)."""
    h = BlockHasher()
    view = memoryview(bytearray(IO_CHUNK))
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
            stream(f, hasher=h, buffer=view)
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
            enc = self.tokenizer(list(texts), truncation=True, max_length=T, padding="max_length", return_tensors="pt")
            inputs = dict(enc)
            ids = inputs["input_ids"]
            lengths = inputs["attention_mask"].sum(dim=1).numpy().astype(np.int32)
            # Only an example that fills all T positions can have been cut: those alone are
            # tokenized again, whole, for their true length (the others' is their length).
            true = lengths.copy()
            filled = np.flatnonzero(lengths >= T)
            if filled.size:
                whole = self.tokenizer([texts[i] for i in filled.tolist()], truncation=False, add_special_tokens=True)
                true[filled] = [len(x) for x in whole["input_ids"]]
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


@dataclasses.dataclass(frozen=True)
class ModelLimits:
    """What a model declares about itself (None where it says nothing): its config.json for
    a Hugging Face folder; for a factory's module, its ``config`` if it has one, else its
    block list and its position embedding (`module_limits`)."""

    n_blocks: int | None = None
    max_positions: int | None = None
    d_model: int | None = None
    #: Where each value came from, for messages (``config.json max_position_embeddings``).
    keys: tuple[str | None, str | None, str | None] = (None, None, None)


def _limits(hf_config: dict[str, Any], source: str = "config.json") -> ModelLimits:
    def first(keys: Sequence[str]) -> tuple[int | None, str | None]:
        for k in keys:
            if is_int(hf_config.get(k)) and hf_config[k] > 0:
                return hf_config[k], f"{source} {k}"
        return None, None

    (blocks, kb), (positions, kp), (width, kw) = first(_N_BLOCKS_KEYS), first(_MAX_POSITIONS_KEYS), first(_WIDTH_KEYS)
    return ModelLimits(blocks, positions, width, (kb, kp, kw))


#: Names of position-embedding tables in common modules (BERT's ``position_embeddings``,
#: GPT-2's ``wpe``, ``pos_embed``, a plain ``pos``): their row count bounds T.
_POSITION_TABLE = re.compile(r"(?:^|\.)(?:pos|pos_emb|pos_embed|position|positions|position_embeddings|wpe)$")


def module_limits(model: Any, blocks: str | None) -> ModelLimits:
    """The limits of a factory's module, for `check_limits`: a Hugging Face ``model.config``
    when there is one; else the length of its block list (found as the recorder finds it,
    when ``blocks`` is not given) and the rows of a position-embedding table."""
    import torch

    from .recorder import find_blocks

    config = getattr(model, "config", None)
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        values = to_dict()
        if isinstance(values, dict):
            return _limits(values, "model.config")
    n_blocks = key_b = None
    if blocks is None:
        try:
            name = find_blocks(model)
        except RecorderError:
            name = None
        if name is not None:
            n_blocks, key_b = len(model.get_submodule(name)), f"its block list {name!r}"
    positions = key_p = None
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Embedding) and _POSITION_TABLE.search(name):
            positions, key_p = int(module.num_embeddings), f"its position table {name!r}"
            break
    return ModelLimits(n_blocks, positions, None, (key_b, key_p, None))


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
    limits: ModelLimits = dataclasses.field(default_factory=ModelLimits)


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
        try:
            model, tokenizer = _import_factory(mc.factory)(**mc.kwargs)
        except ConfigError:
            raise
        except Exception as err:  # the user's code: whatever it raises is a configuration problem
            raise ConfigError(f"model.factory: {mc.factory}(**{dict(mc.kwargs)}) failed: {what_failed(err)}") from None
        import torch

        if not isinstance(model, torch.nn.Module):
            raise ConfigError(
                f"model.factory: expected {mc.factory} to return (a torch.nn.Module, a tokenizer), "
                f"found ({type(model).__name__}, {type(tokenizer).__name__})"
            )
        encoder = TextEncoder(tokenizer, cfg.T, pad_id=mc.pad_id)
        cls = mc.cls_token if mc.cls_token is not None else encoder.starts_with_cls()
        identity = {"factory": mc.factory, "kwargs": dict(mc.kwargs), **cast}
        model = _cast_weights(model.eval(), mc.weights_dtype)
        limits = module_limits(model, mc.blocks)
        return Loaded(model, encoder, mc.name or mc.factory, mc.family or "custom", identity, None, cls, limits)
    folder = model_dir(mc)
    assert folder is not None
    if not (folder / "config.json").is_file():
        raise ConfigError(f"model: {folder} is not a Hugging Face model folder (no config.json)")
    try:
        hf_config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"model: {folder / 'config.json'} is not readable JSON ({err})") from None
    if not isinstance(hf_config, dict):
        raise ConfigError(f"model: {folder / 'config.json'}: expected a JSON object")
    limits = _limits(hf_config)
    _offline()
    import transformers

    transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]  # no "longer than 512" chatter
    transformers.utils.logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as err:
        raise ConfigError(f"model: cannot load the tokenizer from {folder} ({what_failed(err)})") from None
    encoder = TextEncoder(tokenizer, cfg.T, pad_id=mc.pad_id)
    cls = mc.cls_token if mc.cls_token is not None else encoder.starts_with_cls()
    model = None
    if weights:
        try:
            model = transformers.AutoModel.from_pretrained(str(folder), local_files_only=True).eval()
        except (OSError, ValueError) as err:
            raise ConfigError(f"model: cannot load the weights from {folder} ({what_failed(err)})") from None
        model = _cast_weights(model, mc.weights_dtype)
    ckpt = mc.name or (mc.package if mc.package is not None else folder_ckpt(folder))
    family = mc.family or str(hf_config.get("model_type", "hf"))
    identity = {"files_xxh3_128": files_digest(folder), **cast}
    return Loaded(model, encoder, ckpt, family, identity, limits.d_model, cls, limits)


def _cast_weights(model: Any, dtype: str | None) -> Any:
    if dtype is None:
        return model
    import torch

    return model.to({"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype])


def what_failed(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}".rstrip(": ")


def record_dtype(dtype: str) -> str:
    """The dtype the recorder casts to on the model's device: the stored one, except float8_e4m3,
    recorded as float32 and quantized from there (on the device as well, `float8.quantize_tensor`)."""
    return "float32" if dtype == FLOAT8 else dtype


def device_of(cfg: DumpConfig) -> torch.device:
    """The device the dump runs on; `ConfigError` naming ``device`` if torch cannot use it."""
    import torch

    if cfg.device == "auto":
        if not torch.cuda.is_available():
            return torch.device("cpu")
        # torchrun starts one process per GPU and says which one in LOCAL_RANK.
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    try:
        device = torch.device(cfg.device)
    except (RuntimeError, ValueError) as err:
        raise ConfigError(f"device: expected 'auto', 'cpu', 'cuda' or 'cuda:N', found {cfg.device!r} ({err})") from None
    if device.type == "cuda":
        available = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if available == 0:
            raise ConfigError(f"device: {cfg.device!r}, but torch sees no CUDA device here (use 'auto' or 'cpu')")
        if device.index is not None and device.index >= available:
            raise ConfigError(f"device: {cfg.device!r}, but torch sees {available} CUDA device(s) (0-{available - 1})")
    return device


def check_limits(cfg: DumpConfig, limits: ModelLimits) -> list[str]:
    """Problems of ``cfg`` against what config.json declares (no weights needed, so
    ``--dry-run`` reports them too): a layer past the last block, T past the maximum positions."""
    problems = []
    kb, kp, _ = limits.keys
    n = limits.n_blocks
    if n is not None and cfg.model.blocks is None:
        beyond = [layer for layer in cfg.layers if layer >= n]
        if beyond:
            problems.append(
                f"layers: {beyond} {'do' if len(beyond) > 1 else 'does'} not exist: the model has {n} blocks, "
                f"0 to {n - 1} ({kb})"
            )
    if limits.max_positions is not None and limits.max_positions < cfg.T:
        problems.append(
            f"T: {cfg.T} tokens per example, but the model takes at most {limits.max_positions} positions ({kp})"
        )
    return problems


def check_model(
    cfg: DumpConfig,
    loaded: Loaded,
    device: torch.device,
    d_model: int,
    recording: Sequence[int] | Mapping[int, Site] | None = None,
) -> None:
    """Run the checks only the loaded model can answer, before anything is written; raise
    `ConfigError` naming the field and the model's limit.

    The layers must exist in the block list; then one example of exactly ``T`` tokens goes
    through the model on ``device`` with the weights' dtype, recording ``layers`` in the
    stored dtype: positions past the model's maximum, a dtype the device cannot compute
    in, or blocks whose width is not ``d_model`` fail here, not after shards were written.
    ``recording``: what the recorder records (`DumpPlan.recording`; default ``cfg.layers``).
    """
    from . import recorder

    what = cfg.layers if recording is None else recording
    problems = check_limits(cfg, loaded.limits)
    try:
        blocks = recorder.resolve_modules(loaded.model, what, cfg.model.blocks)
    except RecorderError as err:
        field = "model.blocks" if cfg.model.blocks is not None and "not a ModuleList" in str(err) else "layers"
        problems.append(f"{'sites' if cfg.sites and field == 'layers' else field}: {err}")
        blocks = None
    if problems:
        raise ConfigError("; ".join(problems))
    assert blocks is not None
    try:
        probe = loaded.encoder.encode([" ".join(["probe"] * cfg.T)])  # at least T tokens: every position is used
        model = loaded.model.to(device)
        rec = recorder.Recorder(model, what, blocks=cfg.model.blocks, dtype=record_dtype(cfg.dtype))
        acts = rec.record(**{k: v.to(device) for k, v in probe.inputs.items()})
    except ConfigError:
        raise
    except Exception as err:  # the model's or tokenizer's own code: any failure here is a configuration problem
        raise ConfigError(
            f"model: a trial forward pass of one example of T={cfg.T} tokens on {device}"
            + (f" with {cfg.model.weights_dtype} weights" if cfg.model.weights_dtype else "")
            + f" failed before anything was written ({what_failed(err)}); check T against the model's maximum "
            "positions, and the device and weights_dtype"
        ) from None
    width = int(acts.shape[-1])
    if width != d_model:
        _, _, kw = loaded.limits.keys
        raise ConfigError(
            f"model: the recorded blocks output vectors of width {width}, but the cache would declare "
            f"d_model {d_model} ({kw or 'measured'}); name the blocks with model.blocks"
        )
