"""The order of an epoch as a strategy: which block comes when, and how a window is permuted.

`ShuffledWindows` (the training order) permutes all spans of the cache every epoch and
every unit of a window; `Sequential` walks the cache in ``(example, layer, token)`` order.
Everything random is drawn from ``(seed, epoch[, window, rank, world_size])``, so an
order never depends on threads or timing. A strategy is a small frozen object; the token
loader takes one by name (``order="shuffled"`` or ``"ordered"``) or as an instance.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from ..errors import LoaderError


class Order(Protocol):
    """What a token loader asks of its order."""

    @property
    def name(self) -> str:
        """``"shuffled"`` or ``"ordered"``: the name a loader is built with."""
        ...

    @property
    def sequential(self) -> bool:
        """Whether spans are read one after the other in each file (the default read threads
        depend on it; an order without this attribute counts as not sequential)."""
        ...

    def block_order(self, n_blocks: int, seed: int, epoch: int) -> npt.NDArray[np.int64]:
        """The spans of the cache in the order epoch ``epoch`` reads them."""
        ...

    def window_rng(self, seed: int, epoch: int, window: int, rank: int, world_size: int) -> np.random.Generator | None:
        """The generator that permutes one window's units, or None to keep them in order."""
        ...

    def fingerprint(self, buffer_bytes: int, block_bytes: int) -> dict[str, Any]:
        """The entries of a loader's fingerprint that this order decides."""
        ...


#: Bytes of the first window of an order whose windows' cuts leave its batches unchanged (an
#: `Order` with ``windows_free`` true), when its windows are larger: its first batch waits for
#: one window's reads from a cold cache, the later windows' are read while earlier ones are gathered.
FIRST_WINDOW_BYTES = 64 << 20


def windows_free(order: Order) -> bool:
    """Whether ``order``'s windows may be cut anywhere without changing its batches: its
    ``windows_free`` attribute (an order without one counts as not: a window permuted, or its
    generator drawn from its number, depends on where windows start)."""
    return bool(getattr(order, "windows_free", False))


@dataclasses.dataclass(frozen=True)
class ShuffledWindows:
    """ReadSpans permuted over the whole cache per epoch; every unit of a window permuted."""

    name: str = "shuffled"
    #: ReadSpans come in random order (`default_read_threads` keeps more requests in flight).
    sequential: bool = False
    #: Every window's units are permuted: where windows start decides the batches.
    windows_free: bool = False

    def block_order(self, n_blocks: int, seed: int, epoch: int) -> npt.NDArray[np.int64]:
        return np.random.default_rng([seed, epoch]).permutation(n_blocks).astype(np.int64)

    def window_rng(self, seed: int, epoch: int, window: int, rank: int, world_size: int) -> np.random.Generator:
        return np.random.default_rng([seed, epoch, window, rank, world_size])

    def fingerprint(self, buffer_bytes: int, block_bytes: int) -> dict[str, Any]:
        return {"shuffle": True, "buffer_bytes": buffer_bytes, "block_bytes": block_bytes}


@dataclasses.dataclass(frozen=True)
class Sequential:
    """Strict ``(example, layer, token)`` order, the same every epoch; window sizes do not matter."""

    name: str = "ordered"
    #: ReadSpans follow each other in each file: the kernel's readahead streams them.
    sequential: bool = True
    #: Windows are walked in order and never permuted: however they are cut, the same batches.
    windows_free: bool = True

    def block_order(self, n_blocks: int, seed: int, epoch: int) -> npt.NDArray[np.int64]:
        return np.arange(n_blocks, dtype=np.int64)

    def window_rng(self, seed: int, epoch: int, window: int, rank: int, world_size: int) -> None:
        return None

    def fingerprint(self, buffer_bytes: int, block_bytes: int) -> dict[str, Any]:
        return {"shuffle": False, "buffer_bytes": 0, "block_bytes": 0}


#: The orders a loader can be built with by name.
ORDERS: dict[str, Order] = {"shuffled": ShuffledWindows(), "ordered": Sequential()}


def parse_order(order: object) -> Order:
    """An `Order` from its name or an instance."""
    if isinstance(order, str):
        if order not in ORDERS:
            raise LoaderError(f"order: expected one of {list(ORDERS)} or an Order, found {order!r}")
        return ORDERS[order]
    if all(hasattr(order, a) for a in ("name", "block_order", "window_rng", "fingerprint")):
        return order  # type: ignore[return-value]
    raise LoaderError(f"order: expected one of {list(ORDERS)} or an Order, found {order!r}")
