"""Token sources, on-disk token caches, and batches that are a pure function of (seed, step).

Why it is shaped this way:

* **Resumable for free.** ``DataPipeline.train_batch(step, seed=...)`` holds no iterator state: every
  row draws its source and window from a counter-based hash of (seed, step, global row). Resuming a
  run needs only the step, a process sees the same global batch as any other process (it just keeps
  its contiguous slice), and two fresh pipelines agree bit for bit.
* **Tokenize once.** Each source is tokenized a single time into a cache directory holding
  ``train.npy`` and ``validation.npy`` (read back as memory maps) and ``meta.json``. The directory name
  carries a hash of everything that changes the tokens: the source config, the tokenizer's content
  hash, the token cap, and the size/mtime of every input file. A cache is built in a temporary
  directory and renamed into place, so a killed build never leaves a half-written cache; a cache whose
  meta, shapes or checksum do not match is rebuilt with a warning.
* **Held-out split by document.** Whole documents, picked by a fixed permutation, are set aside until
  they hold ``validation_fraction`` of the source's tokens (never overshooting by more than half of that).
  When documents are too large for that (one big text file), the last ``validation_fraction`` of the
  token stream is held out instead. Train and validation are separate arrays, so a training window
  can never reach into held-out text.
* **An offline default corpus.** ``kind="stdlib_code"`` is the ``.py`` source of this Python's standard
  library; ``kind="stdlib_docs"`` is the documentation that ships with it (``pydoc_data.topics``, the
  text behind ``help('topic')``, plus every module, class and function docstring). Real text nobody
  here wrote, present wherever Python is. Each is read up to ``STDLIB_MAX_BYTES``.

Documents are joined with the tokenizer's end-of-document id (byte 0 for the byte tokenizer; nothing
if a tokenizer.json defines no such token) so a window that spans two documents sees where one ends.
Builds hold one source in memory while tokenizing, which suits corpora up to a few GB.
"""

from __future__ import annotations

import ast
import hashlib
import json
import logging
import math
import os
import re
import shutil
import sys
import sysconfig
import time
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import fsspec
import numpy as np
from filelock import FileLock

from trainer.config import DataConfig, MixturePhase, SourceConfig
from trainer.tokenizer import Tokenizer, check_vocab, load_tokenizer

logger = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 1
STDLIB_MAX_BYTES = 32 * 2**20  # the whole CPython 3.11 stdlib minus tests is ~11 MB, so this rarely bites
STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})
VERIFY_CHECKSUM_MAX_BYTES = 2**30  # larger caches are checked by size only, so opening them stays instant
_SPLIT_SEED = 0x5EED_0DA7A  # fixes the document permutation of the validation split
_ENCODE_BATCH_CHARS = 4 * 2**20
_GLOB_CHARS = re.compile(r"[*?\[]")


def default_cache_dir() -> str:
    """$LADDER_CACHE_DIR, else ~/.cache/ladder/tokens."""
    return os.environ.get("LADDER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ladder", "tokens")


# --------------------------------------------------------------------------------------------
# Reading documents


@dataclass(frozen=True)
class _InputFile:
    fs: fsspec.AbstractFileSystem
    path: str
    fingerprint: str  # size and modification stamp: a changed file gets a new cache


def _fingerprint(info: dict) -> str:
    stamp_keys = ("mtime", "LastModified", "updated", "ETag", "etag", "md5", "created")
    stamp = next((info[k] for k in stamp_keys if k in info), "")
    return f"{info.get('size')}:{stamp}"


def _expand_paths(source: SourceConfig, index: int) -> list[_InputFile]:
    where = f"data.sources[{index}]"
    if source.kind in ("stdlib_code", "stdlib_docs"):
        if source.paths:
            raise ValueError(
                f"{where}.paths must be empty for kind={source.kind!r} (the corpus is this Python's standard library); "
                "use kind='text' with a glob to read other files."
            )
        return []
    if not source.paths:
        raise ValueError(f"{where} ({source.name!r}) has no paths; list files, folders or globs in {where}.paths.")
    files: list[_InputFile] = []
    for j, pattern in enumerate(source.paths):
        fs, path = fsspec.core.url_to_fs(pattern)
        if _GLOB_CHARS.search(path):
            infos = fs.glob(path, detail=True)
        elif fs.isdir(path):
            infos = fs.find(path, detail=True)
        elif fs.exists(path):
            infos = {path: fs.info(path)}
        else:
            infos = {}
        matches = sorted((p, info) for p, info in infos.items() if info.get("type", "file") == "file")
        if not matches:
            raise FileNotFoundError(
                f"{where}.paths[{j}]={pattern!r} matches no files; fix the path or glob "
                "(any fsspec URL works, e.g. /data/*.jsonl or s3://bucket/shard-*.parquet)."
            )
        files += [_InputFile(fs, p, _fingerprint(info)) for p, info in matches]
    return files


def _open_text(file: _InputFile):
    url = file.fs.unstrip_protocol(file.path)
    return fsspec.open(url, "rt", encoding="utf-8", errors="replace", compression="infer")


def _text_documents(files: list[_InputFile]) -> Iterator[str]:
    for file in files:
        with _open_text(file) as f:
            yield f.read()


def _jsonl_documents(files: list[_InputFile], source: SourceConfig, index: int) -> Iterator[str]:
    for file in files:
        with _open_text(file) as f:
            for line_number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(
                        f"data.sources[{index}] ({source.name!r}): line {line_number} of {file.path} is not valid JSON "
                        f"({e.msg}); fix the file or use kind='text' if it is not JSON Lines."
                    ) from e
                if not isinstance(record, dict) or source.text_field not in record:
                    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
                    raise ValueError(
                        f"data.sources[{index}] ({source.name!r}): line {line_number} of {file.path} has no key "
                        f"{source.text_field!r} (it has {keys}); "
                        f"set data.sources[{index}].text_field to the key holding the text."
                    )
                text = record[source.text_field]
                if text:
                    yield str(text)


def _parquet_documents(files: list[_InputFile], source: SourceConfig, index: int) -> Iterator[str]:
    import pyarrow.parquet as pq

    for file in files:
        with file.fs.open(file.path, "rb") as f:
            parquet = pq.ParquetFile(f)
            columns = parquet.schema_arrow.names
            if source.text_field not in columns:
                raise ValueError(
                    f"data.sources[{index}] ({source.name!r}): parquet file {file.path} has no column "
                    f"{source.text_field!r} (columns: {columns}); "
                    f"set data.sources[{index}].text_field to the text column."
                )
            for batch in parquet.iter_batches(batch_size=4096, columns=[source.text_field]):
                for text in batch.column(0).to_pylist():
                    if text:
                        yield str(text)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_code_files() -> list[Path]:
    """The standard library's .py files, sorted by relative path; tests, site-packages and pydoc_data excluded."""
    root = stdlib_root()
    found = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in STDLIB_SKIP_DIRS and d != "pydoc_data")
        found += [Path(directory) / n for n in names if n.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def _read_source_file(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def _stdlib_code_documents() -> Iterator[str]:
    yield from (_read_source_file(p) for p in stdlib_code_files())


def _docstrings_document(path: Path, root: Path) -> str:
    """Every docstring of one module, each under its dotted name: reads like a reference page."""
    module = path.relative_to(root).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__")
    try:
        tree = ast.parse(_read_source_file(path))
    except (SyntaxError, ValueError):
        return ""
    parts: list[str] = []

    def visit(node: ast.AST, qualname: str) -> None:
        doc = ast.get_docstring(node, clean=True)  # type: ignore[arg-type]
        if doc:
            parts.append(f"{qualname}\n{doc}\n")
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, f"{qualname}.{child.name}")

    visit(tree, module)
    return "\n".join(parts)


def _stdlib_docs_documents() -> Iterator[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions strip pydoc_data; the docstrings remain
        topics = {}
    for name in sorted(topics):
        yield f"{name}\n{topics[name]}"
    root = stdlib_root()
    for path in stdlib_code_files():
        text = _docstrings_document(path, root)
        if text:
            yield text


def _documents(source: SourceConfig, files: list[_InputFile], index: int) -> Iterator[str]:
    if source.kind == "text":
        return _text_documents(files)
    if source.kind == "jsonl":
        return _jsonl_documents(files, source, index)
    if source.kind == "parquet":
        return _parquet_documents(files, source, index)
    documents = _stdlib_code_documents() if source.kind == "stdlib_code" else _stdlib_docs_documents()
    return _byte_capped(documents, STDLIB_MAX_BYTES)


def _byte_capped(documents: Iterator[str], max_chars: int) -> Iterator[str]:
    seen = 0
    for doc in documents:
        if seen >= max_chars:
            return
        yield doc[: max_chars - seen]
        seen += len(doc)


def _content_fingerprint(source: SourceConfig, files: list[_InputFile]) -> list[str]:
    if source.kind in ("stdlib_code", "stdlib_docs"):
        root = stdlib_root()
        stats = []
        for path in stdlib_code_files():
            stat = path.stat()
            stats.append(f"{path.relative_to(root).as_posix()}:{stat.st_size}:{stat.st_mtime_ns}")
        return [sys.version, str(root), str(STDLIB_MAX_BYTES), hashlib.sha256("\n".join(stats).encode()).hexdigest()]
    return [f"{f.fs.unstrip_protocol(f.path)}|{f.fingerprint}" for f in files]


# --------------------------------------------------------------------------------------------
# Validation split


def choose_validation_documents(lengths: np.ndarray, fraction: float) -> np.ndarray | None:
    """Boolean mask of held-out documents, or None when documents are too coarse for a document split."""
    total = int(lengths.sum())
    target = math.ceil(fraction * total)
    if len(lengths) < 2 or target == 0:
        return None
    mask = np.zeros(len(lengths), dtype=bool)
    taken = 0
    for i in np.random.default_rng(_SPLIT_SEED).permutation(len(lengths)):
        if taken >= target:
            break
        if taken + lengths[i] <= 1.5 * target:
            mask[i] = True
            taken += int(lengths[i])
    if taken < 0.5 * target or mask.all():
        return None
    return mask


def _split(docs: list[np.ndarray], fraction: float, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, dict]:
    lengths = np.array([len(d) for d in docs], dtype=np.int64)
    empty = np.zeros(0, dtype=dtype)
    mask = choose_validation_documents(lengths, fraction)
    if mask is not None:
        train = np.concatenate([d for d, v in zip(docs, mask) if not v] or [empty])
        validation = np.concatenate([d for d, v in zip(docs, mask) if v] or [empty])
        return train, validation, {"split": "documents", "validation_documents": int(mask.sum())}
    stream = np.concatenate(docs or [empty])
    cut = len(stream) - math.ceil(fraction * len(stream))
    return stream[:cut], stream[cut:], {"split": "tail", "validation_documents": 0}


# --------------------------------------------------------------------------------------------
# Token cache


@dataclass(frozen=True)
class SourceTokens:
    """One source's tokens: train and validation arrays (memory-mapped from the cache)."""

    name: str
    train: np.ndarray
    validation: np.ndarray
    cache_path: str
    status: str  # "hit" (reused), "built" (first time) or "rebuilt" (an unusable cache was replaced)
    meta: dict


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


def cache_key(source: SourceConfig, tokenizer: Tokenizer, max_tokens: int | None, content: list[str]) -> str:
    """Hash of everything that changes a source's tokens (its display name excluded)."""
    payload = {
        "format": CACHE_FORMAT_VERSION,
        "source": source.model_dump(mode="json", exclude={"name"}),
        "tokenizer": tokenizer.identity,
        "max_tokens": max_tokens,
        "content": content,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]


def _digest(*arrays: np.ndarray) -> str:
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        h.update(np.ascontiguousarray(a).view(np.uint8))
    return h.hexdigest()


def _load_cache(directory: str, key: str) -> tuple[np.ndarray, np.ndarray, dict] | None:
    """The cached arrays if the cache is complete and intact; None if absent; raises ValueError if damaged."""
    if not os.path.exists(directory):
        return None
    try:
        with open(os.path.join(directory, "meta.json")) as f:
            meta = json.load(f)
        if meta.get("key") != key or meta.get("format") != CACHE_FORMAT_VERSION:
            raise ValueError("meta.json belongs to another cache")
        arrays = []
        for split in ("train", "validation"):
            a = np.load(os.path.join(directory, f"{split}.npy"), mmap_mode="r")
            if a.shape != (meta[f"{split}_tokens"],) or str(a.dtype) != meta["dtype"]:
                raise ValueError(f"{split}.npy has shape {a.shape} dtype {a.dtype}, meta says otherwise")
            arrays.append(a)
        if sum(a.nbytes for a in arrays) <= VERIFY_CHECKSUM_MAX_BYTES and _digest(*arrays) != meta["digest"]:
            raise ValueError("checksum mismatch")
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
        raise ValueError(f"token cache {directory} is unusable ({e})") from e
    return arrays[0], arrays[1], meta


def _write_cache(directory: str, train: np.ndarray, validation: np.ndarray, meta: dict) -> None:
    """Write into a sibling temporary directory, fsync, then rename: readers see all of it or nothing."""
    tmp = f"{directory}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.makedirs(tmp)
    try:
        for name, array in (("train.npy", train), ("validation.npy", validation)):
            with open(os.path.join(tmp, name), "wb") as f:
                np.save(f, array)
                f.flush()
                os.fsync(f.fileno())
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1, sort_keys=True)
            f.flush()
            os.fsync(f.fileno())
        if os.path.exists(directory):
            shutil.rmtree(directory)
        os.rename(tmp, directory)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _tokenize_documents(
    documents: Iterator[str], tokenizer: Tokenizer, max_tokens: int | None, dtype: np.dtype
) -> list[np.ndarray]:
    """Encode in batches (the HF tokenizer parallelises a batch), append EOS, stop at the cap."""
    out: list[np.ndarray] = []
    count = 0
    pending: list[str] = []
    pending_chars = 0

    def flush() -> bool:
        nonlocal count, pending_chars
        for ids in tokenizer.encode_batch(pending):
            if tokenizer.eos_id is not None:
                ids = np.append(ids, tokenizer.eos_id)
            if max_tokens is not None and count + len(ids) >= max_tokens:
                out.append(ids[: max_tokens - count].astype(dtype))
                count = max_tokens
                return True
            out.append(ids.astype(dtype))
            count += len(ids)
        pending.clear()
        pending_chars = 0
        return False

    for doc in documents:
        pending.append(doc)
        pending_chars += len(doc)
        # a cap needs roughly as many characters as tokens; never read far past it
        if pending_chars >= _ENCODE_BATCH_CHARS or (max_tokens is not None and count + pending_chars >= max_tokens):
            if flush():
                return out
    if pending:
        flush()
    return out


def tokenize_source(
    source: SourceConfig,
    tokenizer: Tokenizer,
    *,
    index: int = 0,
    max_tokens: int | None = None,
    cache_dir: str | None = None,
) -> SourceTokens:
    """Tokens of one source, from the cache when it is intact, else tokenized now and cached."""
    files = _expand_paths(source, index)
    key = cache_key(source, tokenizer, max_tokens, _content_fingerprint(source, files))
    cache_dir = cache_dir or default_cache_dir()
    os.makedirs(cache_dir, exist_ok=True)
    safe_name = re.sub(r"[^A-Za-z0-9_.-]", "_", source.name)[:40]
    directory = os.path.join(cache_dir, f"{safe_name}-{key}")
    with FileLock(directory + ".lock"):
        # holding this key's lock, any temporary sibling is debris of a killed build
        for debris in Path(cache_dir).glob(f"{safe_name}-{key}.tmp-*"):
            shutil.rmtree(debris, ignore_errors=True)
        status = "built"
        try:
            cached = _load_cache(directory, key)
        except ValueError as e:
            warnings.warn(f"{e}; rebuilding it.", stacklevel=2)
            cached, status = None, "rebuilt"
        if cached is not None:
            train, validation, meta = cached
            return SourceTokens(source.name, train, validation, directory, "hit", meta)
        start = time.perf_counter()
        dtype = token_dtype(tokenizer.vocab_size)
        docs = _tokenize_documents(_documents(source, files, index), tokenizer, max_tokens, dtype)
        train, validation, split_info = _split(docs, source.validation_fraction, dtype)
        meta = {
            "format": CACHE_FORMAT_VERSION,
            "key": key,
            "source": source.model_dump(mode="json"),
            "tokenizer": tokenizer.identity,
            "max_tokens": max_tokens,
            "dtype": str(dtype),
            "documents": len(docs),
            "train_tokens": int(len(train)),
            "validation_tokens": int(len(validation)),
            "digest": _digest(train, validation),
            "build_seconds": round(time.perf_counter() - start, 3),
            **split_info,
        }
        _write_cache(directory, train, validation, meta)
        logger.info("tokenized source %r: %d documents, %d tokens in %.1fs -> %s",
                    source.name, len(docs), len(train) + len(validation), meta["build_seconds"], directory)
        train, validation, meta = _load_cache(directory, key)  # serve the memory-mapped copy
        return SourceTokens(source.name, train, validation, directory, status, meta)


# --------------------------------------------------------------------------------------------
# Batches


_U64 = np.uint64


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser on uint64 arrays (wrapping arithmetic): a strong, stateless integer hash."""
    x = x + _U64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def row_hashes(seed: int, step: int, rows: np.ndarray, stream: int) -> np.ndarray:
    """Independent uint64 per (seed, step, row, stream): the counter-based RNG behind every batch."""
    mask = (1 << 64) - 1
    h = _splitmix64(np.full(rows.shape, seed & mask, dtype=_U64))
    h = _splitmix64(h ^ _U64(step & mask))
    h = _splitmix64(h ^ rows.astype(_U64))
    return _splitmix64(h ^ _U64(stream))


def _uniform(h: np.ndarray) -> np.ndarray:
    return (h >> _U64(11)).astype(np.float64) * (1.0 / 2**53)


class DataPipeline:
    """Tokenized sources plus the mixture schedule; batches are computed, never iterated."""

    def __init__(
        self, data: DataConfig, tokenizer: Tokenizer, sources: list[SourceTokens], *, seq_len: int, num_steps: int
    ):
        self.data = data
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.num_steps = num_steps
        self._sources = sources
        self._by_name = {s.name: s for s in sources}
        self._phase_starts = np.array([p.start_fraction for p in data.phases])
        weights = np.array([[p.weights.get(s.name, 0.0) for s in sources] for p in data.phases], dtype=np.float64)
        cumulative = np.cumsum(weights / weights.sum(axis=1, keepdims=True), axis=1)
        cumulative[:, -1] = 1.0
        self._cumulative_weights = cumulative
        self._window = np.arange(seq_len + 1, dtype=np.int64)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.vocab_size

    @property
    def source_names(self) -> list[str]:
        return [s.name for s in self._sources]

    @property
    def cache_status(self) -> dict[str, str]:
        """Per source: "hit" (cache reused), "built" or "rebuilt"."""
        return {s.name: s.status for s in self._sources}

    @property
    def cache_paths(self) -> dict[str, str]:
        return {s.name: s.cache_path for s in self._sources}

    def check_vocab(self, model_vocab_size: int) -> None:
        """Raise if the model's vocabulary cannot hold every token id of this pipeline's tokenizer."""
        check_vocab(self.vocab_size, model_vocab_size)

    def source_token_counts(self) -> dict[str, dict[str, int]]:
        return {s.name: {"train": int(len(s.train)), "validation": int(len(s.validation))} for s in self._sources}

    def phase_index(self, step: int) -> int:
        """Index of the mixture phase in force at `step` (phase = f(step / num_steps))."""
        return int(np.searchsorted(self._phase_starts, step / self.num_steps, side="right") - 1)

    def phase_weights(self, step: int) -> dict[str, float]:
        phase = self.data.phases[self.phase_index(step)]
        return {name: phase.weights.get(name, 0.0) for name in self.source_names}

    def train_batch(
        self, step: int, *, batch_size: int, seed: int, process_index: int = 0, process_count: int = 1
    ) -> np.ndarray:
        """int32 [batch_size // process_count, seq_len + 1]: this process's contiguous slice of global batch `step`."""
        if step < 0:
            raise ValueError(f"step={step} is negative; steps count from 0.")
        rows = _process_rows(batch_size, process_index, process_count)
        choice = self._choose_sources(step, seed, rows)
        offsets_h = row_hashes(seed, step, rows, 1)
        out = np.empty((len(rows), self.seq_len + 1), dtype=np.int32)
        for s in np.unique(choice):
            picked = choice == s
            tokens = self._sources[s].train
            starts = offsets_h[picked] % _U64(len(tokens) - self.seq_len)
            out[picked] = tokens[starts.astype(np.int64)[:, None] + self._window]
        return out

    def row_sources(
        self, step: int, *, batch_size: int, seed: int, process_index: int = 0, process_count: int = 1
    ) -> np.ndarray:
        """Index into `source_names` of the source each row of `train_batch(step, ...)` is drawn from."""
        return self._choose_sources(step, seed, _process_rows(batch_size, process_index, process_count))

    def _choose_sources(self, step: int, seed: int, rows: np.ndarray) -> np.ndarray:
        cumulative = self._cumulative_weights[self.phase_index(step)]
        choice = np.searchsorted(cumulative, _uniform(row_hashes(seed, step, rows, 0)), side="right")
        return np.minimum(choice, len(self._sources) - 1)

    def eval_batches(
        self, source: str, *, batch_size: int, num_batches: int, process_index: int = 0, process_count: int = 1,
        windows: str = "spread",
    ) -> list[np.ndarray]:
        """`num_batches` batches of windows (stride seq_len) spread evenly over the whole held-out split: window i of
        the n asked for starts at window floor(i * W / n) of the split's W; every window in turn, wrapping, when n > W.
        `windows="first"`: the first n windows in a row, wrapping (`TrainConfig.eval_windows`).

        Why spread and not the first n windows: neighbouring windows come from one file, so the first few batches
        measure one stretch of text. On the stdlib corpus the first 32 windows are easy text that a larger model
        learns better: over them the local ladder's final checkpoints scored 7.6% (r24) to 12.0% (hero) below their
        loss over the whole split, a bias that grows with size and bends a ladder's law; 32 windows spread over the
        split came within +1.3% to +2.1% of it at every size (`bench/bench_eval_windows.py`, BENCHMARKS.md).
        """
        chosen = eval_window_indices(self.held_out_windows(source), num_batches * batch_size, windows)
        tokens = self._by_name[source].validation
        rows = _process_rows(batch_size, process_index, process_count)
        return [np.asarray(tokens[chosen[b * batch_size + rows, None] * self.seq_len + self._window], dtype=np.int32)
                for b in range(num_batches)]

    def held_out_windows(self, source: str) -> int:
        """How many windows (stride seq_len) the source's held-out split holds."""
        if source not in self._by_name:
            raise KeyError(f"unknown source {source!r}; known sources: {self.source_names}.")
        return (len(self._by_name[source].validation) - 1) // self.seq_len

    def decode(self, ids: np.ndarray) -> str:
        return self.tokenizer.decode(ids)

    def __repr__(self) -> str:
        counts = ", ".join(f"{n}={c['train']}+{c['validation']}" for n, c in self.source_token_counts().items())
        return f"DataPipeline(vocab_size={self.vocab_size}, seq_len={self.seq_len}, tokens train+val: {counts})"


def eval_window_indices(held_out: int, asked: int, windows: str = "spread") -> np.ndarray:
    """Which of a held-out split's `held_out` windows each of `asked` eval rows reads, in order
    (`DataPipeline.eval_batches`): "spread", row i reads window floor(i * held_out / asked); "first", window i; both
    wrap over every window when more rows are asked than the split holds."""
    if windows not in ("spread", "first"):
        raise ValueError(f"windows={windows!r}: choose 'spread' or 'first'.")
    index = np.arange(asked, dtype=np.int64)
    return index * held_out // asked if windows == "spread" and asked <= held_out else index % held_out


def _process_rows(batch_size: int, process_index: int, process_count: int) -> np.ndarray:
    if batch_size % process_count:
        raise ValueError(
            f"batch_size={batch_size} is not divisible by process_count={process_count}; "
            "choose a global batch size that is a multiple of the process count."
        )
    if not 0 <= process_index < process_count:
        raise ValueError(f"process_index={process_index} is outside [0, process_count={process_count}).")
    local = batch_size // process_count
    return np.arange(process_index * local, (process_index + 1) * local, dtype=np.int64)


def stdlib_data_config(
    code_weight: float = 0.8, *, max_tokens_per_source: int | None = None, tokenizer: str | None = None
) -> DataConfig:
    """The default offline corpus: sources "code" (stdlib_code) and "docs" (stdlib_docs) in one phase."""
    return DataConfig(
        sources=[SourceConfig(name="code", kind="stdlib_code"), SourceConfig(name="docs", kind="stdlib_docs")],
        phases=[MixturePhase(weights={"code": code_weight, "docs": 1.0 - code_weight})],
        max_tokens_per_source=max_tokens_per_source,
        tokenizer=tokenizer,
    )


def build_data(
    data: DataConfig,
    *,
    seq_len: int,
    num_steps: int,
    cache_dir: str | None = None,
    model_vocab_size: int | None = None,
) -> DataPipeline:
    """Load the tokenizer, tokenize (or reuse) every source, check sizes, and return the pipeline."""
    if num_steps < 1:
        raise ValueError(f"num_steps={num_steps} must be at least 1.")
    tokenizer = load_tokenizer(data.tokenizer)
    if model_vocab_size is not None:
        tokenizer.check_vocab(model_vocab_size)
    sources = [
        tokenize_source(s, tokenizer, index=i, max_tokens=data.max_tokens_per_source, cache_dir=cache_dir)
        for i, s in enumerate(data.sources)
    ]
    need = seq_len + 1
    for i, (config, tokens) in enumerate(zip(data.sources, sources)):
        for split, array in (("train", tokens.train), ("validation", tokens.validation)):
            if len(array) < need:
                raise ValueError(
                    f"data.sources[{i}] ({config.name!r}) has {len(array)} {split} tokens, fewer than one sequence of "
                    f"seq_len + 1 = {need}; add text, raise data.max_tokens_per_source or "
                    f"{'raise' if split == 'validation' else 'lower'} data.sources[{i}].validation_fraction, "
                    "or lower seq_len."
                )
    return DataPipeline(data, tokenizer, sources, seq_len=seq_len, num_steps=num_steps)
