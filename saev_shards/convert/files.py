"""The one rule for every file a converter reads (docs/convert.md, "Sources from elsewhere").

A source is data from elsewhere, as a cache is, and every source kind reads its files
through these functions:

* regular files only: ``stat`` before anything is opened, so a FIFO, a device or a socket
  is never opened and nothing blocks (links are followed: sources are often linked in, as
  Hugging Face snapshots are, but what they lead to must be a regular file); a folder that a
  library reads by itself (a zarr store, a ``datasets`` folder) is walked first (`check_tree`);
* every read capped: a file larger than its cap, or one that grows while read, is refused
  before its bytes are held (`read_bytes`), gzip expands only up to its cap (`gunzip`),
  JSON goes through the strict loader of caches (`read_json`: depth, repeated keys, 64-bit
  integers), and lines of text are read one bounded line at a time (`read_line`);
* every problem a `ConvertError` naming the file and what was wrong (`SourceNotFoundError`
  for a missing one), never a raw `OSError` or `ValueError`.

`read_ahead` loads the next item in a daemon thread while the caller works on this one; it
is never waited for after an error or Ctrl-C, so an interrupted conversion stops at once.
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
import threading
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from ..errors import ConvertError, JSONFileError, NotRegularFileError, ShardsError, SourceNotFoundError
from ..fileio import file_kind, open_regular
from ..protocol.jsonfile import short_repr, strict_json_loads

#: Largest JSON file of a source read (an index, a configuration, dataset_info.json): an index
#: of 10^5 shards is a few tens of MB.
MAX_JSON_BYTES = 64 << 20
#: Longest line of a JSON Lines text file (one sample's text and metadata).
MAX_LINE_BYTES = 16 << 20
#: Bytes read or inflated per call: large enough to cost nothing, small enough that Ctrl-C is
#: seen between calls within a fraction of a second.
PIECE_BYTES = 64 << 20
#: Entries a source folder may hold (`check_tree`): far above any real store's chunk files.
MAX_TREE_ENTRIES = 50_000_000

T = TypeVar("T")
R = TypeVar("R")


def _os_error(path: Path, err: OSError, what: str) -> ConvertError:
    if err.errno == errno.ENOENT:
        return SourceNotFoundError(f"{path}: missing{what}")
    reason = {
        errno.ELOOP: "a loop of symbolic links",
        errno.ENAMETOOLONG: "its name is too long for the filesystem",
    }.get(err.errno or 0, err.strerror or str(err))
    return ConvertError(f"{path}: cannot be read{what}: {reason}")


def _about(what: str) -> str:
    return f" ({what})" if what else ""


def open_file(path: Path, what: str = "") -> io.FileIO:
    """``path`` opened for reading if it is a regular file (links followed); `ConvertError` otherwise."""
    try:
        return open_regular(path, follow_links=True)
    except NotRegularFileError as err:
        raise ConvertError(f"{err}{_about(what)}: a source is read from regular files only") from None
    except OSError as err:
        raise _os_error(path, err, _about(what)) from None


def is_file(path: Path) -> bool:
    """Whether ``path`` is a regular file (links followed), without raising (for ``detect``)."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def is_dir(path: Path) -> bool:
    """Whether ``path`` is a folder (links followed), without raising (for ``detect``)."""
    try:
        return stat.S_ISDIR(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def read_bytes(path: Path, max_bytes: int, what: str = "", *, hint: str = "") -> bytes:
    """The bytes of the regular file ``path``, if it holds at most ``max_bytes``
    (`ConvertError` naming both sizes and ``hint``: how to raise the cap). Read in pieces of
    `PIECE_BYTES`, so Ctrl-C is seen between them."""
    with open_file(path, what) as f:
        size = os.fstat(f.fileno()).st_size
        if size > max_bytes:
            raise ConvertError(
                f"{path}{_about(what)}: {size:,} bytes, more than the {max_bytes:,} this file may hold{hint}"
            )
        data = bytearray(size + 1)  # one more than expected: a file that grows is caught
        view = memoryview(data)
        done = 0
        try:
            while done <= size:
                n = f.readinto(view[done : min(size + 1, done + PIECE_BYTES)])
                if not n:
                    break
                done += n
        except OSError as err:
            raise _os_error(path, err, _about(what)) from None
        finally:
            view.release()
    if done > size:
        raise ConvertError(f"{path}{_about(what)}: grew while it was read")
    del data[done:]
    # bytes, not the bytearray: io.BytesIO (the unpickler's file) shares bytes but copies a
    # bytearray; one copy now, while nothing else is held, keeps the peak at twice the file.
    return bytes(data)


def read_json(path: Path, what: str = "", max_bytes: int = MAX_JSON_BYTES) -> Any:
    """``path`` parsed by the strict JSON loader of caches (`strict_json_loads`)."""
    data = read_bytes(path, max_bytes, what)
    try:
        return strict_json_loads(data)
    except JSONFileError as err:
        raise ConvertError(f"{path}{_about(what)}: {err}") from None


def gunzip(data: bytes, max_bytes: int, path: Path, *, hint: str = "") -> bytes:
    """Every gzip member of ``data``, decompressed, if they expand to at most ``max_bytes``.

    One call into zlib per `PIECE_BYTES` of output, each releasing the GIL for all of its
    work (and Ctrl-C seen between them); a "gzip bomb" (members that expand a thousandfold)
    stops at the cap, having held at most ``max_bytes`` + one piece."""
    out: list[bytes] = []
    total = 0
    view = memoryview(data)
    try:
        while view.nbytes:
            inflater = zlib.decompressobj(wbits=31)
            piece = inflater.decompress(view, min(PIECE_BYTES, max_bytes - total + 1))
            while True:
                total += len(piece)
                if total > max_bytes:
                    raise ConvertError(
                        f"{path}: expands to more than {max_bytes:,} bytes, the most one shard may take{hint}; "
                        "nothing was converted from it"
                    )
                out.append(piece)
                if inflater.eof or not inflater.unconsumed_tail:
                    break
                piece = inflater.decompress(inflater.unconsumed_tail, min(PIECE_BYTES, max_bytes - total + 1))
            if not inflater.eof:
                raise ConvertError(f"{path}: not a readable gzip file (truncated after {total:,} bytes)")
            rest = inflater.unused_data
            if rest and rest.lstrip(b"\0") == b"":
                break  # padding after the last member, as gzip(1) allows
            view = memoryview(rest)
    except zlib.error as err:
        raise ConvertError(f"{path}: not a readable gzip file ({err})") from None
    return b"".join(out)


def open_lines(path: Path, what: str = "") -> io.BufferedReader:
    """A regular text file opened for reading line by line through a 1 MiB buffer (an
    unbuffered file reads a line one byte per system call)."""
    return io.BufferedReader(open_file(path, what), buffer_size=1 << 20)


def read_line(f: io.BufferedReader, path: Path, line: int) -> bytes:
    """One line of a text file (up to `MAX_LINE_BYTES`; `ConvertError` naming the line beyond)."""
    data = f.readline(MAX_LINE_BYTES + 1)
    if len(data) > MAX_LINE_BYTES and not data.endswith(b"\n"):
        raise ConvertError(f"{path}: line {line} is longer than {MAX_LINE_BYTES:,} bytes")
    return data


def check_tree(folder: Path, what: str, caps: Mapping[str, int] | None = None) -> int:
    """Check that everything under ``folder`` is a folder or a regular file (links followed,
    each folder visited once), before a library that opens the files itself reads them;
    returns how many files it holds. `ConvertError` naming the first other thing found, or
    a file named in ``caps`` (e.g. metadata a library reads whole) larger than its cap."""
    seen: set[tuple[int, int]] = set()
    todo = [folder]
    files = 0
    entries = 0
    while todo:
        here = todo.pop()
        try:
            st = os.stat(here)
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            with os.scandir(here) as it:
                listed = list(it)
        except OSError as err:
            raise _os_error(here, err, _about(what)) from None
        entries += len(listed)
        if entries > MAX_TREE_ENTRIES:
            raise ConvertError(f"{folder}{_about(what)}: holds more than {MAX_TREE_ENTRIES:,} entries")
        for entry in listed:
            path = Path(entry.path)
            try:
                st = entry.stat(follow_symlinks=True)
            except OSError as err:
                if err.errno == errno.ENOENT and entry.is_symlink():
                    raise ConvertError(f"{path}{_about(what)}: a symbolic link to nothing") from None
                raise _os_error(path, err, _about(what)) from None
            kind = st.st_mode
            if stat.S_ISDIR(kind):
                todo.append(path)
            elif stat.S_ISREG(kind):
                files += 1
                cap = caps.get(entry.name) if caps else None
                if cap is not None and st.st_size > cap:
                    raise ConvertError(f"{path}{_about(what)}: {st.st_size:,} bytes, more than the {cap:,} it may hold")
            else:
                linked = " (through a symbolic link)" if entry.is_symlink() else ""
                raise ConvertError(
                    f"{path}{_about(what)}: expected a regular file, found {file_kind(kind)}{linked}: "
                    "a source is read from regular files only"
                )
    return files


@contextlib.contextmanager
def library_errors(where: Path, what: str) -> Iterator[None]:
    """What a library (zarr, datasets, pyarrow, numpy) raises reading a broken or hostile
    source, as a `ConvertError` naming ``where``: ``"<where>: not a readable <what> (...)"``.
    A `ShardsError` passes through; running out of memory says how to bound it."""
    try:
        yield
    except ShardsError:
        raise
    except MemoryError:
        raise ConvertError(
            f"{where}: not enough memory to read it (a lower --max-memory refuses it up front)"
        ) from None
    except Exception as err:  # the libraries raise many kinds for broken metadata and data
        text = short_repr(str(err), 200)
        raise ConvertError(f"{where}: not a readable {what} ({type(err).__name__}: {text})") from None


def read_ahead(
    load: Callable[[T], R], items: Sequence[T], name: str = "saev-shards-convert-read"
) -> Iterator[tuple[T, R]]:
    """``(item, load(item))`` in order, the next item loaded in a thread while this one is used.

    The thread is a daemon that is never joined: when the caller stops (an error, Ctrl-C,
    the generator closed) it returns at once, and whatever the thread is doing (a long
    decompression, a slow read) ends with the process. At most two results are held."""
    if not items:
        return

    def start(item: T) -> tuple[dict[str, Any], threading.Event]:
        box: dict[str, Any] = {}
        done = threading.Event()

        def work() -> None:
            try:
                box["value"] = load(item)
            except BaseException as err:  # handed to the caller, raised there
                box["error"] = err
            finally:
                done.set()

        threading.Thread(target=work, name=name, daemon=True).start()
        return box, done

    pending = start(items[0])
    for k, item in enumerate(items):
        box, done = pending
        while not done.wait(0.25):  # short waits: Ctrl-C is seen at once
            pass
        if "error" in box:
            raise box.pop("error")
        value = box.pop("value")
        if k + 1 < len(items):
            pending = start(items[k + 1])
        yield item, value
        del value
