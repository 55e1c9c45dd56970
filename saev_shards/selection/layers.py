"""A ``layers`` argument checked against the layers a cache (or a model) records.

Two rules, one wording, for every place that accepts ``layers`` (the dump configuration,
`Recorder`, the loaders, the datasets and the shuffle):

* A string is refused with its own message (`string_layers_problem`): a string is a
  sequence, so code that iterates ``layers`` would silently read ``"11"`` as the layers
  ``"1"`` and ``"1"``.
* `choose_layers` takes None (every recorded layer), one layer value, or a list of
  distinct recorded values, and raises the caller's error class otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import numpy as np

from ..errors import ShardsError
from ..protocol.jsonfile import short_repr

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


def choose_layers(recorded: Sequence[int], layers: object, error: type[ShardsError]) -> tuple[int, ...]:
    """The layer *values* ``layers`` chooses among ``recorded``, in the order given: None is every
    recorded layer; else one integer or an iterable of distinct recorded values. ``error``
    (the caller's class) names what is wrong otherwise."""
    if layers is None:
        return tuple(int(v) for v in recorded)
    as_string = string_layers_problem("layers", layers)
    if as_string is not None:
        raise error(as_string)
    chosen: tuple[object, ...]
    if isinstance(layers, (int, np.integer)) and not isinstance(layers, bool):
        chosen = (layers,)
    elif isinstance(layers, Iterable) and not isinstance(layers, dict) and getattr(layers, "ndim", 1) == 1:
        chosen = tuple(layers)
    else:
        raise error(f"layers: expected None, a layer value or a list of them, found {short_repr(layers)}")
    if not chosen:
        raise error(f"layers: expected at least one of the recorded layers {list(recorded)}, found none")
    values = []
    for layer in chosen:
        # (spelled out, not `is_int`: mypy narrows `layer` to an integer only from isinstance)
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)) or int(layer) not in recorded:
            raise error(f"layers: expected values among the recorded layers {list(recorded)}, found {layer!r}")
        values.append(int(layer))
    if len(set(values)) != len(values):
        raise error(f"layers: expected distinct values, found {values}")
    return tuple(values)
