"""dump.corpus: the corpora a dump reads, fixed and ordered, with a digest of every example."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from saev_shards.dump import corpus


def test_the_stdlib_corpus_is_the_same_every_time_and_its_prefix_is_a_prefix() -> None:
    a, b = corpus.stdlib_corpus(8), corpus.stdlib_corpus(8)
    assert a.examples == b.examples and a.digest == b.digest and len(a) == 8
    assert corpus.stdlib_corpus(3).examples == a.examples[:3]
    assert len({ex.id for ex in a.examples}) == 8
    assert all(len(ex.text) >= 40 for ex in a.examples)
    assert corpus.digest(a.examples[:3]) == corpus.stdlib_corpus(3).digest != a.digest


def test_a_jsonl_corpus_keeps_ids_texts_and_fields(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    rows = [{"text": "alpha", "id": "a", "label": 1}, {"text": "beta", "id": "b", "label": 2}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    c = corpus.jsonl_corpus(path, id_field="id", fields=["label"])
    assert [(ex.id, ex.text, dict(ex.fields)) for ex in c.examples] == [
        ("a", "alpha", {"label": 1}),
        ("b", "beta", {"label": 2}),
    ]
    assert [ex.id for ex in corpus.jsonl_corpus(path, limit=1).examples] == ["0"]  # the line number by default
    assert c.digest != corpus.jsonl_corpus(path, id_field="id").digest  # the fields count


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", r"c\.jsonl:2: not valid JSON"),
        ("[1]", r"c\.jsonl:2: expected a JSON object, found list"),
        ('{"text": 3}', r"c\.jsonl:2: expected a string field 'text', found 3"),
        ('{"text": "x"}', r"c\.jsonl:2: missing fields \['label'\]"),
    ],
)
def test_a_malformed_line_is_named(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "c.jsonl"
    path.write_text('{"text": "ok", "label": 0}\n' + line + "\n")
    with pytest.raises(ValueError, match=message):
        corpus.jsonl_corpus(path, fields=["label"])
