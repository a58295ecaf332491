"""Tokenizer, synthetic documents and the long-document builder (local files made in tmp_path)."""

import json
import random

import pytest
import torch

from ulysses_trainer.config import TrainConfig
from ulysses_trainer.data.documents import build_sequences, default_num_sequences
from ulysses_trainer.data.qwen_bpe import QwenBPETokenizer
from ulysses_trainer.data.synthetic import synthetic_document, synthetic_documents
from ulysses_trainer.data.tokenizer import check_tokenizer_fits, load_tokenizer
from ulysses_trainer.errors import ConfigError
from ulysses_trainer.families.presets import preset_config


@pytest.fixture(scope="module")
def tok():
    return QwenBPETokenizer()


def _docs(n: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    vocab = ["alpha", "beta", "gamma", "delta", "stone", "cloud", "seven", "red"]
    return [" ".join(rng.choice(vocab) for _ in range(words)) for _ in range(n)]


def _write_jsonl(path, docs, field="text"):
    path.write_text("".join(json.dumps({field: d, "id": i}) + "\n" for i, d in enumerate(docs)))


def _stream(tok, docs):
    out = []
    for d in docs:
        out += tok.encode(d) + [tok.eos_token_id]
    return out


# ---------------------------------------------------------------- tokenizer
def test_qwen_bpe_fallback(tok):
    assert tok.encode("Hello world!") == [9707, 1879, 0]
    assert tok.eos_token_id == 151643
    assert tok.vocab_size <= 151936
    assert tok.encode_batch(["Hello world!", "x"]) == [[9707, 1879, 0], tok.encode("x")]
    text = "Ledger. The code of Velmora is 4821."
    assert tok.decode(tok.encode(text)) == text
    assert 151643 not in tok.encode("a <|endoftext|> b")  # documents cannot inject special tokens
    assert isinstance(load_tokenizer(None), QwenBPETokenizer)
    assert isinstance(load_tokenizer("tiny"), QwenBPETokenizer)


def test_bpe_export_loads_with_autotokenizer(tok, tmp_path):
    from transformers import AutoTokenizer

    tok.save_pretrained(str(tmp_path))
    hf = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    text = "Hello world! The code of Velmora is 4821.\n\n  café 東京"
    assert hf(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
    assert hf.eos_token_id == tok.eos_token_id
    own = load_tokenizer(str(tmp_path))  # a checkpoint dir with tokenizer files uses its own
    assert own.name == str(tmp_path) and own.encode(text) == tok.encode(text)


def test_bpe_export_from_the_user_cache_is_the_converted_one(tok, tmp_path, monkeypatch):
    """The converted tokenizer is kept in the user cache: an export from a cold cache, one from the file it left and
    one after that file was damaged write the same tokenizer files; without a home directory nothing is cached."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    exported = {}
    for name in ("cold", "warm", "damaged"):
        if name == "damaged":
            (cached,) = (tmp_path / "cache" / "ulysses_trainer" / "tokenizers").glob("qwen-bpe-*.json")
            cached.write_text("{not json")
        tok.save_pretrained(str(tmp_path / name))
        exported[name] = {f.name: f.read_bytes() for f in (tmp_path / name).iterdir()}
    assert "tokenizer.json" in exported["cold"] and exported["warm"] == exported["cold"] == exported["damaged"]
    assert json.loads(cached.read_text())["model"]["type"] == "BPE"  # the damaged file was replaced
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.delenv("HOME")
    tok.save_pretrained(str(tmp_path / "homeless"))
    assert {f.name: f.read_bytes() for f in (tmp_path / "homeless").iterdir()} == exported["cold"]


def test_tokenizer_must_fit_the_model(tok):
    check_tokenizer_fits(tok, preset_config("tiny"))
    small = preset_config("tiny")
    small.vocab_size = 1000
    with pytest.raises(ConfigError, match=r"has 151669 ids but the model's vocab_size is 1000"):
        check_tokenizer_fits(tok, small)


# ---------------------------------------------------------------- synthetic
def test_synthetic_is_deterministic_and_seeded():
    a = [d for d, _ in zip(synthetic_documents(5, 300), range(3))]
    b = [d for d, _ in zip(synthetic_documents(5, 300), range(3))]
    c = [d for d, _ in zip(synthetic_documents(6, 300), range(3))]
    assert a == b and a != c
    assert len(set(a)) == 3


def test_synthetic_recalls_early_pairs_late():
    doc = synthetic_document(random.Random(0), num_words=3000, num_pairs=10)
    ledger, rest = doc.split("\n\n", 1)
    _, recall = rest.rsplit("Recall.\n", 1)
    statements = ledger.removeprefix("Ledger.\n").split(". ")
    pairs = [s.rstrip(".").split(" of ", 1)[1].split(" is ") for s in statements]
    assert len(pairs) == 10
    n = len(doc)
    for key, value in pairs:
        first = doc.index(f"{key} is {value}")
        answer = doc.index(f"of {key}? Answer: {value}.")
        assert first < 0.1 * n < 0.9 * n < answer  # stated in the first tenth, recalled in the last
        assert f"of {key}? Answer: {value}." in recall
    assert len(doc.split()) >= 3000


def test_synthetic_sequences_are_four_steps_whatever_max_steps(tok):
    cfg = TrainConfig(max_length=512, max_steps=3, gradient_accumulation_steps=2)
    ds = build_sequences(cfg, tok, dp_size=2)
    assert len(ds) == default_num_sequences(cfg, "train", dp_size=2) == 4 * 2 * 2
    assert default_num_sequences(TrainConfig(max_length=512, max_steps=7, gradient_accumulation_steps=2),
                                 "train", dp_size=2) == len(ds)  # max_steps only says where the run stops
    row = ds[0]
    assert row["input_ids"].shape == (512,) and row["input_ids"].dtype == torch.long
    assert torch.equal(row["position_ids"], torch.arange(512))
    assert ds.source == "synthetic"
    again = build_sequences(cfg, tok, dp_size=2)
    assert all(torch.equal(ds[i]["input_ids"], again[i]["input_ids"]) for i in range(len(ds)))
    ev = build_sequences(cfg, tok, split="eval")
    assert not torch.equal(ev[0]["input_ids"], ds[0]["input_ids"])  # eval documents differ


def test_long_synthetic_documents_are_made_only_as_far_as_the_rows_need(tok, monkeypatch):
    """A capped read pulls documents in batches of at most about a MiB of text: 4 rows of 32K tokens take the
    documents that fill them plus at most the rest of one batch (64 documents were made before), and the rows
    are the same as with batches of 64 documents whatever their size."""
    from ulysses_trainer.data import documents

    made = []

    def counted(seed, mean_words):
        for doc in synthetic_documents(seed, mean_words):
            made.append(len(doc))
            yield doc

    monkeypatch.setattr(documents, "synthetic_documents", counted)
    cfg = TrainConfig(max_length=32768)
    ds = build_sequences(cfg, tok)
    used = ds.counts.documents_used
    assert len(ds) == 4 and len(made) < documents.BATCH_DOCS
    assert sum(made[used:]) < documents.CHUNK_CHARS  # made beyond the rows' documents: less than one batch
    made.clear()
    monkeypatch.setattr(documents, "CHUNK_CHARS", 1 << 62)  # batches of BATCH_DOCS documents only
    wide = build_sequences(cfg, tok)
    assert len(made) == documents.BATCH_DOCS
    assert all(torch.equal(ds[i]["input_ids"], wide[i]["input_ids"]) for i in range(len(ds)))


# ---------------------------------------------------------------- local files
def test_jsonl_joined_end_to_end_and_cut(tok, tmp_path):
    docs = _docs(12, 40)
    _write_jsonl(tmp_path / "d.jsonl", docs)
    cfg = TrainConfig(dataset_name=str(tmp_path / "d.jsonl"), max_length=64)
    ds = build_sequences(cfg, tok)
    stream = _stream(tok, docs)
    assert len(ds) == len(stream) // 64  # remainder dropped
    flat = torch.cat([ds[i]["input_ids"] for i in range(len(ds))]).tolist()
    assert flat == stream[: len(ds) * 64]
    assert ds.documents_total == 12 and ds.epoch_sequences == len(ds)
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_num_sequences_stops_early_and_estimates_the_epoch(tok, tmp_path):
    docs = _docs(40, 40)
    _write_jsonl(tmp_path / "d.jsonl", docs)
    cfg = TrainConfig(dataset_name=str(tmp_path / "d.jsonl"), max_length=64)
    full = build_sequences(cfg, tok)
    part = build_sequences(cfg, tok, num_sequences=2)
    assert len(part) == 2 and part.documents_used < 40
    assert torch.equal(part[1]["input_ids"], full[1]["input_ids"])
    assert part.epoch_sequences == pytest.approx(len(full), rel=0.3)


def test_early_stop_epoch_estimate_follows_the_text_not_the_document_count(tok, tmp_path):
    docs = _docs(30, 8, seed=4) + _docs(10, 400, seed=5)  # many short documents first, then long ones
    _write_jsonl(tmp_path / "d.jsonl", docs)
    cfg = TrainConfig(dataset_name=str(tmp_path / "d.jsonl"), max_length=64)
    full = build_sequences(cfg, tok)
    part = build_sequences(cfg, tok, num_sequences=2)
    assert part.documents_used < 30  # read only short documents: counting documents would say ~2 rows/epoch
    assert part.epoch_sequences == pytest.approx(len(full), rel=0.1)


@pytest.mark.parametrize("fmt", ["parquet", "txt", "json", "arrow", "dir"])
def test_local_formats(tok, tmp_path, fmt):
    import datasets

    docs = _docs(6, 30, seed=1)
    if fmt == "parquet":
        path = tmp_path / "d.parquet"
        datasets.Dataset.from_dict({"body": docs}).to_parquet(str(path))
        field = "body"
    elif fmt == "txt":  # text_file_split line: one document per line, field "text"
        path = tmp_path / "d.txt"
        path.write_text("\n".join(docs) + "\n")
        field = "text"
    elif fmt == "json":
        path = tmp_path / "d.json"
        path.write_text(json.dumps([{"content": d} for d in docs]))
        field = "content"
    elif fmt == "arrow":
        path = tmp_path / "saved"
        datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(path))
        field = "text"
    else:  # a directory of jsonl shards, read in name order
        path = tmp_path / "shards"
        path.mkdir()
        _write_jsonl(path / "a.jsonl", docs[:3])
        _write_jsonl(path / "b.jsonl", docs[3:])
        field = "text"
    cfg = TrainConfig(dataset_name=str(path), dataset_text_field=field, max_length=32,
                      text_file_split="line" if fmt == "txt" else "document")
    ds = build_sequences(cfg, tok)
    flat = torch.cat([ds[i]["input_ids"] for i in range(len(ds))]).tolist()
    assert len(ds) >= 1 and flat == _stream(tok, docs)[: len(ds) * 32]


def test_txt_file_is_one_document_with_its_newlines(tok, tmp_path):
    paragraphs = [" ".join(d.split()[:12]) + "\nsecond line" for d in _docs(3, 12, seed=5)]
    text = "\n\n".join(paragraphs) + "\n"
    (tmp_path / "book.txt").write_text(text)
    (tmp_path / "tail.txt").write_text("the next book")
    n = len(tok.encode(text)) + 1  # one eos, after the whole file
    L = n + 3  # the first row holds the book and 3 tokens of the next file
    ds = build_sequences(TrainConfig(dataset_name=str(tmp_path), max_length=L, packing=True,
                                     packing_strategy="wrapped"), tok)
    ids, pos = ds[0]["input_ids"].tolist(), ds[0]["position_ids"].tolist()
    assert ids[:n] == tok.encode(text) + [tok.eos_token_id]
    assert tok.decode(ids[:n - 1]) == text  # newlines kept and tokenized, not replaced by eos
    assert ids[:n].count(tok.eos_token_id) == 1 and ids[n - 1] == tok.eos_token_id
    assert pos == list(range(n)) + [0, 1, 2]  # packing: the book is one segment, the next file another
    assert ds.documents_used == 2
    by_paragraph = build_sequences(TrainConfig(dataset_name=str(tmp_path / "book.txt"), max_length=8,
                                               text_file_split="paragraph"), tok)
    assert by_paragraph.documents_used == 3


def test_non_utf8_txt_names_the_file(tok, tmp_path):
    (tmp_path / "a.txt").write_text("plain ascii\n")
    (tmp_path / "b.txt").write_bytes("caf\u00e9 cr\u00e8me\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"dataset file .*b\.txt is not UTF-8 text \(byte 3\); convert it to "
                                          r"UTF-8"):
        build_sequences(TrainConfig(dataset_name=str(tmp_path), max_length=8), tok)


def test_raw_arrow_file(tok, tmp_path):
    import datasets

    docs = _docs(5, 30, seed=2)
    src = datasets.Dataset.from_dict({"text": docs})
    src.save_to_disk(str(tmp_path / "saved"))
    arrow = next((tmp_path / "saved").glob("*.arrow"))
    ds = build_sequences(TrainConfig(dataset_name=str(arrow), max_length=32), tok)
    flat = torch.cat([ds[i]["input_ids"] for i in range(len(ds))]).tolist()
    assert flat == _stream(tok, docs)[: len(ds) * 32]


def test_wrapped_packing_position_ids_restart_at_documents_and_rows(tok, tmp_path):
    docs = _docs(8, 25, seed=3)
    _write_jsonl(tmp_path / "d.jsonl", docs)
    L = 48
    ds = build_sequences(TrainConfig(dataset_name=str(tmp_path / "d.jsonl"), max_length=L, packing=True,
                                     packing_strategy="wrapped"), tok)
    lengths = [len(tok.encode(d)) + 1 for d in docs]  # + eos
    # expected: positions count up within each document and restart at each document and each row
    expected, stream_pos = [], []
    for n in lengths:
        stream_pos += list(range(n))
    for j, p in enumerate(stream_pos[: len(ds) * L]):
        expected.append(0 if (p == 0 or j % L == 0) else expected[-1] + 1)
    got = torch.cat([ds[i]["position_ids"] for i in range(len(ds))]).tolist()
    assert got == expected
    assert got.count(0) > len(ds)  # some rows hold more than one document
    ids = torch.cat([ds[i]["input_ids"] for i in range(len(ds))])
    starts = [j for j, p in enumerate(got) if p == 0 and j % L != 0]
    assert all(ids[j - 1].item() == tok.eos_token_id for j in starts)  # every restart follows an eos


# ---------------------------------------------------------------- errors
def test_text_field_missing_lists_fields(tok, tmp_path):
    _write_jsonl(tmp_path / "d.jsonl", _docs(3, 10), field="body")
    cfg = TrainConfig(dataset_name=str(tmp_path / "d.jsonl"), max_length=8)
    with pytest.raises(ConfigError, match=r"no field 'text'; its fields are \['body', 'id'\], none.*text_field"):
        build_sequences(cfg, tok)


def test_non_text_field(tok, tmp_path):
    _write_jsonl(tmp_path / "d.jsonl", _docs(3, 10))
    cfg = TrainConfig(dataset_name=str(tmp_path / "d.jsonl"), dataset_text_field="id", max_length=8)
    with pytest.raises(ConfigError, match=r"field 'id' holds int values, not text"):
        build_sequences(cfg, tok)


def test_empty_dataset(tok, tmp_path):
    import datasets

    datasets.Dataset.from_dict({"text": []}, features=datasets.Features({"text": datasets.Value("string")})) \
        .to_parquet(str(tmp_path / "e.parquet"))
    with pytest.raises(ConfigError, match="is empty"):
        build_sequences(TrainConfig(dataset_name=str(tmp_path / "e.parquet")), tok)
    (tmp_path / "e.jsonl").write_text("")
    with pytest.raises(ConfigError, match="is empty"):
        build_sequences(TrainConfig(dataset_name=str(tmp_path / "e.jsonl")), tok)


def test_too_short_says_how_many_tokens(tok, tmp_path):
    docs = ["short one", "and another"]
    _write_jsonl(tmp_path / "d.jsonl", docs)
    n = len(_stream(tok, docs))
    with pytest.raises(ConfigError, match=rf"gives {n} tokens \(2 documents \+ eos\) but one sequence needs "
                                          rf"max_length = 4096 tokens"):
        build_sequences(TrainConfig(dataset_name=str(tmp_path / "d.jsonl"), max_length=4096), tok)


def test_missing_paths_and_formats(tok, tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        build_sequences(TrainConfig(dataset_name=str(tmp_path / "nope.jsonl")), tok)
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(ConfigError, match="holds no data files"):
        build_sequences(TrainConfig(dataset_name=str(tmp_path / "empty_dir")), tok)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    _write_jsonl(mixed / "a.jsonl", ["x"])
    (mixed / "b.txt").write_text("y\n")
    with pytest.raises(ConfigError, match="mixes formats"):
        build_sequences(TrainConfig(dataset_name=str(mixed)), tok)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "a"}\n{oops\n')
    with pytest.raises(ConfigError, match=r"bad.jsonl, line 2: not valid JSON"):
        build_sequences(TrainConfig(dataset_name=str(bad)), tok)
    with pytest.raises(ConfigError, match="neither a local path nor a loadable HF dataset"):
        build_sequences(TrainConfig(dataset_name="nobody-here/no-such-dataset-xyz"), tok)  # offline in tests
    local = tmp_path / "d.jsonl"
    _write_jsonl(local, _docs(3, 10))
    with pytest.raises(ConfigError, match="local path with no test split; set eval_dataset_name"):
        build_sequences(TrainConfig(dataset_name=str(local)), tok, split="eval")


@pytest.mark.parametrize("source", ["synthetic:agent_sessions", "synthetic:agent_sessions_mixed"])
def test_endless_sessions_all_too_long_are_refused_not_waited_on(tok, source, monkeypatch):
    """The synthetic sessions never end: when every session is longer than max_length and dropped, the
    build stops with the fix named after ENDLESS_DROPS sessions instead of reading forever."""
    from ulysses_trainer.data import documents

    cfg = TrainConfig(max_length=64, dataset_name=source, assistant_only_loss=True, max_length_policy="drop")
    monkeypatch.setattr(documents, "ENDLESS_DROPS", 20)  # the same rule, sooner
    with pytest.raises(ConfigError, match=r"the first 20 sessions are all longer than max_length 64 .*"
                                          r"raise max_length or use max_length_policy truncate"):
        build_sequences(cfg, tok)
    kept = build_sequences(TrainConfig(max_length=64, dataset_name=source, assistant_only_loss=True), tok)
    assert len(kept) > 0  # truncate (the default) keeps them
