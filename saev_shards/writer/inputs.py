"""What `ShardWriter` accepts, checked and converted in the caller's thread: the ``columns=``
declaration, field names, activations cast to the stored dtype (or quantized to
float8_e4m3 with their scales, or given quantized already and checked against the scale
rule), the error that names non-finite values, text as JSON lines, and whether the
cache's dialect can hold what is written."""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from ..codecs import dtypes, float8
from ..errors import MetadataError, NonFiniteError, Problems, ProtocolWarning, WriterError
from ..protocol.common import COLUMN_DTYPES, FIELD_NAME_RE, FLOAT8
from ..protocol.float8 import FLOAT8_DTYPE, NAN_BYTE, SCALE_RULE, describe_scale, odd_scales, scales_plain
from ..protocol.jsonfile import is_int
from ..protocol.metadata import Metadata
from ..protocol.saev_code import SAEV_ROOT_PARTS

_COLUMNS_EXAMPLE = "{'lengths': ('int32', ()), 'token_ids': ('int32', (64,))}"


def parse_columns(columns: object) -> dict[str, tuple[np.dtype[Any], tuple[int, ...]]]:
    """``columns=`` checked: name -> (numpy dtype, shape of one example's value); every
    problem in one `WriterError` (a wrong value once gave "too many values to unpack")."""
    if columns is None:
        return {}
    if not isinstance(columns, Mapping):
        raise WriterError(
            f"columns: expected a mapping of column name -> (dtype, shape) such as {_COLUMNS_EXAMPLE}, "
            f"found {type(columns).__name__}"
        )
    problems = Problems(WriterError)
    parsed: dict[str, tuple[np.dtype[Any], tuple[int, ...]]] = {}
    for name, spec in columns.items():
        where = f"columns[{name!r}]"
        if not isinstance(name, str):
            problems.expected(where, "a column name (a string)", type(name).__name__)
            continue
        if isinstance(spec, (str, bytes, np.dtype, type)) or not isinstance(spec, (tuple, list)) or len(spec) != 2:
            problems.expected(where, "(dtype, shape) such as ('int32', ()) or ('int32', (64,))", repr(spec))
            continue
        dt, shape = spec
        try:
            dtype = np.dtype(dt)
        except TypeError:
            problems.expected(f"{where} dtype", f"a numpy dtype of {list(COLUMN_DTYPES)}", repr(dt))
            continue
        if isinstance(shape, int) or not isinstance(shape, (tuple, list)):
            problems.expected(f"{where} shape", "a tuple of sizes, () for one value per example", repr(shape))
            continue
        if not all(is_int(n, numpy_ok=True) and n >= 0 for n in shape):
            problems.expected(f"{where} shape", "sizes >= 0", repr(shape))
            continue
        parsed[name] = (dtype, tuple(int(n) for n in shape))
    problems.raise_if_any()
    return parsed


def field_name(name: str) -> str:
    if not FIELD_NAME_RE.fullmatch(name):
        raise WriterError(f"bad column/text name {name!r}: use lower-case letters, digits and _ (max 64)")
    return name


def stream_dtype(key: str, dtype: np.dtype[Any] | None) -> np.dtype[Any] | None:
    """The dtype stream ``key`` is stored as: a column's little-endian, one of `COLUMN_DTYPES`
    (`WriterError` otherwise); the activations' and text's (None) as given."""
    if dtype is not None and key != "acts":
        dtype = dtype.newbyteorder("<") if dtype.byteorder == ">" else dtype
        if dtype.str not in COLUMN_DTYPES:
            raise WriterError(f"{key}: dtype {dtype} is not allowed; use one of {list(COLUMN_DTYPES)}")
    return dtype


def lengths_problem(lengths: npt.NDArray[Any], tokens_per_ex: int) -> str | None:
    """What is wrong with a ``lengths`` column's values (integers in ``[0, T]``), or None."""
    if lengths.dtype.kind not in "iu":
        return f"lengths: expected integers, found dtype {lengths.dtype}"
    bad = lengths[(lengths < 0) | (lengths > tokens_per_ex)]
    if len(bad):
        return f"lengths: values must lie in [0, {tokens_per_ex}], found {bad[:5].tolist()}"
    return None


def to_numpy(x: Any) -> npt.NDArray[Any]:
    if dtypes.is_torch_tensor(x):
        return np.asarray(x.detach().cpu().numpy())
    return np.asarray(x)


def nonfinite_error(md: Metadata, original: Any, arr: npt.NDArray[Any], first: int) -> NonFiniteError:
    if md.dtype == FLOAT8:  # whole vectors are stored as NaN: count the values given instead
        given = original.detach().float().cpu().numpy() if dtypes.is_torch_tensor(original) else original
        with np.errstate(over="ignore"):
            bad = ~np.isfinite(np.asarray(given, np.float32))
    else:
        bad = dtypes.nonfinite_elements(arr, md.dtype)
    per_example = bad.reshape(arr.shape[0], -1).any(axis=1)
    examples = (np.flatnonzero(per_example) + first).tolist()
    shown = ", ".join(map(str, examples[:10])) + (", ..." if len(examples) > 10 else "")
    detail = ""
    if md.dtype == FLOAT8:
        detail = " (float8_e4m3 stores a vector holding inf or NaN as NaN)"
    if md.dtype == "float16":
        if dtypes.is_torch_tensor(original):
            biggest = float(original.detach().float().abs().nan_to_num(nan=0.0).max())
        else:
            biggest = float(np.nanmax(np.abs(np.asarray(original, np.float64))))
        detail = f"; float16 holds at most 65504, the largest |value| was {biggest:.6g}"
    return NonFiniteError(
        f"{int(bad.sum())} values in {len(examples)} examples (global indices {shown}) are not "
        f"finite after the cast to {'float32' if md.dtype == FLOAT8 else md.dtype}{detail}; pass "
        "allow_nonfinite=True to store them"
    )


def check_writable(root: Path, md: Metadata, extras: bool) -> None:
    """Raise if ``md``'s dialect cannot hold this cache; warn where saev would not find it."""
    if not md.rules.holds_extras and extras:
        raise WriterError(
            f"protocol {md.protocol} caches ({md.rules.summary}) hold activations and labels only; use protocol 3.0"
        )
    with Problems(MetadataError, head=f"cannot write a {md.rules.summary} cache: ") as problems:
        md.rules.check_writable(md, problems)
    if md.rules.legacy and root.absolute().parts[-2:] != SAEV_ROOT_PARTS:
        warnings.warn(
            f"{root.absolute()}: saev's readers look for caches in a folder ending in saev/shards/<name> "
            "(its writers want a root ending in saev/shards); this cache opens here with saev_shards only, "
            "move it (or link it) under .../saev/shards for saev",
            ProtocolWarning,
            stacklevel=3,
        )


def cast(md: Metadata, acts: Any) -> tuple[npt.NDArray[Any], bool, npt.NDArray[Any] | None]:
    """``acts`` in the stored dtype, whether that is a fresh array (not the caller's memory),
    and for float8_e4m3 the scale of each vector ``(B, L, T)`` (`float8.quantize`)."""
    want = md.shard_shape[1:]
    shape = tuple(getattr(acts, "shape", np.shape(acts)))
    if len(shape) != 4 or shape[1:] != want:
        raise WriterError(
            f"acts: expected shape (B, {want[0]}, {want[1]}, {want[2]}) = (batch, layers, "
            f"tokens_per_ex, d_model), found {shape}"
        )
    try:
        if md.dtype == FLOAT8:
            values, scales = float8.quantize(acts)
            return values, True, scales
        arr, owned = dtypes.to_stored(acts, md.dtype)
    except TypeError as err:
        raise WriterError(str(err)) from None
    return arr, owned, None


def quantized(md: Metadata, values: Any, scales: Any) -> tuple[npt.NDArray[Any], bool, npt.NDArray[Any]]:
    """Values quantized already, with their scales, checked against ``md`` (`ShardWriter.write`)."""
    if md.dtype != FLOAT8:
        raise WriterError(f"scales: a {md.dtype} cache has no scales (only float8_e4m3 caches take quantized values)")
    arr = to_numpy(values)
    if arr.dtype == np.uint8:
        arr = arr.view(FLOAT8_DTYPE)
    want = md.shard_shape[1:]
    if arr.dtype != FLOAT8_DTYPE or arr.ndim != 4 or arr.shape[1:] != want:
        raise WriterError(
            f"acts: with scales, expected float8_e4m3fn values (or their uint8 bytes) of shape (B, {want[0]}, "
            f"{want[1]}, {want[2]}), found {arr.dtype} {tuple(arr.shape)}"
        )
    s = to_numpy(scales)
    if s.dtype != np.float32 or s.shape != arr.shape[:3]:
        raise WriterError(f"scales: expected float32 of shape {arr.shape[:3]}, found {s.dtype} {tuple(s.shape)}")
    if not scales_plain(s):  # the scale rule's (protocol.md 5), as every reader checks it
        odd, nan = odd_scales(s)
        if odd.size:
            at = tuple(int(i) for i in np.unravel_index(int(odd[0]), s.shape))
            raise WriterError(
                f"scales: {SCALE_RULE}, found {describe_scale(s.reshape(-1)[odd[0]])} at (example, "
                f"layer, token) {at} of the batch ({odd.size} such scales)"
            )
        rows = arr.view(np.uint8).reshape(-1, arr.shape[-1])[nan]
        if not (rows == NAN_BYTE).all():
            raise WriterError("scales: a NaN scale is that of a vector stored as NaN, whose bytes are all 0x7f")
    # Fresh copies: the caller may reuse its buffers while the writer writes in the background.
    return np.array(arr, order="C"), True, np.array(s, order="C")


def json_lines(name: str, values: Sequence[Any]) -> list[bytes]:
    """One JSON line per example of text field ``name``."""
    if isinstance(values, (str, bytes)):
        raise WriterError(f"text {name!r}: expected a sequence with one value per example, found a string")
    lines = []
    for v in values:
        try:
            lines.append(orjson.dumps(v) + b"\n")
        except TypeError as err:
            raise WriterError(f"text {name!r}: value {v!r} is not JSON-serialisable ({err})") from err
    return lines


def exact_cast(arr: npt.NDArray[Any], dtype: np.dtype[Any]) -> npt.NDArray[Any]:
    """``arr`` as ``dtype`` where the cast keeps every value (int64 lengths into int32), else as is."""
    if arr.dtype != dtype and np.can_cast(arr.dtype, dtype, "same_kind"):
        cast = arr.astype(dtype)
        if np.array_equal(cast.astype(arr.dtype), arr, equal_nan=arr.dtype.kind == "f"):
            return cast
    return arr
