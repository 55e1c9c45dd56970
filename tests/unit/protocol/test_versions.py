"""protocol.versions: the dialect of every metadata.json this library reads, told from the file
(and its folder's name where saev's hash rules differ), and the versions it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from saev_shards.errors import MetadataError, ProtocolVersionError
from saev_shards.protocol import common, versions

DATA = Path(__file__).resolve().parents[2] / "data"


def expected_dialect(path: Path) -> str:
    """The dialect of a fixture's metadata.json, from the fixture's folder."""
    top = path.relative_to(DATA).parts[0]
    if top.startswith("golden-"):
        return top.removeprefix("golden-")
    if top.startswith("legacy-2.1"):
        return "saev-spec"
    if top.startswith("saev-code"):
        return "saev"
    folder = path.relative_to(DATA).parts[1]  # saev-history/<format>/...
    return "saev-0.1.0" if folder == "0.1.0-pypi" else f"saev-{folder}"


FIXTURES = sorted(DATA.rglob("metadata.json"))


@pytest.mark.parametrize("path", FIXTURES, ids=lambda p: str(p.relative_to(DATA).parent))
def test_every_fixture_is_read_in_its_own_dialect(path: Path) -> None:
    found = versions.detect(json.loads(path.read_text()), path.parent.name)
    assert found.name == expected_dialect(path)
    assert versions.dialect(found.name) is found


def test_the_fixtures_cover_most_dialects() -> None:
    covered = {expected_dialect(p) for p in FIXTURES}
    assert set(versions.DIALECTS) - covered <= {"saev-64"}  # told apart by a folder name alone


def test_saev_codes_64_digit_folders_mark_the_older_dialect() -> None:
    path = next(p for p in FIXTURES if expected_dialect(p) == "saev")
    obj = json.loads(path.read_text())
    assert versions.detect(obj, "ab" * 32).name == "saev-64"
    assert versions.detect(obj, None).name == "saev"


def test_a_protocol_alone_means_its_default_dialect() -> None:
    for protocol, name in versions.DEFAULT_DIALECTS.items():
        assert protocol in common.SUPPORTED_PROTOCOLS
        assert protocol in versions.dialect(name).protocols
    assert set(versions.DEFAULT_DIALECTS) == set(common.SUPPORTED_PROTOCOLS)


@pytest.mark.parametrize("version", ["4.0", "3.1 ", 3.1, None, "pre-1.0.0"])
def test_unsupported_versions_are_refused_naming_the_ones_read(version: object) -> None:
    with pytest.raises(
        ProtocolVersionError, match=r"unsupported protocol version .*; this library reads '3\.2', '3\.1'"
    ):
        versions.check_version(version)
    with pytest.raises(ProtocolVersionError):
        versions.detect({"protocol": version})


def test_what_detect_and_dialect_refuse() -> None:
    with pytest.raises(MetadataError, match="expected a JSON object, found array"):
        versions.detect([1])
    assert versions.detect({}).name == "3.0"  # no protocol and no older keys: reported as a missing key
    with pytest.raises(MetadataError, match=r"dialect: expected one of \['3\.1', '3\.2'.*found 'v3'"):
        versions.dialect("v3")
    with pytest.raises(MetadataError, match="dialect: expected one of"):
        versions.dialect(["3.1"])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "ok"), [("a" * 64, True), ("3a3c1749", True), ("A" * 64, False), ("a" * 63, False), ("3a3c174", False)]
)
def test_cache_names(name: str, ok: bool) -> None:
    assert versions.is_cache_name(name) is ok
