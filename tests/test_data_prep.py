"""Data preparation at scale: the byte spans without a per-token loop are the per-token loop's, bit for bit."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from ulysses_trainer.data.qwen_bpe import QwenBPETokenizer
from ulysses_trainer.data.tokenizer import utf8_lengths

ALPHABET = "abc XYZ 012\n\t.,;é漢字日本語🙂🚀 ñü <|im_start|> ِ ́"


def _texts(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 300))) for _ in range(n)]


def test_utf8_lengths_are_each_characters_encoded_length():
    for text in _texts(50) + ["", "\ud800x"]:  # a lone surrogate counts as Python's surrogatepass bytes
        want = [len(c.encode("utf-8", errors="surrogatepass")) for c in text]
        assert utf8_lengths(text).tolist() == want


def test_qwen_byte_spans_equal_the_per_token_decode():
    tok = QwenBPETokenizer()
    for text in _texts(50, seed=1) + [""]:
        ids, starts, ends = tok.encode_with_byte_spans(text)
        want_ends = np.cumsum([len(tok._enc.decode_single_token_bytes(t)) for t in ids], dtype=np.int64)
        assert ids == tok._enc.encode_ordinary(text)
        assert ends.tolist() == want_ends.tolist()
        assert starts.tolist() == ([0] + want_ends[:-1].tolist() if ids else [])
        assert (ends[-1] if ids else 0) == len(text.encode("utf-8"))


def test_hf_byte_spans_equal_the_per_character_offsets(tmp_path):
    from transformers import AutoTokenizer

    from ulysses_trainer.data.tokenizer import HFTokenizer

    QwenBPETokenizer().save_pretrained(str(tmp_path))  # an HF fast tokenizer with character offsets
    tok = HFTokenizer(AutoTokenizer.from_pretrained(str(tmp_path)), str(tmp_path))
    for text in _texts(30, seed=2):
        ids, starts, ends = tok.encode_with_byte_spans(text)
        enc = tok.hf_tokenizer(text, add_special_tokens=False, split_special_tokens=True,
                               return_offsets_mapping=True)
        char_bytes = np.concatenate([[0], np.cumsum([len(c.encode("utf-8")) for c in text])]).astype(np.int64)
        spans = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        assert ids == list(enc["input_ids"])
        assert starts.tolist() == char_bytes[spans[:, 0]].tolist() and ends.tolist() == char_bytes[spans[:, 1]].tolist()


# ---------------------------------------------------------------- the cache and one preparation per job
class CountingTokenizer(QwenBPETokenizer):
    """The Qwen BPE, counting every call that tokenizes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def encode(self, text):
        self.calls += 1
        return super().encode(text)

    def encode_batch(self, texts):
        self.calls += 1
        return super().encode_batch(texts)

    def encode_with_byte_spans(self, text):
        self.calls += 1
        return super().encode_with_byte_spans(text)


def _write(path, rows) -> str:
    import json

    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _text_rows(n=12):
    return [{"text": t} for t in _texts(n, seed=3)]


def _chat_rows(n=8):
    texts = _texts(3 * n, seed=4)
    return [{"messages": [{"role": "system", "content": texts[3 * i]}, {"role": "user", "content": texts[3 * i + 1]},
                          {"role": "assistant", "content": texts[3 * i + 2]}]} for i in range(n)]


def _pc_rows(n=8):
    texts = _texts(2 * n, seed=5)
    return [{"prompt": texts[2 * i], "completion": texts[2 * i + 1]} for i in range(n)]


def _cfg(data, cache, **kw):
    from ulysses_trainer.config import TrainConfig

    kw.setdefault("max_length", 64)
    return TrainConfig(dataset_name=data, data_cache_dir=str(cache), **kw)


def _same_rows(a, b) -> None:
    assert len(a) == len(b) and a.counts == b.counts and a.documents_used == b.documents_used
    for name in ("tokens", "positions", "trained", "lengths"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            assert x.dtype == y.dtype and np.array_equal(x, y), name
    for i in range(len(a)):
        for k, v in a[i].items():
            assert (v == b[i][k]).all() if hasattr(v, "all") else v == b[i][k]


@pytest.mark.parametrize("kind", ["text", "messages", "prompt_completion"])
def test_second_prepare_reads_the_cache_bitwise_without_tokenizing(tmp_path, kind):
    from ulysses_trainer.data.documents import build_sequences
    from ulysses_trainer.train.data_cache import prepared_sequences

    rows, kw = {"text": (_text_rows(), {}),
                "messages": (_chat_rows(), {"assistant_only_loss": True, "max_length": 1024}),
                "prompt_completion": (_pc_rows(), {"packing": True, "max_length": 1024})}[kind]
    cfg = _cfg(_write(tmp_path / "d.jsonl", rows), tmp_path / "cache", **kw)
    reference = build_sequences(cfg, QwenBPETokenizer())  # today's path, no cache
    tok = CountingTokenizer()
    first = prepared_sequences(cfg, tok)
    assert tok.calls > 0
    tok.calls = 0
    second = prepared_sequences(cfg, tok)
    assert tok.calls == 0  # read, not tokenized
    assert isinstance(second.tokens, np.memmap)  # memory-mapped, not held in lists
    _same_rows(reference, first)
    _same_rows(reference, second)
    if kind != "text":  # masks kept
        assert second.trained is not None and 0 < second.trained.sum() < second.trained.size


def test_cache_is_tokenized_again_when_data_or_settings_change(tmp_path):
    import os

    from ulysses_trainer.train.data_cache import prepared_sequences

    data = _write(tmp_path / "d.jsonl", _text_rows())
    tok = CountingTokenizer()

    def calls(cfg) -> int:
        tok.calls = 0
        prepared_sequences(cfg, tok)
        return tok.calls

    cache = tmp_path / "cache"
    assert calls(_cfg(data, cache)) > 0 and calls(_cfg(data, cache)) == 0
    assert calls(_cfg(data, cache, max_length=32)) > 0  # a data setting
    assert calls(_cfg(data, cache, packing=True)) > 0
    assert calls(_cfg(data, cache, dataset_text_field="text", seed=9)) > 0
    assert calls(_cfg(data, cache, learning_rate=1e-3)) == 0  # not a data setting: the same rows
    _write(tmp_path / "d.jsonl", _text_rows(13))  # the data changed (size and time)
    assert calls(_cfg(data, cache)) > 0
    st = os.stat(data)
    os.utime(data, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # touched only: tokenized again (no hash read)
    assert calls(_cfg(data, cache)) > 0
    assert calls(_cfg(data, cache, data_cache=False)) > 0 and calls(_cfg(data, cache, data_cache=False)) > 0


class _Planted:
    """A pickle that, once loaded, creates a file: what a planted cache file could do on every rank."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("plant", ["old_pickle", "pickled_array", "corrupt_json", "wrong_fields"])
def test_a_cache_entry_that_does_not_parse_is_rebuilt_and_never_executed(tmp_path, plant):
    import json
    import logging
    import pickle

    from ulysses_trainer.data.documents import build_sequences
    from ulysses_trainer.train.data_cache import prepared_sequences

    cfg = _cfg(_write(tmp_path / "d.jsonl", _chat_rows()), tmp_path / "cache", assistant_only_loss=True,
               max_length=1024)
    reference = build_sequences(cfg, QwenBPETokenizer())  # in memory: the entry's files are about to change
    tok = CountingTokenizer()
    prepared_sequences(cfg, tok)
    (entry,) = [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]
    marker = tmp_path / "ran"
    assert not marker.exists()
    pickle.loads(pickle.dumps(_Planted(marker)))  # the plant is live: loading it runs code
    assert marker.exists()
    marker.unlink()
    if plant == "old_pickle":  # the layout before JSON: meta.pkl only
        (entry / "meta.json").unlink()
        (entry / "meta.pkl").write_bytes(pickle.dumps(_Planted(marker)))
    elif plant == "pickled_array":
        np.save(entry / "lengths.npy", np.array([_Planted(marker)], dtype=object), allow_pickle=True)
    elif plant == "corrupt_json":
        (entry / "meta.json").write_text('{"max_length": 1024, ')
    else:
        meta = json.loads((entry / "meta.json").read_text())
        (entry / "meta.json").write_text(json.dumps({**meta, "surprise": 1}))
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("ulysses_trainer.train.data_cache")
    logger.addHandler(handler)
    try:
        tok.calls = 0
        rebuilt = prepared_sequences(cfg, tok)
        assert tok.calls > 0  # tokenized again
        tok.calls = 0
        again = prepared_sequences(cfg, tok)
        assert tok.calls == 0  # the rebuilt entry is a cache hit
    finally:
        logger.removeHandler(handler)
    assert not marker.exists()  # nothing in the entry was executed
    assert len(lines) == 1 and str(entry) in lines[0] and "does not parse" in lines[0], lines
    assert not (entry / "meta.pkl").exists()
    _same_rows(reference, rebuilt)
    _same_rows(reference, again)


def test_no_home_and_no_dir_means_no_cache(tmp_path, monkeypatch):
    from ulysses_trainer.train.data_cache import cache_root

    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_root(_cfg("x", tmp_path)) == tmp_path
    cfg = _cfg("x", tmp_path)
    cfg.data_cache_dir = None
    assert cache_root(cfg) is None


def _prepare_rank(rank: int, world_size: int, data: str, cache: str, use_cache: bool = True,
                  nodes: tuple[str, ...] | None = None) -> tuple[int, str]:
    """(tokenizer calls, digest of the rows). The scratch directories are cache/scratch/<node>: the test lists
    them once every rank has returned (a rank returning early could see its node's preparer still removing it).
    nodes: the node of each rank; each node then has its own scratch directory and cannot read another node's."""
    import hashlib
    from pathlib import Path

    from ulysses_trainer.train import data_cache
    from ulysses_trainer.train.data_cache import prepared_sequences

    scratch = Path(cache) / "scratch" / (nodes[rank] if nodes else "node")
    scratch.mkdir(parents=True, exist_ok=True)
    data_cache.scratch_dir = lambda: str(scratch)
    if nodes:
        data_cache.node_name = lambda: nodes[rank]
        own, read = str(scratch), data_cache.load_rows
        data_cache.load_rows = lambda d: read(d) if str(d).startswith(own) else None  # another node's disk
    tok = CountingTokenizer()
    cfg = _cfg(data, cache, assistant_only_loss=True, max_length=1024, data_cache=use_cache)
    ds = prepared_sequences(cfg, tok)
    digest = hashlib.sha256(np.ascontiguousarray(ds.tokens).tobytes() + np.ascontiguousarray(ds.trained).tobytes())
    assert isinstance(ds.tokens, np.memmap)  # every rank maps the rows, the preparing one too
    return tok.calls, digest.hexdigest()


def _left_in_scratch(cache: Path) -> dict[str, list[str]]:
    """What every node's scratch directory still holds (listed after the ranks have ended)."""
    return {node.name: sorted(p.name for p in node.iterdir()) for node in (cache / "scratch").iterdir()}


@pytest.mark.slow
@pytest.mark.parametrize("use_cache", [True, False])
def test_only_rank_0_tokenizes_and_the_others_read_its_rows(tmp_path, use_cache):
    from tests.dist_utils import run_ranks

    data = _write(tmp_path / "chat.jsonl", _chat_rows())
    (calls0, rows0), (calls1, rows1) = run_ranks(2, _prepare_rank, data, str(tmp_path / "cache"), use_cache)
    assert calls0 > 0 and calls1 == 0
    assert rows0 == rows1
    # without the cache the rows went through a scratch directory, removed once every rank had mapped them
    assert _left_in_scratch(tmp_path / "cache") == {"node": []}


@pytest.mark.slow
def test_a_node_that_cannot_read_rank_0s_rows_prepares_them_once_for_its_ranks(tmp_path):
    from tests.dist_utils import run_ranks

    data = _write(tmp_path / "chat.jsonl", _chat_rows())
    results = run_ranks(3, _prepare_rank, data, str(tmp_path / "cache"), False, ("a", "b", "b"))
    calls = [c for c, _ in results]
    assert calls[0] > 0 and calls[1] > 0 and calls[2] == 0  # node b's first rank prepares, its other rank reads
    assert len({d for _, d in results}) == 1
    assert _left_in_scratch(tmp_path / "cache") == {"a": [], "b": []}


# ---------------------------------------------------------------- dataset_num_proc
class PidTokenizer(QwenBPETokenizer):
    """The Qwen BPE, writing the id of every process that tokenizes to a file."""

    def __init__(self, log) -> None:
        super().__init__()
        self.log = str(log)

    def _mark(self) -> None:
        import os

        with open(self.log, "a") as f:
            f.write(f"{os.getpid()}\n")

    def encode_batch(self, texts):
        self._mark()
        return super().encode_batch(texts)

    def encode_with_byte_spans(self, text):
        self._mark()
        return super().encode_with_byte_spans(text)


@pytest.mark.slow
def test_dataset_num_proc_workers_tokenize_the_same_rows(tmp_path):
    import os

    from ulysses_trainer.data.documents import build_sequences
    from ulysses_trainer.errors import ConfigError

    chats = _chat_rows(150)  # three chunks of 64 rows
    chats.insert(70, {"text": "a row of another shape"})
    cases = {"messages": (chats, {"assistant_only_loss": True, "max_length": 1024}),
             "text": (_text_rows(200), {"max_length": 64}),
             "text packed whole": (_text_rows(200), {"packing": True, "max_length": 512})}
    for kind, (rows, kw) in cases.items():
        data = _write(tmp_path / f"{kind}.jsonl", rows)
        log = tmp_path / f"{kind}.pids"
        reference = build_sequences(_cfg(data, tmp_path, **kw), QwenBPETokenizer())
        got = build_sequences(_cfg(data, tmp_path, dataset_num_proc=2, **kw), PidTokenizer(log))
        _same_rows(reference, got)
        pids = set(log.read_text().split())
        assert len(pids) == 2 and str(os.getpid()) not in pids, kind  # two workers did all the tokenizing
        if kind == "messages":  # the row of another shape, counted by the worker that read it
            assert got.counts.skipped == {"without `messages` (a row of another shape)": 1}
    chats[130]["messages"][2]["tool_calls"] = [{"function": {"name": "f", "arguments": "{not json"}}]
    data = _write(tmp_path / "bad.jsonl", chats)
    with pytest.raises(ConfigError, match="example 130"):  # a worker's error names the row in the whole file
        build_sequences(_cfg(data, tmp_path, dataset_num_proc=2, assistant_only_loss=True, max_length=1024),
                        QwenBPETokenizer())
