"""storage.url: which strings are URLs, how roots, caches and file names split and join, and the
segments refused before a request is sent or a local folder named after them."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from saev_shards.errors import CacheRefError
from saev_shards.storage import url
from saev_shards.storage.url import REMOTE_SCHEMES, check_url, is_url, join_url, split_roots, split_url, strip

segment = st.text("abcXYZ019-_.%", min_size=1, max_size=8).filter(lambda s: s.strip(".") and "%2" not in s.lower())


def test_urls() -> None:
    assert is_url("s3://bucket/x") and is_url("https://host/p") and not is_url("/scratch/s3://x") and not is_url("3f2a")
    assert not is_url(Path("s3://bucket"))
    assert split_url("s3://b/root/3f2a/") == ("s3://b/root", "3f2a")
    assert join_url("s3://b/root/", "/3f2a", "shards.json") == "s3://b/root/3f2a/shards.json"
    assert split_roots("/scratch/shards:s3://b/shards::https://h/p") == [
        "/scratch/shards",
        "s3://b/shards",
        "https://h/p",
    ]


def test_the_earlier_module_names_the_same_functions() -> None:
    from saev_shards.remote import url as earlier

    for name in earlier.__all__:
        assert getattr(earlier, name) is getattr(url, name), name


@pytest.mark.parametrize("scheme", REMOTE_SCHEMES)
def test_every_remote_scheme_in_any_case_is_a_url(scheme: str) -> None:
    assert is_url(f"{scheme}://host/p") and is_url(f"{scheme.upper()}://host")
    assert not is_url(f"{scheme}:///p")  # no host or bucket
    assert url.scheme(f"{scheme.upper()}://host") == scheme


@pytest.mark.parametrize("ref", ["file://host/p", "ftp://host/p", "s3:/bucket", "", "3f2a", 7, None, b"s3://b/x"])
def test_other_references_are_not_urls(ref: object) -> None:
    assert not is_url(ref)


@given(st.sampled_from(["s3://b", "https://h:8080/x"]), st.lists(segment, max_size=4), segment)
def test_join_and_split_are_inverse(root: str, middle: list[str], last: str) -> None:
    parent = join_url(root, *middle)
    joined = join_url(parent + "/", "/" + last + "/")
    assert joined == f"{parent}/{last}" and "//" not in joined.split("://", 1)[1]
    assert split_url(joined) == (parent, last)
    assert split_url(joined + "//") == (parent, last)
    assert check_url(joined) == joined


def test_a_bucket_alone_has_no_parent() -> None:
    assert split_url("s3://bucket/") == ("s3://bucket", "")
    assert strip("s3://bucket///") == "s3://bucket"


@pytest.mark.parametrize(
    "bad", ["s3://b/root/..", "s3://b/../x", "https://h/a/./b", "s3://b/root/%2e%2E", "s3://b/root/.%2e/x", "s3://b/."]
)
def test_dot_segments_are_refused(bad: str) -> None:
    with pytest.raises(CacheRefError, match="names a folder above or the same folder"):
        check_url(bad)


@pytest.mark.parametrize("bad", ["s3://b/ro\x00ot", "s3://b/root\n", "https://h/\x7f"])
def test_control_characters_are_refused(bad: str) -> None:
    with pytest.raises(CacheRefError, match="a URL with a control character"):
        check_url(bad)


def test_dots_in_a_name_query_or_fragment_are_fine() -> None:
    for fine in ("s3://b/root/.../x", "s3://b/r..t/x.json", "https://h/p?x=..", "https://h/p#../.."):
        assert check_url(fine) == fine


def test_roots_split_at_the_path_separator_but_not_in_a_url() -> None:
    assert split_roots("") == []
    assert split_roots("::/a::") == ["/a"]
    assert split_roots("s3://b:gs://c/d:/e") == ["s3://b", "gs://c/d", "/e"]
    assert split_roots("weird://x") == ["weird", "//x"]  # not a scheme read here: split as a path
