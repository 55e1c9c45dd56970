"""Text corpora for `dump`: a real corpus that ships with every Python, and plain files.

`stdlib_corpus` needs no download: it yields the paragraphs of the interactive help
topics (``pydoc_data.topics``) and then the docstrings of the standard library's own
source files, read with `ast` (nothing is imported or executed). Both are in a fixed
order, so the same Python version gives the same examples on every machine; the corpus
`digest` goes into the cache's metadata so a different corpus can never share a hash.

Every corpus is a sequence of `Example`: an id, the text, and optional extra fields
(numbers become per-example columns, strings JSON Lines text; see `dump`).
"""

from __future__ import annotations

import ast
import dataclasses
import itertools
import os
import sys
import sysconfig
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
import xxhash

#: Parts of the standard library that are not prose about Python: tests, demos, vendored code.
_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "turtledemo", "lib2to3", "ensurepip"}
)


@dataclasses.dataclass(frozen=True)
class Example:
    """One example of a corpus: a stable ``id``, its ``text`` and optional extra ``fields``."""

    id: str
    text: str
    fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A fixed, ordered list of examples and what describes it in the cache's metadata.

    ``name`` goes to ``metadata.dataset``; ``description`` (with the `digest` of every
    id and text) goes to ``metadata.data``.
    """

    name: str
    description: Mapping[str, Any]
    examples: Sequence[Example]

    def __len__(self) -> int:
        return len(self.examples)

    @property
    def digest(self) -> str:
        """xxh3_128 of every example's id, text and fields, in order."""
        return digest(self.examples)


def digest(examples: Iterable[Example]) -> str:
    """xxh3_128 hex of the examples (ids, texts and fields), in order."""
    h = xxhash.xxh3_128()
    for ex in examples:
        h.update(orjson.dumps([ex.id, ex.text, dict(ex.fields)], option=orjson.OPT_SORT_KEYS))
        h.update(b"\n")
    return h.hexdigest()


# --------------------------------------------------------------------------------------
# the standard-library corpus


def stdlib_corpus(limit: int | None = None, *, min_chars: int = 40) -> Corpus:
    """The first ``limit`` examples (all if None) of the standard-library corpus.

    Examples are, in order: every paragraph of at least ``min_chars`` characters of each
    ``pydoc_data.topics`` entry (topics sorted by name), then every module, class and
    function docstring of at least ``min_chars`` characters from the standard library's
    ``.py`` files (sorted by path; tests and demos skipped).

    >>> c = stdlib_corpus(3)
    >>> [ex.id for ex in c.examples]  # doctest: +SKIP
    ['topics/assert/0', 'topics/assert/1', 'topics/assert/2']
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, found {limit}")
    examples = list(itertools.islice(iter_stdlib(min_chars=min_chars), limit))
    version = ".".join(map(str, sys.version_info[:3]))
    description = {
        "kind": "stdlib",
        "python": version,
        "sources": ["pydoc_data.topics", "stdlib docstrings"],
        "min_chars": min_chars,
        "n_examples": len(examples),
        "xxh3_128": digest(examples),
    }
    return Corpus(f"python-stdlib-{version}", description, examples)


def iter_stdlib(*, min_chars: int = 40) -> Iterator[Example]:
    """All examples of the standard-library corpus, lazily, in their fixed order."""
    yield from _topic_paragraphs(min_chars)
    yield from _docstrings(min_chars)


def _topic_paragraphs(min_chars: int) -> Iterator[Example]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions split pydoc_data out; the docstrings remain
        return
    for name in sorted(topics):
        text = topics[name].replace("\r\n", "\n")
        paragraphs = (p.strip() for p in text.split("\n\n"))
        for i, para in enumerate(p for p in paragraphs if len(p) >= min_chars):
            yield Example(f"topics/{name}/{i}", para, {"source": "pydoc_data.topics"})


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS and not d.startswith((".", "__")))
        found.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _docstrings(min_chars: int) -> Iterator[Example]:
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in _stdlib_files():
        rel = path.relative_to(root).as_posix()
        try:
            tree = ast.parse(path.read_bytes(), filename=rel)
        except (SyntaxError, ValueError, OSError):
            continue
        for qualname, doc in _walk_docstrings(tree, ""):
            if len(doc) >= min_chars:
                yield Example(f"doc/{rel}:{qualname or '<module>'}", doc, {"source": rel})


def _walk_docstrings(node: ast.AST, prefix: str) -> Iterator[tuple[str, str]]:
    """``(qualified name, docstring)`` of ``node`` and its nested definitions, in source order."""
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        doc = ast.get_docstring(node, clean=True)
        if doc:
            yield prefix, doc
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _walk_docstrings(child, f"{prefix}.{child.name}" if prefix else child.name)


# --------------------------------------------------------------------------------------
# files


def jsonl_corpus(
    path: str | os.PathLike[str],
    *,
    text_field: str = "text",
    id_field: str | None = None,
    fields: Sequence[str] = (),
    limit: int | None = None,
) -> Corpus:
    """Examples from a JSON Lines file: one object per line with a string ``text_field``.

    ``id_field`` names the id (default: the line number); ``fields`` are kept as extra
    per-example fields. Raises `ValueError` naming the line of any malformed record.
    """
    path = Path(path)
    examples: list[Example] = []
    with path.open("rb") as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(examples) >= limit:
                break
            if not line.strip():
                continue
            try:
                record = orjson.loads(line)
            except orjson.JSONDecodeError as err:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({err})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, found {type(record).__name__}")
            text = record.get(text_field)
            if not isinstance(text, str):
                raise ValueError(f"{path}:{lineno}: expected a string field {text_field!r}, found {text!r:.60}")
            missing = [k for k in fields if k not in record]
            if missing:
                raise ValueError(f"{path}:{lineno}: missing fields {missing}")
            ex_id = str(record[id_field]) if id_field is not None and id_field in record else str(lineno - 1)
            examples.append(Example(ex_id, text, {k: record[k] for k in fields}))
    description = {
        "kind": "jsonl",
        "file": path.name,
        "text_field": text_field,
        "id_field": id_field,
        "fields": list(fields),
        "n_examples": len(examples),
        "xxh3_128": digest(examples),
    }
    return Corpus(str(path.resolve()), description, examples)


def lines_corpus(path: str | os.PathLike[str], *, limit: int | None = None, min_chars: int = 1) -> Corpus:
    """Examples from a UTF-8 text file: one per non-empty line (id = line number)."""
    path = Path(path)
    examples: list[Example] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f):
            if limit is not None and len(examples) >= limit:
                break
            text = line.rstrip("\r\n")
            if len(text.strip()) >= min_chars:
                examples.append(Example(str(lineno), text))
    description = {
        "kind": "lines",
        "file": path.name,
        "min_chars": min_chars,
        "n_examples": len(examples),
        "xxh3_128": digest(examples),
    }
    return Corpus(str(path.resolve()), description, examples)
