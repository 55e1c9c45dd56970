"""protocol.sites: what a layer slot holds, spelled four ways, checked with one wording."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from saev_shards.protocol.sites import (
    Site,
    as_site,
    describe,
    normalise,
    parse_sites_json,
    site_problem,
    sites_problems,
)

modules = st.text(st.sampled_from("abc.:_0123"), max_size=12)


@given(modules, st.sampled_from(["input", "output"]))
def test_every_spelling_of_a_site_gives_the_site(module: str, io: str) -> None:
    site = Site(module, io)
    for spelling in (site, (module, io), [module, io], {"module": module, "io": io}, str(site), site.to_json()):
        assert as_site(spelling) == site
    assert parse_sites_json([site.to_json()]) == ((site,), [])


@pytest.mark.parametrize(
    "value", ["encoder.layer.3", "x:inputs", ":", ("a", "in"), ("a",), {"module": "a"}, {"module": 1, "io": "input"}, 3]
)
def test_what_spells_no_site(value: object) -> None:
    assert as_site(value) is None


def test_the_problem_with_a_string_and_with_anything_else() -> None:
    assert site_problem("x:inputs") == (
        "expected 'module:input' or 'module:output' (such as 'encoder.layer.3.intermediate:input'), found 'x:inputs'"
    )
    assert site_problem(3).startswith("expected a site: 'module:input' or 'module:output', a (module, io) pair")
    assert site_problem(3).endswith("with io 'input' or 'output', found int 3")


def test_sites_problems_names_each_slot() -> None:
    a, b = Site("a", "input"), Site("b", "output")
    assert sites_problems(None, 3) == []
    assert sites_problems((a, b), 2) == []
    assert sites_problems([a, b], 2) == ["sites: expected None or a list of sites (one per layer), found array"]
    assert sites_problems((a, "b:x"), 2) == [f"sites[1]: {site_problem('b:x')}"]
    assert sites_problems((a,), 2) == ["sites: expected one site per layer (2), found 1"]
    assert sites_problems((a, b, a), 3) == ["sites[2]: 'a:input' is sites[0] again (every slot holds another site)"]
    assert sites_problems((Site("a", "sideways"),), 1) == [
        "sites[0].io: expected one of ['input', 'output'], found 'sideways'"
    ]


def test_normalise_converts_only_what_spells_sites() -> None:
    a = Site("a", "input")
    assert normalise(["a:input", ("b", "output")]) == (a, Site("b", "output"))
    assert normalise(["a:input", 3]) == (a, 3)
    for unchanged in (None, "a:input", b"x", {"module": "a", "io": "input"}, 3):
        assert normalise(unchanged) is unchanged


@pytest.mark.parametrize(
    ("value", "problems"),
    [
        ("a:input", ["sites: expected an array of site objects, found string"]),
        ([["a", "input"]], ["sites[0]: expected an object with exactly the keys ['module', 'io'], found array"]),
        (
            [{"module": "a", "io": "input", "x": 1}],
            [
                "sites[0]: expected an object with exactly the keys ['module', 'io'], "
                "found an object with keys ['io', 'module', 'x']"
            ],
        ),
        (
            [{"module": 1, "io": "in"}],
            [
                "sites[0].module: expected a string, found int",
                "sites[0].io: expected one of ['input', 'output'], found 'in'",
            ],
        ),
    ],
)
def test_parse_sites_json_is_strict(value: Any, problems: list[str]) -> None:
    assert parse_sites_json(value) == (None, problems)


def test_describe_a_slot_for_people() -> None:
    assert describe(None, 3) == "layer 3"
    assert describe(Site("encoder.layer.3.intermediate", "input"), 0) == "encoder.layer.3.intermediate (input)"
    assert describe(Site("", "output"), 0) == "(the model) (output)"
