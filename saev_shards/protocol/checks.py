"""Shape checks of parsed JSON that word every problem they find (used by every manifest
parser, and by metadata.json's and stats.json's key checks), all into one `errors.Problems`."""

from __future__ import annotations

from collections.abc import Iterable

from ..errors import ManifestError, Problem, Problems
from .common import XXH3_RE
from .jsonfile import is_int, short_list, short_repr, type_name


def check_keys(
    problems: Problems, given: Iterable[object], keys: tuple[str, ...], where: str = "", *, show_allowed: bool = False
) -> list[str]:
    """Add the missing and the unknown keys of an object whose keys are ``given`` and must be
    exactly ``keys`` (``where``, when given, starts each message); returns the missing ones."""
    given = set(given)
    missing = [k for k in keys if k not in given]
    unknown = sorted(given - set(keys), key=str)
    head = f"{where}: " if where else ""
    if missing:
        problems.add(f"{head}missing keys {missing}", field=where or None)
    if unknown:
        allowed = f" (allowed: {list(keys)})" if show_allowed else ""
        problems.add(f"{head}unknown keys {short_list(unknown)}{allowed}", field=where or None)
    return missing


class JSONChecks(Problems):
    """The `errors.Problems` of one JSON file, with checks that add a problem and return None
    (or False) on failure, so a parser can check every field before it gives up."""

    def __init__(self, path: str, kind: type[ManifestError] = ManifestError) -> None:
        super().__init__(kind, f"{path}: ", path=path)

    def keys(self, where: str, obj: object, required: tuple[str, ...]) -> bool:
        """``obj`` is an object with exactly the keys ``required`` (True when none is missing)."""
        if not isinstance(obj, dict):
            self.expected(where, "an object", type_name(obj))
            return False
        return not check_keys(self, obj, required, where)

    def count(self, where: str, value: object) -> int | None:
        if not is_int(value) or value < 0:  # type: ignore[operator]
            self.expected(where, "an integer >= 0", f"{type_name(value)} {short_repr(value)}")
            return None
        return value  # type: ignore[return-value]

    def digest(self, where: str, value: object) -> str | None:
        if not isinstance(value, str) or not XXH3_RE.fullmatch(value):
            self.expected(where, "32 lower-case hex digits (xxh3_128)", short_repr(value))
            return None
        return value

    def name(self, where: str, value: object, expected: str) -> str | None:
        if value != expected:
            self.expected(where, f"name {expected!r}", short_repr(value))
            return None
        return expected


__all__ = ["JSONChecks", "Problem", "check_keys"]
