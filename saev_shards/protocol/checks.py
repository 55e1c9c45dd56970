"""Shape checks of parsed JSON that word every problem they find (used by every manifest parser)."""

from __future__ import annotations

from ..errors import ManifestError, Problem, ProblemCollector
from .common import XXH3_RE
from .jsonfile import is_int, short_list, short_repr, type_name


class JSONChecks(ProblemCollector):
    """A `ProblemCollector` for one JSON file, with checks that add a problem and return None
    (or False) on failure, so a parser can check every field before it gives up."""

    def __init__(self, path: str, kind: type[ManifestError] = ManifestError) -> None:
        super().__init__(kind, f"{path}: ")

    def keys(self, where: str, obj: object, required: tuple[str, ...]) -> bool:
        """``obj`` is an object with exactly the keys ``required`` (True when none is missing)."""
        if not isinstance(obj, dict):
            self.add(f"{where}: expected an object, found {type_name(obj)}")
            return False
        missing = [k for k in required if k not in obj]
        unknown = sorted(set(obj) - set(required))
        if missing:
            self.add(f"{where}: missing keys {missing}")
        if unknown:
            self.add(f"{where}: unknown keys {short_list(unknown)}")
        return not missing

    def count(self, where: str, value: object) -> int | None:
        if not is_int(value) or value < 0:  # type: ignore[operator]
            self.add(f"{where}: expected an integer >= 0, found {type_name(value)} {short_repr(value)}")
            return None
        return value  # type: ignore[return-value]

    def digest(self, where: str, value: object) -> str | None:
        if not isinstance(value, str) or not XXH3_RE.fullmatch(value):
            self.add(f"{where}: expected 32 lower-case hex digits (xxh3_128), found {short_repr(value)}")
            return None
        return value

    def name(self, where: str, value: object, expected: str) -> str | None:
        if value != expected:
            self.add(f"{where}: expected name {expected!r}, found {short_repr(value)}")
            return None
        return expected


__all__ = ["JSONChecks", "Problem"]
