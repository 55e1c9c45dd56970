"""The one check for a ``layers`` argument given as a string (``layers="11"``).

A string is a sequence, so code that iterates ``layers`` would silently read ``"11"`` as
the layers ``"1"`` and ``"1"``. Every place that accepts ``layers`` (the dump
configuration, `Recorder`, the loaders) rejects a string with this message instead.
"""

from __future__ import annotations

import re

_INTS = re.compile(r"\s*\[?\s*(-?\d+(?:\s*[,\s]\s*-?\d+)*)\s*\]?\s*")


def string_layers_problem(field: str, value: object) -> str | None:
    """``"<field>: expected a list of layer values such as [11], found the string '11'"`` for a
    string (or bytes) ``value``; None for anything else."""
    if not isinstance(value, (str, bytes)):
        return None
    text = value.decode("utf-8", "replace") if isinstance(value, bytes) else value
    match = _INTS.fullmatch(text)
    example = "[" + ", ".join(re.split(r"[,\s]+", match.group(1).strip())) + "]" if match else "[1, 3]"
    return (
        f"{field}: expected a list of layer values such as {example}, found the string {value!r} "
        f"(a string is not read as a list of layers)"
    )
