"""One data preparation per job, cached.

Rank 0 tokenizes (or reads the cache) while the other ranks wait; they then read what it wrote, memory-mapped (rank
0 too: the rows live in the page cache, not in each rank's heap). Rows that are not cached go to a scratch
directory that is removed once every rank has mapped them. A node that cannot read rank 0's files has its first
rank prepare them again for its ranks. The cache is keyed by the data files (path, size, modification time), the
tokenizer and its chat template, every data setting of the config, the split and the row count asked for, and the
source of the data code, so a relaunch or resume of the same job reads its rows in seconds and any change tokenizes
again. Only local files are cached (the synthetic sources are generated; an HF dataset name has no file identity to
key by). An entry holds nothing executable: its metadata is JSON and its arrays .npy files read without pickle, since
data_cache_dir may be a directory other users or nodes write; an entry that does not parse is built again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

import numpy as np

from ..config import TrainConfig, config_to_dict
from ..data.accounting import DataCounts
from ..data.documents import build_sequences
from ..data.sequences import SequenceDataset
from ..errors import ConfigError
from ..parallel.comm import gather_objects, world_rank
from ..user_cache import user_cache_dir

log = logging.getLogger(__name__)

_ARRAYS = ("tokens", "positions", "trained", "lengths")
_FORMAT = 3  # bump when the stored layout changes (3: JSON metadata, no pickle)
_META = "meta.json"
# config fields whose names hold one of these words shape the rows (read generically, so new data
# settings join the key without an edit here)
_DATA_WORDS = ("dataset", "packing", "pad_", "max_length", "max_seq_length", "loss", "text_file", "eval_samples",
               "template", "eos_token", "seed", "special_text")


def cache_root(cfg: TrainConfig) -> Path | None:
    """Where prepared rows are kept: data_cache_dir, else ~/.cache/ulysses_trainer/data (None: data_cache
    false, or no home directory)."""
    given = cfg.data_cache_dir
    if not cfg.data_cache:
        return None
    if given is not None:
        return Path(given)
    return user_cache_dir("data")


def _files_of(source: str) -> list[Path]:
    path = Path(source)
    return [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())


def _source_identity(cfg: TrainConfig, split: str) -> str | None:
    """The local data this split reads, None when it is not local files (nothing is cached then)."""
    source = cfg.dataset_name if split == "train" else (cfg.eval_dataset_name or cfg.dataset_name)
    if source is None or not Path(source).exists():
        return None
    return json.dumps([[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in _files_of(source)])


def _tokenizer_identity(tokenizer: Any) -> str:
    hf = getattr(tokenizer, "hf_tokenizer", None)
    files = []
    name = Path(str(getattr(tokenizer, "name", "")))
    if name.is_dir():  # a checkpoint's own tokenizer: its files
        files = [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in sorted(name.iterdir()) if p.is_file()
                 and ("token" in p.name or "vocab" in p.name or "merges" in p.name or "template" in p.name)]
    return json.dumps([tokenizer.name, tokenizer.vocab_size, tokenizer.eos_token_id, files,
                       getattr(hf, "chat_template", None)], default=str)


def _code_identity() -> str:
    """The data code itself: a change to tokenizing or packing never reads rows the old code made."""
    data = Path(__file__).resolve().parents[1] / "data"
    h = hashlib.sha256()
    for p in sorted(data.glob("*.py")):
        h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


def cache_key(cfg: TrainConfig, tokenizer: Any, split: str, dp_size: int, num_sequences: int | None) -> str | None:
    """The key of these rows, None when they are not cached."""
    source = _source_identity(cfg, split)
    if source is None:
        return None
    settings = {k: v for k, v in config_to_dict(cfg).items()
                if any(w in k for w in _DATA_WORDS) and not k.startswith("data_cache")
                and k != "dataset_num_proc"}  # who tokenizes, not what: the same rows
    text = json.dumps([_FORMAT, source, _tokenizer_identity(tokenizer), settings, split, dp_size, num_sequences,
                       _code_identity()], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def _meta_of(ds: SequenceDataset) -> dict[str, Any]:
    """Every field of the rows but their arrays, as JSON values."""
    meta = {f.name: getattr(ds, f.name) for f in fields(ds) if f.name not in _ARRAYS}
    meta["counts"] = asdict(ds.counts)
    return meta


def _plain(value: Any) -> Any:
    """A numpy scalar in the metadata as the Python number it holds."""
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON")


def save_rows(ds: SequenceDataset, directory: Path) -> None:
    """The rows as .npy files beside their metadata (JSON), written whole or not at all."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=directory.parent))
    try:
        for name in _ARRAYS:
            value = getattr(ds, name)
            if value is not None:
                np.save(tmp / f"{name}.npy", np.asarray(value), allow_pickle=False)
        (tmp / _META).write_text(json.dumps(_meta_of(ds), default=_plain))
        os.replace(tmp, directory)  # atomic: a reader sees all of it or nothing
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if load_rows(directory) is None:  # another writer may have won the rename
            raise


class _Unreadable(Exception):
    """A cache entry that is not what save_rows writes."""


def _read_rows(directory: Path) -> SequenceDataset:
    """The entry's rows, memory-mapped (copy-on-write: never written back); _Unreadable naming why not. Nothing
    in it is executed: JSON and .npy files without pickled objects."""
    try:
        meta = json.loads((directory / _META).read_text())
    except FileNotFoundError:
        raise _Unreadable(f"no {_META}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _Unreadable(f"{_META}: {exc}") from None
    names = {f.name for f in fields(SequenceDataset)} - set(_ARRAYS)
    if not isinstance(meta, dict) or set(meta) != names or not isinstance(meta["counts"], dict):
        raise _Unreadable(f"{_META} does not hold the fields {sorted(names)}")
    try:
        counts = DataCounts(**meta["counts"])
        arrays = {name: np.load(directory / f"{name}.npy", mmap_mode="c", allow_pickle=False)
                  for name in _ARRAYS if (directory / f"{name}.npy").exists()}
    except (TypeError, OSError, ValueError) as exc:  # unknown count names; a pickled or torn array
        raise _Unreadable(str(exc)) from None
    length = meta["max_length"]
    tokens = arrays.get("tokens")
    if not isinstance(length, int) or length < 1 or tokens is None or tokens.ndim != 1 or tokens.size % length:
        raise _Unreadable(f"tokens.npy does not hold whole rows of max_length {length}")
    n_rows = tokens.size // length
    for name, want in (("positions", tokens.size), ("trained", tokens.size), ("lengths", n_rows)):
        if name in arrays and arrays[name].shape != (want,):
            raise _Unreadable(f"{name}.npy has shape {arrays[name].shape}, not ({want},)")
    return SequenceDataset(**{**meta, "counts": counts, **{name: arrays.get(name) for name in _ARRAYS}})


def load_rows(directory: Path) -> SequenceDataset | None:
    """The cached rows, memory-mapped (copy-on-write: never written back); None when absent or unreadable."""
    try:
        return _read_rows(directory)
    except _Unreadable:
        return None


def _cached_rows(directory: Path) -> SequenceDataset | None:
    """The cache entry's rows; None when there is none. An entry that does not parse (torn, planted, or an older
    layout) is removed, with one line saying so, for the caller to build again."""
    if not directory.exists():
        return None
    try:
        return _read_rows(directory)
    except _Unreadable as why:
        log.warning(f"warning: the data cache entry {directory} does not parse ({why}); tokenizing again")
    shutil.rmtree(directory, ignore_errors=True)
    return None


def node_name() -> str:
    """The machine this rank runs on (ranks of one node share its disk; a test gives a rank another name)."""
    return socket.gethostname()


def scratch_dir() -> str:
    """Where rows that are not cached are written for the job's other ranks to read (the node's temp directory;
    a test gives each simulated node its own)."""
    return tempfile.gettempdir()


def _prepare(cfg: TrainConfig, tokenizer: Any, split: str, dp_size: int, num_sequences: int | None,
             directory: Path | None) -> tuple[SequenceDataset, str | None, Path | None]:
    """(rows, the directory the job's other ranks read them from or None, a scratch directory to remove or None).
    Read from the cache, else built and written there (or, uncached, to a scratch directory), then read back
    memory-mapped, so the preparing rank holds no copy of its own either."""
    if directory is not None:
        ds = _cached_rows(directory)
        if ds is not None:
            return ds, str(directory), None
    ds = build_sequences(cfg, tokenizer, split=split, dp_size=dp_size, num_sequences=num_sequences)
    scratch = None
    if directory is None:
        scratch = Path(tempfile.mkdtemp(prefix="ulysses-trainer-rows-", dir=scratch_dir()))
    target = directory if directory is not None else scratch / "rows"
    try:
        save_rows(ds, target)
    except OSError as exc:  # a full or read-only disk never stops the run: the rows are in memory
        log.warning(f"warning: cannot write the prepared rows to {target}: {exc}")
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        return ds, None, None
    return load_rows(target) or ds, str(target), scratch


def prepared_sequences(cfg: TrainConfig, tokenizer: Any, split: str = "train", dp_size: int = 1,
                       num_sequences: int | None = None) -> SequenceDataset:
    """build_sequences once per job (collective where a process group exists). Rank 0 reads the cache or
    tokenizes and writes the rows (to the cache, else to a scratch directory); the other ranks wait, then read
    them memory-mapped. A node whose ranks cannot read them (another disk) has its first rank prepare them once
    more for that node. A ConfigError while preparing is raised on every rank."""
    root = cache_root(cfg)
    key = cache_key(cfg, tokenizer, split, dp_size, num_sequences) if root is not None else None
    directory = root / key if key is not None else None
    rank = world_rank()
    nodes = gather_objects(node_name())
    leader = nodes.index(nodes[rank])  # the first rank of my node
    ds, written, scratch = None, None, None

    def round_(prepares: bool) -> list:
        nonlocal ds, written, scratch
        problem = None
        if prepares:
            try:
                ds, written, scratch = _prepare(cfg, tokenizer, split, dp_size, num_sequences, directory)
            except ConfigError as exc:
                problem = str(exc)
        results = gather_objects((problem, written))  # every rank waits for the preparing ones here
        bad = next((p for p, _ in results if p is not None), None)
        if bad is not None:
            raise ConfigError(bad)
        return [w for _, w in results]

    where = round_(rank == 0)[0]
    if ds is None and where is not None:
        ds = load_rows(Path(where))
    missing = gather_objects(ds is None)
    if any(missing):  # another node's disk: its first rank prepares for it (the cache there may hold them)
        where = round_(missing[rank] and rank == leader)[leader]
        if ds is None and where is not None:
            ds = load_rows(Path(where))
        if ds is None:  # nothing readable was written: this rank builds its own
            ds = build_sequences(cfg, tokenizer, split=split, dp_size=dp_size, num_sequences=num_sequences)
    gather_objects(None)  # every rank has mapped the files: a scratch directory's names can go
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)
    return ds
