"""Columnar shard files, atomic writes, stored records read back, directories built aside.

This module runs on both sides of the engine boundary: in regress's own environment and
inside candidate environments (which hold vLLM, not regress's dependencies). So it imports
only the standard library and numpy (:func:`read_record` imports regress's error class when
it runs, and takes the pydantic model from its caller).

A shard file is a zip archive with ``meta.json`` and one entry per array. Ragged per-prompt
sequences are flattened and indexed by offsets, so 10,000 prompts become a handful of arrays
rather than millions of Python objects. 4-byte arrays (int32 token ids, float32 logprobs) are
byte-shuffled before deflate: the exponent and high bytes of neighbouring values are alike,
and grouping them roughly halves the compressed size of logprobs (see docs/benchmarks.md).
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import shutil
import tempfile
import zipfile
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar

import numpy as np

if TYPE_CHECKING:
    from pydantic import BaseModel

    _Record = TypeVar("_Record", bound=BaseModel)

SHARD_FORMAT_VERSION = 1
_META = "meta.json"
_CORRUPT = (
    zipfile.BadZipFile,  # not a zip, or a CRC that does not match
    zlib.error,  # deflate stream damaged
    EOFError,  # truncated member
    NotImplementedError,  # a compression method byte flipped to one zipfile lacks
    RuntimeError,  # an encryption flag bit flipped on ("password required")
    OSError,  # a damaged stream of another codec, or the disk failing mid-read
    KeyError,  # meta.json or an array it names is missing
    TypeError,  # meta.json of the wrong shape (a list where a mapping belongs), an unknown dtype
    AttributeError,  # meta.json that is not a JSON object
)
"""What a damaged or foreign shard makes zipfile, zlib, json and numpy raise besides ValueError
(bad JSON or UTF-8, arrays that do not fit their shape)."""
_SHUFFLE4 = "shuffle4+deflate"
_PLAIN = "deflate"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


_FILE_MODE = 0o666 & ~_umask()


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename (or creation, or removal) inside directory ``path`` durable: without it a
    power cut can undo a rename the program already relied on."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        # Some filesystems (and platforms) cannot fsync a directory; the rename stands anyway.
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> tuple[str, int]:
    """(sha256 hex digest, size in bytes) of a file, read in chunks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
            size += len(block)
    return digest.hexdigest(), size


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one, never a part."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        # mkstemp creates 0600; give the file the mode a plain open() would.
        os.fchmod(fd, _FILE_MODE)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """UTF-8 text version of :func:`atomic_write_bytes`."""
    atomic_write_bytes(path, text.encode("utf-8"))


class _Default:
    """A parameter left out (None means something else there)."""


_DEFAULT: Any = _Default()
_RAISE: Any = _Default()


def read_record(
    path: str | os.PathLike,
    model: "type[_Record]",
    *,
    what: str,
    missing: Any = _RAISE,
    missing_hint: str = "",
    unreadable: Callable[[BaseException], str] | None = _DEFAULT,
    invalid: Callable[[ValueError], str] = _DEFAULT,
    check: Callable[[Any], None] | None = None,
    loads: bool = False,
    error: Callable[[str], BaseException] | None = None,
) -> "_Record":
    """The JSON record in file ``path``, validated as ``model`` (a pydantic model class).

    Every failure is ``error`` (by default :class:`~regress.errors.StorageError`) with the
    message ``"<path>: <what the builder says>"``, the original exception chained:

    - no file: ``missing`` is returned when given (None, or a default record); without it,
      ``"no such file"`` + ``missing_hint`` is raised;
    - a file that cannot be read (OSError, not UTF-8; with ``loads``, not JSON either):
      ``unreadable(exc)``, by default ``"cannot read <what> (<exc>)"``; ``None`` lets the
      exception through unchanged;
    - a record the model refuses (without ``loads``, a file that is not JSON too):
      ``invalid(exc)``, by default ``"not <what>: <pydantic's first message>"``.

    ``loads`` parses with :func:`json.loads` and validates the data, rather than with the
    model's own JSON parser; ``check`` (implies ``loads``) sees the data first and raises
    its own error (a format version this regress does not read).
    """
    if error is None:
        from regress.errors import StorageError as error
    path = Path(path)
    if unreadable is _DEFAULT:
        unreadable = lambda exc: f"cannot read {what} ({exc})"  # noqa: E731
    if invalid is _DEFAULT:
        invalid = lambda exc: f"not {what}: {_first_message(exc)}"  # noqa: E731
    loads = loads or check is not None
    try:
        text = path.read_text(encoding="utf-8")
        data = json.loads(text) if loads else None
    except FileNotFoundError as exc:
        if missing is _RAISE:
            raise error(f"{path}: no such file{missing_hint}") from exc
        return missing
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8, or (with loads) not JSON
        if unreadable is None:
            raise
        raise error(f"{path}: {unreadable(exc)}") from exc
    if check is not None:
        check(data)
    try:
        return model.model_validate(data) if loads else model.model_validate_json(text)
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        raise error(f"{path}: {invalid(exc)}") from exc


def _first_message(exc: ValueError) -> str:
    """The first problem pydantic names in ``exc`` (the whole message of another ValueError)."""
    errors = getattr(exc, "errors", None)
    return errors()[0]["msg"] if callable(errors) else str(exc)


def partial_path(dest: str | os.PathLike) -> Path:
    """``<dest>.partial``: where ``dest`` is built until it is complete (beside it, so that
    the final rename stays on one filesystem)."""
    dest = Path(dest)
    return dest.with_name(dest.name + ".partial")


@contextmanager
def building(dest: str | os.PathLike, *, unique: bool = False, merge: bool = False) -> Iterator[Path]:
    """Build the directory ``dest`` aside; it appears whole, or not at all.

    Yields the build directory, created and empty: :func:`partial_path` (a stale one, left by
    an interrupted build, removed first) or, with ``unique``, a fresh hidden
    ``.<dest>.building-XXXX`` beside ``dest`` (two builds of one ``dest`` at once do not
    share it). When the block ends normally it is renamed to ``dest``, an existing ``dest``
    removed first; with ``merge``, its files are moved into ``dest`` one by one instead (files
    of the same names replaced, other files of ``dest`` left alone). When the block raises
    (Ctrl-C too), the build directory is removed and ``dest`` is left as it was.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    if unique:
        work = Path(tempfile.mkdtemp(prefix=f".{dest.name}.building-", dir=dest.parent))
    else:
        work = partial_path(dest)
        if work.exists():
            shutil.rmtree(work)
        work.mkdir()
    try:
        yield work
        if merge:
            for path in sorted(p for p in work.rglob("*") if p.is_file()):
                target = dest / path.relative_to(work)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, target)
        else:
            if dest.exists():
                shutil.rmtree(dest)
            work.rename(dest)
            fsync_dir(dest.parent)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _shuffle4(raw: bytes) -> bytes:
    return np.frombuffer(raw, dtype=np.uint8).reshape(-1, 4).T.tobytes()


def _unshuffle4(raw: bytes) -> bytes:
    return np.frombuffer(raw, dtype=np.uint8).reshape(4, -1).T.tobytes()


def _xor_reference(name: str, arrays: dict[str, np.ndarray]) -> str | None:
    """``<p>token_logprobs`` is stored XOR the top-1 column of ``<p>top_logprobs``: under greedy
    decoding (and wherever the chosen token is the top-1) the two are equal and the XOR is zero."""
    if not name.endswith("token_logprobs"):
        return None
    ref = name[: -len("token_logprobs")] + "top_logprobs"
    array, other = arrays[name], arrays.get(ref)
    if other is None or other.ndim != 2 or other.shape[0] != array.shape[0] or other.shape[1] == 0:
        return None
    if array.dtype != np.float32 or other.dtype != np.float32:
        return None
    return ref


def encode_shard(meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> bytes:
    """Serialize a shard: JSON metadata plus named numpy arrays."""
    buffer = io.BytesIO()
    index: dict[str, dict[str, Any]] = {}
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=6) as zf:
        for name, array in arrays.items():
            array = np.ascontiguousarray(array)
            spec: dict[str, Any] = {"dtype": array.dtype.str, "shape": list(array.shape)}
            ref = _xor_reference(name, arrays)
            if ref is not None:
                array = array.view(np.uint32) ^ np.ascontiguousarray(arrays[ref][:, 0]).view(np.uint32)
                spec["xor_column0_of"] = ref
            raw = array.tobytes()
            spec["codec"] = _SHUFFLE4 if array.dtype.itemsize == 4 and array.size else _PLAIN
            if spec["codec"] == _SHUFFLE4:
                raw = _shuffle4(raw)
            zf.writestr(name, raw)
            index[name] = spec
        full_meta = {"shard_format_version": SHARD_FORMAT_VERSION, **meta, "arrays": index}
        zf.writestr(_META, json.dumps(full_meta, ensure_ascii=False))
    return buffer.getvalue()


def decode_shard(data: bytes) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Inverse of :func:`encode_shard`. Raises ``ValueError`` on anything malformed (this module
    runs in candidate environments too, so it does not raise regress's own errors: its callers
    on regress's side name the file in a :class:`~regress.errors.StorageError`)."""
    try:
        zf = zipfile.ZipFile(io.BytesIO(data))
    except (*_CORRUPT, ValueError) as exc:
        raise _damaged(exc) from exc
    with zf:
        try:
            meta = json.loads(zf.read(_META).decode("utf-8"))
            version = meta.get("shard_format_version")
        except (*_CORRUPT, ValueError) as exc:  # ValueError: not JSON
            raise _damaged(exc) from exc
        if version != SHARD_FORMAT_VERSION:  # not damage: a shard from another regress
            raise ValueError(f"shard format version {version!r}; this regress reads {SHARD_FORMAT_VERSION}")
        try:
            return meta, _decode_arrays(zf, meta)
        except (*_CORRUPT, ValueError) as exc:  # ValueError: arrays that do not fit their shape
            raise _damaged(exc) from exc


def _decode_arrays(zf: zipfile.ZipFile, meta: dict[str, Any]) -> dict[str, np.ndarray]:
    arrays: dict[str, np.ndarray] = {}
    xored: dict[str, str] = {}
    for name, spec in meta["arrays"].items():
        raw = zf.read(name)
        if spec["codec"] == _SHUFFLE4:
            raw = _unshuffle4(raw)
        if "xor_column0_of" in spec:
            xored[name] = spec["xor_column0_of"]
            arrays[name] = np.frombuffer(raw, dtype=np.uint32).reshape(spec["shape"])
        else:
            arrays[name] = np.frombuffer(raw, dtype=np.dtype(spec["dtype"])).reshape(spec["shape"])
    for name, ref in xored.items():
        column = np.ascontiguousarray(arrays[ref][:, 0]).view(np.uint32)
        arrays[name] = (arrays[name] ^ column).view(np.float32)
    return arrays


def _damaged(exc: BaseException) -> ValueError:
    kind = type(exc)
    name = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"
    return ValueError(f"not a regress shard file, or a damaged one ({name}: {exc})")


def write_shard(path: str | os.PathLike, meta: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    """Encode and write a shard atomically."""
    atomic_write_bytes(path, encode_shard(meta, arrays))


def read_shard(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read a shard written by :func:`write_shard`."""
    return decode_shard(Path(path).read_bytes())


def ragged(sequences: list[Any], dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    """Flatten a list of 1-D sequences into (values, offsets) with ``offsets[i]:offsets[i+1]`` per item."""
    lengths = np.fromiter((len(s) for s in sequences), dtype=np.int64, count=len(sequences))
    offsets = np.zeros(len(sequences) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    if len(sequences) and offsets[-1]:
        values = np.concatenate([np.asarray(s, dtype=dtype).reshape(-1) for s in sequences])
    else:
        values = np.zeros(0, dtype=dtype)
    return values, offsets


def read_shard_meta(path: str | os.PathLike) -> dict[str, Any]:
    """Only the metadata of a shard file (cheap: the arrays are not decompressed)."""
    with open(path, "rb") as fh:  # a file that cannot be opened is an OSError, not damage
        try:
            with zipfile.ZipFile(fh) as zf:
                meta = json.loads(zf.read(_META).decode("utf-8"))
        except (*_CORRUPT, ValueError) as exc:
            raise _damaged(exc) from exc
    if not isinstance(meta, dict):
        raise ValueError("not a regress shard file: its meta.json is not an object")
    if meta.get("shard_format_version") != SHARD_FORMAT_VERSION:
        raise ValueError(f"shard format version {meta.get('shard_format_version')!r}")
    return meta
