"""The earlier import paths of modules that moved into packages (`saev_shards._compat`): every
public name each earlier module had is importable from it, the earlier name is the moved module
itself, and nothing is imported before it is asked for."""

from __future__ import annotations

import importlib
import pickle
import subprocess
import sys

import numpy as np
import pytest

import saev_shards as ss
from saev_shards import _compat
from saev_shards.protocol.manifest import BlockDigests

from .test_import_graph import PACKAGE, imported_modules, module_name

#: Every public name of each module before it moved (read from its source at the move).
EARLIER_NAMES: dict[str, list[str]] = {
    "layout": [
        "MAX_NBYTES", "example_nbytes", "examples_per_shard", "locate", "locate_many", "n_shards",
        "offset_in_vectors", "shard_n_examples", "shard_of", "tokens_per_ex",
    ],
    "metadata": [
        "FIELDS", "KEYS", "LAYER_MAX", "LAYER_MIN", "Metadata", "SAEV_DEFAULT_DIALECT", "Site", "check_fields",
        "parse_metadata", "validate",
    ],
    "manifest": ["ArrayEntry", "Blocks", "FileEntry", "Manifest", "ShardEntry", "ShardList", "TextEntry"],
    "format": [
        "CACHE_NAME_RE", "CHECKSUMS_FILE", "COLUMN_DTYPES", "DEFAULT_DTYPE", "DTYPES", "DTYPES_BY_PROTOCOL",
        "FIELD_NAME_RE", "HASH_RE", "JSON_INT_MAX", "JSON_INT_MIN", "JSON_SLACK_BYTES", "LABELS_DTYPE",
        "LABELS_FILE", "LEGACY_PROTOCOL", "MANIFEST_BYTES_PER_SHARD", "MANIFEST_FILE", "MAX_JSON_DEPTH",
        "MAX_METADATA_BYTES", "METADATA_FILE", "PROTOCOL", "ProtocolWarning", "SHARD_NAME_RE",
        "STATS_BYTES_PER_NUMBER", "STATS_FILE", "SUPPORTED_PROTOCOLS", "XXH3_RE", "canonical_json", "check_version",
        "column_file", "content_hash", "is_int", "json_value_problem", "manifest_max_bytes", "pretty_json",
        "read_json_file", "shard_name", "short_list", "short_repr", "stats_max_bytes", "strict_json_loads",
        "text_file", "type_name",
    ],
    "float8": [
        "BFLOAT16_MAX", "FLOAT16_MAX", "FLOAT8_DTYPE", "FLOAT8_MAX", "MAX_SCALE", "NAN_BYTE", "NAN_SCALE_BITS",
        "OUT_DTYPES", "SCALE_RULE", "check_range", "dequantize", "dequantize_elementwise", "describe_scale",
        "error_bound", "kernels_in_use", "numpy_only", "odd_scales", "quantize", "quantize_numpy", "quantize_tensor",
        "round_bfloat16", "scales_plain", "take_dequantize",
    ],
    "float8_kernels": [
        "DEQUANTIZE", "dequantize_bfloat16", "dequantize_float16", "dequantize_float32", "quantize_float32",
    ],
    "dtypes": [
        "READ_DTYPES", "bf16_to_float32", "convert", "float32_to_bf16", "is_torch_tensor", "nonfinite_elements",
        "nonfinite_mask_any", "to_float32", "to_stored",
    ],
    "corpus": ["Corpus", "Example", "digest", "iter_stdlib", "jsonl_corpus", "lines_corpus", "stdlib_corpus"],
    "recorder": ["AsyncWriter", "Recorder", "TORCH_DTYPES", "find_blocks", "resolve_modules", "resolve_sites"],
    "sae": ["TopKSAE", "normaliser", "train"],
    "views": ["DIMS", "to_dask", "to_xarray", "write_zarr_references", "zarr_references"],
    "report": ["CacheReport", "DRAWN_BINS", "OUTLIER_MULTIPLE", "draw", "outlier_dimensions", "report", "site_labels"],
    "norms": ["NormFilter", "PASS_BYTES", "median_norms", "norm_filter", "parse_multiple", "to_json", "vector_blocks"],
    "_indexing": ["CACHE_RANGE", "NDIM", "ShardedArray", "getitem", "wrap_index"],
    "units": ["html_table", "human_age", "human_bytes"],
    "datasets": [
        "CLS_LABEL", "ExampleDataset", "LayerPairDataset", "OUT_DTYPES", "TOKEN_CHOICES", "TokenDataset",
        "TokenSelection", "as_shards", "parse_layers", "parse_out_dtype", "to_tensor", "torch_dtype",
    ],
    "_layers": ["string_layers_problem"],
    "token_masks": ["COLUMN", "parse_exclude_token_ids", "token_ids_of", "token_ids_problem"],
}  # fmt: skip
#: Modules that moved into a package of the same name, or were split within one: their names too.
SAME_PATH: dict[str, list[str]] = {
    "fileio": [
        "BlockHasher", "DIRECT_ALIGN", "DISK_FULL_ERRNOS", "HUGE_PAGE", "IO_CHUNK", "NO_FLOCK_ERRNOS",
        "NO_SPACE_CHECK_ENV", "READ_ONLY_DIR", "READ_ONLY_FILE", "aligned_buffer", "bytes_on_disk",
        "check_free_space", "check_listing", "disk_full_error", "fault_hook", "fault_point", "file_kind",
        "free_bytes", "freeze", "fsync_dir", "hash_file", "hold_folder", "make_owner_writable", "make_writable",
        "naming_disk_full", "open_direct", "open_regular", "pread_exact", "publish_dir", "pwrite_all",
        "pwrite_direct", "remove_path", "stream", "take_lock", "try_flock", "write_all", "write_file_atomic",
    ],
    "demo": ["DEMO_CONFIG", "cache_layer", "main", "next_steps", "save_loss_curve"],
}  # fmt: skip
#: The earlier modules whose import imported torch (or numba) then too; every other one imports neither.
HEAVY = {"recorder", "sae", "float8_kernels"}


def test_every_moved_module_is_listed_here() -> None:
    assert set(_compat.MOVED) == set(EARLIER_NAMES)


def test_the_library_imports_no_earlier_path() -> None:
    """Inside the library every import names a module's home, never an earlier name."""
    earlier = {f"saev_shards.{name}" for name in _compat.MOVED}
    files = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    known = set(files) | earlier
    found = sorted(
        f"{module} -> {target}"
        for module, path in files.items()
        for target in imported_modules(path, module, known)
        if target in earlier or any(target.startswith(f"{name}.") for name in earlier)
    )
    assert not found, found


@pytest.mark.parametrize("name", sorted(EARLIER_NAMES))
def test_every_earlier_name_imports_from_the_earlier_path(name: str) -> None:
    module = importlib.import_module(f"saev_shards.{name}")
    home = importlib.import_module(f"saev_shards.{_compat.MOVED[name]}")
    assert module is home and home.__spec__ is not None
    assert module.__name__ == home.__spec__.name == f"saev_shards.{_compat.MOVED[name]}"
    assert getattr(ss, name) is home
    missing = [n for n in EARLIER_NAMES[name] if not hasattr(module, n)]
    assert not missing, f"saev_shards.{name} lacks {missing}"
    namespace: dict[str, object] = {}
    exec(f"from saev_shards.{name} import {', '.join(EARLIER_NAMES[name])}", namespace)


@pytest.mark.parametrize("name", sorted(SAME_PATH))
def test_a_module_turned_package_keeps_its_names(name: str) -> None:
    module = importlib.import_module(f"saev_shards.{name}")
    assert not [n for n in SAME_PATH[name] if not hasattr(module, n)]


def test_the_earlier_paths_import_nothing_heavy_and_nothing_before_asked() -> None:
    light = sorted(set(EARLIER_NAMES) - HEAVY)
    code = (
        "import sys\n"
        "import saev_shards\n"
        "assert 'saev_shards.dump.corpus' not in sys.modules and 'saev_shards.reader.views' not in sys.modules\n"
        f"for name in {light!r}:\n"
        "    __import__('saev_shards.' + name)\n"
        "print(sorted(m for m in ('torch', 'numba') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_an_unknown_attribute_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'no_such_module'"):
        ss.no_such_module  # type: ignore[attr-defined]  # noqa: B018
    assert not hasattr(ss, "layoutt")


def test_pickles_that_name_an_earlier_path_load() -> None:
    entry = ss.protocol.manifest.ShardEntry("acts000000.bin", 3, 48, None)
    earlier = pickle.dumps(entry, protocol=2).replace(b"saev_shards.protocol.manifest", b"saev_shards.manifest")
    assert b"saev_shards.manifest" in earlier
    assert pickle.loads(earlier) == entry


def test_metadata_format_is_rules_and_warns() -> None:
    md = ss.Metadata(
        family="clip", ckpt="c", layers=(1,), patches_per_ex=2, cls_token=False, d_model=4, n_examples=3,
        patches_per_shard=8, data={}, dataset="d",
    )  # fmt: skip
    with pytest.warns(DeprecationWarning, match="Metadata.rules"):
        assert md.format is md.rules
    assert md.rules.name == md.dialect


def test_blocks_is_block_digests() -> None:
    from saev_shards.protocol.manifest import Blocks

    assert Blocks is BlockDigests is importlib.import_module("saev_shards.manifest").Blocks
    assert BlockDigests(16, {"a": ["0" * 32, "1" * 32]}).span(1, 20) == (16, 19)


def test_the_float8_rule_and_its_engines_share_one_set_of_constants() -> None:
    from saev_shards.protocol import float8 as rule

    float8 = importlib.import_module("saev_shards.float8")
    assert float8.FLOAT8_MAX is rule.FLOAT8_MAX and float8.check_range is rule.check_range
    q, s = float8.quantize_numpy(np.array([[1.0, -448.0]], np.float32))
    assert q.view(np.uint8).tolist() == [[0x38, 0xFE]] and s.tolist() == [1.0]
