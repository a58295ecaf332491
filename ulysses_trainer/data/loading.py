"""Reading a dataset source: an HF dataset name (`datasets.load_dataset`), local files (parquet, jsonl/json,
txt, arrow, csv), a directory of them, or one written by `save_to_disk`; bad sources are a ConfigError
naming the fix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import ConfigError

_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".txt": "text", ".text": "text",
             ".arrow": "arrow", ".csv": "csv"}


def _local_files(path: Path) -> tuple[str, list[str]]:
    """(datasets builder, files) for a file or a directory of same-format files."""
    if path.is_file():
        files = [path]
    else:
        files = sorted(f for f in path.rglob("*") if f.is_file() and f.suffix.lower() in _BUILDERS
                       and not any(part.startswith(".") for part in f.relative_to(path).parts))
        if not files:
            raise ConfigError(f"dataset directory {path} holds no data files "
                              f"({', '.join(sorted(_BUILDERS))})")
    kinds = {_BUILDERS.get(f.suffix.lower()) for f in files}
    if None in kinds:
        raise ConfigError(f"dataset file {files[0]} has an unsupported extension; use one of "
                          f"{', '.join(sorted(_BUILDERS))}")
    if len(kinds) > 1:
        raise ConfigError(f"dataset directory {path} mixes formats ({', '.join(sorted(kinds))}); "
                          f"keep one format per directory")
    return kinds.pop(), [str(f) for f in files]


def _first_non_utf8(files: list[str]) -> tuple[str, int] | None:
    """(file, byte offset) of the first byte sequence that is not UTF-8, or None."""
    import codecs

    for name in files:
        decoder, offset = codecs.getincrementaldecoder("utf-8")(), 0
        with open(name, "rb") as f:
            while block := f.read(1 << 20):
                try:
                    decoder.decode(block)
                except UnicodeDecodeError as exc:
                    return name, offset + exc.start
                offset += len(block)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            return name, offset
    return None


def _first_bad_json_line(files: list[str]) -> tuple[str, int, str] | None:
    """(file, line number, what is wrong) of the first line of a JSON Lines file that is not one JSON object; a
    .json file holding one JSON document is not read by lines. None when every line is an object."""
    import json

    for name in files:
        if name.lower().endswith(".json"):
            try:
                with open(name, encoding="utf-8") as f:
                    json.load(f)
                continue  # one JSON document: not JSON Lines
            except ValueError:
                pass
        with open(name, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    value = json.loads(line)
                except ValueError as exc:
                    return name, n, f"not valid JSON ({exc.msg.removesuffix(' at')} at column {exc.colno})"
                if not isinstance(value, dict):
                    return name, n, f"a JSON {type(value).__name__}, not an object"
    return None


def load_text_dataset(source: str, split: str, text_file_split: str = "document") -> Any:
    """A `datasets.Dataset` for a local path or an HF dataset name (`split` applies to HF names); ConfigError
    for one without rows (the one place an empty source is refused).

    text_file_split: how a .txt file becomes documents: "document" (the whole file, newlines kept),
    "paragraph" (split at blank lines) or "line".
    """
    ds = _load(source, split, text_file_split)
    if ds is None or len(ds) == 0:
        raise ConfigError(f"dataset {source} is empty; point dataset_name at data with documents")
    return ds


def _load(source: str, split: str, text_file_split: str) -> Any:
    """The dataset, or None where the files hold no data."""
    import datasets

    path = Path(source)
    if path.exists():
        if path.is_dir() and any((path / f).is_file() for f in ("state.json", "dataset_dict.json")):
            try:
                ds = datasets.load_from_disk(str(path))
            except Exception as exc:
                raise ConfigError(f"cannot read the saved dataset {path}: {exc}") from None
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise ConfigError(f"saved dataset {path} has splits {list(ds)}, not {split!r}; "
                                      f"set dataset_train_split / dataset_test_split")
                ds = ds[split]
            return ds
        builder, files = _local_files(path)
        if all(Path(f).stat().st_size == 0 for f in files):
            return None
        # the text builder's default is one document per line; a book is one document
        kwargs = {"sample_by": text_file_split} if builder == "text" else {}
        try:
            return datasets.load_dataset(builder, data_files=files, split="train", **kwargs)
        except Exception as exc:
            if "corresponds to no data" in str(exc):  # datasets' wording for zero rows
                return None
            bad = _first_non_utf8(files) if builder in ("text", "json", "csv") else None
            if bad is not None:  # datasets says only "An error occurred while generating the dataset"
                raise ConfigError(f"dataset file {bad[0]} is not UTF-8 text (byte {bad[1]}); convert it to "
                                  f"UTF-8, e.g. `iconv -f latin1 -t utf-8 IN > OUT`") from None
            line = _first_bad_json_line(files) if builder == "json" else None
            if line is not None:
                raise ConfigError(f"dataset file {line[0]}, line {line[1]}: {line[2]}; each line of a JSON Lines "
                                  f"file must be one JSON object, like {{\"text\": \"...\"}} or "
                                  f"{{\"messages\": [...]}}: fix or remove that line") from None
            raise ConfigError(f"cannot read dataset {source} as {builder}: {str(exc).strip()}") from None
    if source.startswith((".", "/", "~")) or Path(source).suffix.lower() in _BUILDERS:
        raise ConfigError(f"dataset {source!r} not found; give an existing file or directory "
                          f"({', '.join(sorted(_BUILDERS))}) or an HF dataset name")
    try:
        return datasets.load_dataset(source, split=split)
    except ValueError as exc:
        if "split" in str(exc).lower():
            raise ConfigError(f"HF dataset {source!r} has no split {split!r} ({exc}); set "
                              f"dataset_train_split / dataset_test_split") from None
        raise ConfigError(f"cannot load HF dataset {source!r}: {exc}") from None
    except Exception as exc:
        raise ConfigError(f"dataset {source!r} is neither a local path nor a loadable HF dataset "
                          f"({type(exc).__name__}: {str(exc).strip()[:300]})") from None
