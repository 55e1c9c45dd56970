"""The batches a seed gives, pinned: digests of every batch (values, examples, tokens, layers,
labels), of the states and of resumed epochs, for each path a loader can take.

The digests were computed by the loaders before the compiled gathers and window indexes
(`saev_shards.codecs.gather`) existed; every path must keep giving them, with numba and with
numpy alone, windows read in place or into buffers, on the host or the device path (run on the
CPU), so that a saved state resumes the same batches whatever the machine has installed.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

import saev_shards as ss
from saev_shards import loaders
from saev_shards.codecs import float8, gather
from saev_shards.loaders import mapped

from ...support.caches import small_metadata, write_cache

#: The caches: ``(metadata changes, write_cache keywords)``. Shards of 40 examples of 2 x 17 x 16
#: values (about 44 KB of float16), several windows per epoch with the loaders' small buffers.
CACHES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "float16": ({}, {"labels": True}),
    "lengths": ({}, {"lengths": True}),
    "float8": ({"dtype": "float8_e4m3"}, {"labels": True}),
    "bfloat16": ({"dtype": "bfloat16"}, {}),
    "float32": ({"dtype": "float32"}, {}),
}

BASE = {"batch_size": 37, "buffer_bytes": 20_000, "block_bytes": 3_000, "seed": 5}

#: ``name: (cache, loader keywords)``.
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "one layer": ("float16", {"layers": 11}),
    "mixed, float32 out": ("float16", {"mix_layers": True, "out_dtype": "float32"}),
    "stacked, bfloat16 out": ("float16", {"stack_layers": True, "out_dtype": "bfloat16"}),
    "labels ignored, every token": ("float16", {"layers": 6, "tokens": "all", "ignore_labels": [3, 5, 200]}),
    "cls only": ("float16", {"layers": 11, "tokens": "cls", "batch_size": 5}),
    "rank 1 of 3, drop_last": ("float16", {"layers": 11, "rank": 1, "world_size": 3, "drop_last": True}),
    "one window": ("float16", {"layers": 11, "buffer_bytes": 1 << 30}),
    "big batches": ("float16", {"mix_layers": True, "batch_size": 1000}),
    "lengths": ("lengths", {"layers": 11}),
    "lengths, stacked": ("lengths", {"stack_layers": True, "out_dtype": "float32"}),
    "ordered": ("float16", {"order": "ordered", "mix_layers": True}),
    "ordered, one layer, float32 out": ("float16", {"order": "ordered", "layers": 6, "out_dtype": "float32"}),
    "ordered, lengths": ("lengths", {"order": "ordered", "layers": 11, "batch_size": 64}),
    "float8": ("float8", {"layers": 11}),
    "float8, float32 out": ("float8", {"mix_layers": True, "out_dtype": "float32"}),
    "float8, bfloat16 out, stacked": ("float8", {"stack_layers": True, "out_dtype": "bfloat16"}),
    "float8, ordered": ("float8", {"order": "ordered", "layers": 6}),
    "bfloat16": ("bfloat16", {"layers": 11}),
    "bfloat16, float32 out": ("bfloat16", {"mix_layers": True, "out_dtype": "float32"}),
    "bfloat16, float16 out": ("bfloat16", {"layers": 6, "out_dtype": "float16"}),
    "float32, float16 out": ("float32", {"layers": 11, "out_dtype": "float16"}),
    "float32, bfloat16 out, stacked": ("float32", {"stack_layers": True, "out_dtype": "bfloat16"}),
}

#: sha256 of `digest_of` for each case, computed by the loaders before the compiled paths.
EXPECTED = {
    "one layer": "f0e71131c112ffe9b30bc40a9c0ba0e39386b93899d6c7b14aa436e058f0491d",
    "mixed, float32 out": "25c9776efa1c66fdab1ff6894181477a4ac561d0f53cff46019056a71d30bf86",
    "stacked, bfloat16 out": "1a59770e9f8f24d3ac905606d4b5e04b072dc0e97a3ac68c771ceef9fdf62b0c",
    "labels ignored, every token": "1909a7799f7215ef411de1b751ff4aec9e52b4264f12443fd55b538661df3030",
    "cls only": "1fed06af91b67e1bd754a95fcbb2a78d6e1a24d73e2073af9e5226b513564f5f",
    "rank 1 of 3, drop_last": "6587e07776418293223175e1fb9c96128e59f583add122f5cd17b5eccd537728",
    "one window": "675f30e72ffdf611b8177a0c17bb48e8c241a7a927dceaa0a27bb0f89d37dc4d",
    "big batches": "9fad1ea702064b1b1b1a70e8b07a2d1f451d21d5822d6ca4d0262d37367148a7",
    "lengths": "e0cf95e3c1e523d6278b5c244a0b321cb054ba714d386305150175b6f0eea2a8",
    "lengths, stacked": "3339e115623a8254c48f5ae58fd852f3b7dd2c5a39e522cf5f600a536c48aea4",
    "ordered": "dcfe05201b29c678eae677bfee8d06cadca87b2d0b2aae78d84e1bb5ce560ac3",
    "ordered, one layer, float32 out": "7989229f3b991fbc49f467892dcd10e6d73f7605c9b02d57d239209bbcfe0c7d",
    "ordered, lengths": "660090f69b9f2ae5e21913022caa4520f42a07942432d88f3923b088f2dd6249",
    "float8": "ecb94f3e2ffee3091cb120244f632abbb77df320f13a7df5bc266ee2cc437c7c",
    "float8, float32 out": "1d951eb9f50c9c03609fdfbecef609e9d066c60ca035aeb62fc0308f8139b464",
    "float8, bfloat16 out, stacked": "b357c3e66edcddae4f76293242e636ef3ba5fc56148c81f8ea5e50e589d85b3d",
    "float8, ordered": "7bb58e52d2bb31d5e11cb45304f05b0c3023f3e82a131b067a1ee05f50cb7c8a",
    "bfloat16": "e2a06e5fcc89e085d04cc4ab45d2e4a54ec912676dfc2747791646cfe7eb9148",
    "bfloat16, float32 out": "0f35350975e46c4ae9b6cc56b5ba62cca1d2506f34752f8dfaf3745c6e09d0cd",
    "bfloat16, float16 out": "24ae0e9132ebe0327312e9ee9118ac493a7097b674426492a163ad8355ac85ab",
    "float32, float16 out": "70ce734e620cf181dd47cd184a7cb5503b56ce72b8c16eb2b64f50db350bf822",
    "float32, bfloat16 out, stacked": "dae21df0f245d510ed5cacffb6228ad4ea5440e1aee60ecb094f39db22cb2413",
}


@pytest.fixture(scope="module")
def caches(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ss.Shards]]:
    root = tmp_path_factory.mktemp("exact")
    opened = {}
    for name, (changes, options) in CACHES.items():
        md = small_metadata(
            n_examples=100, patches_per_ex=16, d_model=16, patches_per_shard=40 * 16, data={"name": name}, **changes
        )
        lengths = np.random.default_rng(3).integers(0, 18, md.n_examples).astype(np.int32)
        kwargs = {**options, "lengths": lengths} if options.get("lengths") else options
        write_cache(root, md, batches=(9,), **kwargs)
        opened[name] = ss.open(root / md.hash)
    yield opened
    for shards in opened.values():
        shards.close()


def acts_bytes(acts: torch.Tensor) -> bytes:
    """The batch's values as raw bits (bfloat16 and float16 NaN payloads included)."""
    raw = acts.contiguous().view(torch.int16 if acts.element_size() == 2 else torch.int32)
    return raw.numpy().tobytes()


def batch_bytes(batch: Any) -> list[bytes]:
    parts = [acts_bytes(batch.acts), str(tuple(batch.acts.shape)).encode(), str(batch.acts.dtype).encode()]
    parts.extend(getattr(batch, name).contiguous().numpy().tobytes() for name in ("examples", "tokens", "layers"))
    parts.append(b"-" if batch.labels is None else batch.labels.numpy().tobytes())
    return parts


def digest_of(shards: ss.Shards, kwargs: dict[str, Any], device: str | None = None) -> str:
    """Two epochs, and epoch 1 resumed from the state taken after its fourth batch: every batch's
    bytes, the states, the number of batches and the plan's examples."""
    h = hashlib.sha256()
    make = {**BASE, **kwargs, "device": device}
    loader = loaders.TokenLoader(shards, **make)
    h.update(str(len(loader)).encode())
    state_after = None
    for epoch in range(2):
        for i, batch in enumerate(loader):
            for part in batch_bytes(batch):
                h.update(part)
            if epoch == 1 and i == 3:
                state_after = loader.state_dict()
        h.update(json.dumps(loader.state_dict(), sort_keys=True).encode())
    h.update(loader.epoch_examples(1).tobytes())
    loader.close()
    if state_after is not None:
        resumed = loaders.TokenLoader(shards, **make)
        resumed.load_state_dict(state_after)
        h.update(b"resumed")
        for batch in resumed:
            for part in batch_bytes(batch):
                h.update(part)
        resumed.close()
    return h.hexdigest()


@contextlib.contextmanager
def windows_in_place(in_place: bool) -> Iterator[None]:
    saved = mapped.MIN_SHARD_BYTES
    mapped.MIN_SHARD_BYTES = 0 if in_place else 1 << 62
    try:
        yield
    finally:
        mapped.MIN_SHARD_BYTES = saved


@pytest.mark.parametrize("name", list(CASES))
def test_batches_are_the_pinned_ones(caches: dict[str, ss.Shards], name: str) -> None:
    cache, kwargs = CASES[name]
    shards = caches[cache]
    if importlib.util.find_spec("numba") is not None:
        assert gather.kernels_in_use(), "numba imports but its gathers and window indexes are not used"
    for in_place in (False, True):
        with windows_in_place(in_place):
            assert digest_of(shards, kwargs) == EXPECTED[name], (name, in_place)
    assert digest_of(shards, kwargs, device="cpu") == EXPECTED[name], (name, "device path")
    for in_place in (False, True):
        with gather.numpy_only(), windows_in_place(in_place):
            assert digest_of(shards, kwargs) == EXPECTED[name], (name, in_place, "numpy gathers and indexes")
    if cache == "float8":
        with float8.numpy_only(), gather.numpy_only():
            assert digest_of(shards, kwargs) == EXPECTED[name], (name, "numpy only")


def print_digests(caches: dict[str, ss.Shards]) -> None:  # pragma: no cover - how EXPECTED was made
    for name, (cache, kwargs) in CASES.items():
        print(f"    {name!r}: {digest_of(caches[cache], kwargs)!r},")
