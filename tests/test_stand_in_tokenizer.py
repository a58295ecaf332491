"""A preset whose vocabulary is smaller than Qwen's (Llama-3.1's 128,256) is tokenized with a stand-in: the Qwen BPE
truncated to its first 128,000 ranks, Llama 3's special tokens at Llama 3's ids. Its ids fit the preset's embedding
on text and chat data, its two encoders (tiktoken for documents, transformers for templates) agree, text
round-trips, and the Llama-3.1-8B 1M recipe plans and prepares its data through it. Every other family whose
vocabulary is not Qwen's takes its own stand-in the same way, the larger ones (Gemma 3's, gpt-oss's) holding the whole
BPE below their specials, with their chat formats."""

from __future__ import annotations

import functools
import json
import random
import unicodedata
from pathlib import Path

import pytest

from ulysses_trainer.__main__ import main as cli_main
from ulysses_trainer.cli.argv import load_config
from ulysses_trainer.data.documents import build_sequences
from ulysses_trainer.data.stand_in_bpe import STAND_INS
from ulysses_trainer.data.synthetic import synthetic_documents
from ulysses_trainer.data.tokenizer import check_tokenizer_fits, family_vocabulary, preset_tokenizer
from ulysses_trainer.errors import ConfigError
from ulysses_trainer.families import family
from ulysses_trainer.model.load import model_config_for
from ulysses_trainer.parallel.sharding import IGNORE_INDEX

RECIPE = str(Path(__file__).resolve().parent.parent / "launch" / "recipes" / "llama_3_1_8b_8gpu_1m.yaml")
BPE = STAND_INS["llama3"].ranks  # 128,000: ids below are BPE tokens, those from here Llama 3's specials
LLAMA3_IDS = {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001, "<|finetune_right_pad_id|>": 128004,
              "<|start_header_id|>": 128006, "<|end_header_id|>": 128007, "<|eot_id|>": 128009,
              "<|reserved_special_token_247|>": 128255}


@pytest.fixture(scope="module")
def tok():
    return preset_tokenizer("llama3")


def _texts() -> list[str]:
    """Synthetic documents, scripts and emoji, and random code points (every byte-level path of the BPE)."""
    rng = random.Random(0)
    docs = synthetic_documents(0, 300)
    texts = [next(docs) for _ in range(3)]
    texts += ["naïve café — Größe, 日本語のテキスト, 한국어, عربي, emoji 🙂👩🏽‍💻, tabs\t\tand\r\nnewlines  ",
              "".join(chr(c) for c in (rng.randrange(0x20, 0x2FFFF) for _ in range(2000))
                      if not 0xD800 <= c < 0xE000),  # no lone surrogates: not text
              bytes(rng.randrange(256) for _ in range(3000)).decode("utf-8", errors="replace")]
    return texts


def test_the_llama_preset_takes_the_stand_in_with_llama3s_specials_at_llama3s_ids(tok):
    model = model_config_for(load_config(["--config", RECIPE]))
    assert family_vocabulary(family("llama"), model) == "llama3"
    tiny = model_config_for(load_config(["--model_name_or_path", "tiny-llama"]))
    assert family_vocabulary(family("llama"), tiny) == "qwen3"  # its embedding holds the Qwen BPE's ids
    hf = tok.hf_tokenizer
    assert {t: hf.convert_tokens_to_ids(t) for t in LLAMA3_IDS} == LLAMA3_IDS
    assert tok.vocab_size == model.vocab_size == 128256 and len(hf.get_vocab()) == 128256
    assert (tok.eos_token_id, hf.bos_token_id) == (model.eos_token_id, model.bos_token_id) == (128001, 128000)
    assert "stand-in" in tok.name and "128,000 ranks" in tok.name and "Llama 3" in tok.name
    check_tokenizer_fits(tok, model)


def test_both_encoders_agree_emit_only_bpe_ids_and_round_trip(tok):
    hf = tok.hf_tokenizer
    for text in _texts():
        ids = tok.encode(text)
        assert ids == hf(text, add_special_tokens=False)["input_ids"]  # tiktoken's ids are transformers'
        assert max(ids) < BPE  # plain text: never a special id, never one past the truncation
        assert tok.decode(ids) == unicodedata.normalize("NFC", text)
    assert tok.encode_batch(_texts()[:2]) == [tok.encode(t) for t in _texts()[:2]]
    assert tok.encode("a<|eot_id|>b")[1] == 128009  # as the transformers tokenizer matches specials in text


@pytest.mark.parametrize("data", [(), ("--dataset_name", "synthetic:agent_sessions", "--assistant_only_loss", "true")],
                         ids=["synthetic text", "chat"])
def test_the_recipes_data_fits_the_presets_embedding(tok, data):
    cfg = load_config(["--config", RECIPE, "--max_length", "8192", *data])
    ds = build_sequences(cfg, tok, split="train", dp_size=1, num_sequences=2)
    for i in range(len(ds)):
        ids = ds[i]["input_ids"][:ds.real_tokens(i)]
        assert int(ids.max()) < 128256 and int(ids.min()) >= 0
        specials = {int(x) for x in ids[ids >= BPE]}
        assert specials <= ({128001} if not data else {128000, 128006, 128007, 128009})
    if data:  # Llama 3's chat format: bos, headers, an <|eot_id|> after each turn, the answers trained
        row = ds[0]["input_ids"][:ds.real_tokens(0)].tolist()
        assert row[:2] == [128000, 128006] and 128009 in row and ds.counts.to_dict()["trained_tokens"] > 0


def test_the_recipe_plans_on_8_h100s(capsys):
    rc = cli_main(["plan", "--config", RECIPE, "--gpus", "8", "--gpu", "h100", "--host_memory_gb", "2000"])
    out = capsys.readouterr().out
    assert rc == 0 and "llama-3.1-8b, max_length 1,048,576" in out and "sp 8 x dp 1" in out


def test_an_export_carries_the_stand_in_as_a_checkpoints_tokenizer(tok, tmp_path):
    """save_pretrained writes what AutoTokenizer loads back: the same ids, specials and chat template."""
    from ulysses_trainer.data.tokenizer import load_tokenizer

    tok.save_pretrained(str(tmp_path))
    back = load_tokenizer(str(tmp_path))
    text = _texts()[3]
    assert back.encode(text) == tok.encode(text) and back.vocab_size == 128256 and back.eos_token_id == 128001
    assert back.hf_tokenizer.chat_template == tok.hf_tokenizer.chat_template
    assert back.hf_tokenizer.convert_tokens_to_ids("<|eot_id|>") == 128009


@functools.cache
def _stand_in(vocabulary: str):
    """One build of each stand-in for the tests below (its truncation takes seconds)."""
    return preset_tokenizer(vocabulary)


@pytest.mark.parametrize("preset, stand_in", [("mistral-small-24b", "mistral_tekken"), ("mixtral-8x7b", "llama2"),
                                              ("phi-3.5-mini", "phi3"), ("granite-3.1-8b", "granite3"),
                                              ("olmo-2-7b", "olmo2"), ("gemma-3-27b", "gemma3"),
                                              ("gpt-oss-20b", "o200k_harmony"), ("gpt-oss-120b", "o200k_harmony")])
def test_every_preset_whose_vocabulary_is_not_qwens_takes_its_familys_stand_in(preset, stand_in):
    """Its specials at the family's ids (the preset's bos / eos / pad among them), the BPE's ids around them: text
    encodes to neither a special nor an id past the embedding, both encoders alike, and round-trips. A vocabulary
    larger than Qwen's (Gemma 3's, gpt-oss's) holds all the BPE's ranks, the ids past them unused."""
    model = model_config_for(load_config(["--model_name_or_path", preset]))
    assert family_vocabulary(family(model.model_type), model) == stand_in
    tok = _stand_in(stand_in)
    hf, spec = tok.hf_tokenizer, STAND_INS[stand_in]
    assert {t: hf.convert_tokens_to_ids(t) for _, t in spec.specials} == {t: i for i, t in spec.specials}
    assert tok.vocab_size == model.vocab_size and tok.eos_token_id == model.eos_token_id
    for role in ("bos", "pad"):  # where the preset names one
        if getattr(model, f"{role}_token_id", None) is not None:
            assert getattr(hf, f"{role}_token_id") == getattr(model, f"{role}_token_id"), role
    check_tokenizer_fits(tok, model)
    specials = {i for i, _ in spec.specials}
    for text in _texts()[2:] + ["<s>[INST] hi [/INST]</s>"]:  # specials: their ids
        ids = tok.encode(text)
        assert ids == hf(text, add_special_tokens=False)["input_ids"] and max(ids) < model.vocab_size
        if "<s>" not in text:
            assert not specials & set(ids) and tok.decode(ids) == unicodedata.normalize("NFC", text)
    if spec.template is None:  # no chat format of its own here: chat data is refused naming the fix
        cfg = load_config(["--model_name_or_path", preset, "--max_length", "2048", "--dataset_name",
                           "synthetic:agent_sessions"])
        with pytest.raises(ConfigError, match="no chat template to render conversations with; point "
                                              "model_name_or_path at a checkpoint"):
            build_sequences(cfg, tok, split="train", dp_size=1, num_sequences=1)


# The published tokenizers' special tokens (a sample of each: the named ones, the ends of a reserved range), written
# out apart from STAND_INS: Llama 3.1's tokenizer.json added_tokens, mistral-common's Tekken controls (20 named, then
# <SPECIAL_n> to 999, the BPE from 1000), Llama 2's SentencePiece, Phi-3's added tokens (torchtune's Phi-3 table),
# Granite 3's (StarCoder's at 1-18, its role tokens after the 49,152 BPE ids), dolma2's (tiktoken's cl100k_base
# specials and OLMo's <|pad|>), Gemma 3's (its controls, [multimodal] at 5 and <unused0> from 6 as
# google-deepmind/gemma's gm.text.Gemma3Tokenizer lists them, <unused0>-<unused98>, turn and image tokens; its
# reserved <unused99>+ at 256001-262143 not among the stand-in's), o200k_harmony's (tiktoken's: its named tokens,
# the reserved ones around them, o200k_base's <|endofprompt|> at 200018)
PUBLISHED = {
    "llama3": {"<|begin_of_text|>": 128000, "<|end_of_text|>": 128001, "<|reserved_special_token_0|>": 128002,
               "<|finetune_right_pad_id|>": 128004, "<|reserved_special_token_2|>": 128005,
               "<|start_header_id|>": 128006, "<|end_header_id|>": 128007, "<|eom_id|>": 128008, "<|eot_id|>": 128009,
               "<|python_tag|>": 128010, "<|reserved_special_token_3|>": 128011,
               "<|reserved_special_token_247|>": 128255},
    "mistral_tekken": {"<unk>": 0, "<s>": 1, "</s>": 2, "[INST]": 3, "[/INST]": 4, "[AVAILABLE_TOOLS]": 5,
                       "[TOOL_CALLS]": 9, "<pad>": 11, "[SYSTEM_PROMPT]": 17, "[/SYSTEM_PROMPT]": 18,
                       "[TOOL_CONTENT]": 19, "<SPECIAL_20>": 20, "<SPECIAL_999>": 999},
    "llama2": {"<unk>": 0, "<s>": 1, "</s>": 2},
    "phi3": {"<unk>": 0, "<s>": 1, "</s>": 2, "<|endoftext|>": 32000, "<|assistant|>": 32001,
             "<|placeholder1|>": 32002, "<|placeholder4|>": 32005, "<|system|>": 32006, "<|end|>": 32007,
             "<|placeholder5|>": 32008, "<|placeholder6|>": 32009, "<|user|>": 32010},
    "granite3": {"<|end_of_text|>": 0, "<fim_prefix>": 1, "<fim_middle>": 2, "<fim_suffix>": 3, "<reponame>": 18,
                 "<|start_of_role|>": 49152, "<|end_of_role|>": 49153, "<|tool_call|>": 49154},
    "olmo2": {"<|endoftext|>": 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259, "<|fim_suffix|>": 100260,
              "<|endofprompt|>": 100276, "<|pad|>": 100277},
    "gemma3": {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<mask>": 4, "[multimodal]": 5, "<unused0>": 6,
               "<unused98>": 104,
               "<start_of_turn>": 105, "<end_of_turn>": 106, "<start_of_image>": 255999, "<end_of_image>": 256000,
               "<image_soft_token>": 262144},
    "o200k_harmony": {"<|startoftext|>": 199998, "<|endoftext|>": 199999, "<|reserved_200000|>": 200000,
                      "<|return|>": 200002, "<|constrain|>": 200003, "<|channel|>": 200005, "<|start|>": 200006,
                      "<|end|>": 200007, "<|message|>": 200008, "<|call|>": 200012, "<|reserved_200013|>": 200013,
                      "<|endofprompt|>": 200018, "<|reserved_201087|>": 201087},
}
# (specials, the first id of the BPE's ranks) of each published vocabulary
PUBLISHED_LAYOUT = {"llama3": (256, 0), "mistral_tekken": (1000, 1000), "llama2": (3, 3), "phi3": (14, 3),
                    "granite3": (22, 19), "olmo2": (6, 0), "gemma3": (110, 107), "o200k_harmony": (1090, 0)}
# the presets' config.json ids (bos, eos, pad; None: the published config sets none), as the published configs have them
PRESET_IDS = {"llama-3.1-8b": (128000, 128001, None), "mistral-small-24b": (1, 2, None), "mixtral-8x7b": (1, 2, None),
              "phi-3.5-mini": (1, 32000, 32000), "granite-3.1-8b": (0, 0, 0), "olmo-2-7b": (None, 100257, 100277),
              "gemma-3-27b": (2, 1, 0), "gpt-oss-20b": (None, 200002, 199999), "qwen2.5-7b": (151643, 151643, None)}


@pytest.mark.parametrize("vocabulary", list(PUBLISHED))
def test_each_stand_ins_special_tokens_are_the_published_tokenizers(vocabulary):
    """Every special token the published tokenizer has, at its id (the sample above), no other specials, and the
    BPE's ranks starting where the published BPE's do: a chat template's tokens and a config's ids mean the same
    in the stand-in as in the checkpoint's own tokenizer."""
    spec = STAND_INS[vocabulary]
    specials = {text: i for i, text in spec.specials}
    assert {t: specials.get(t) for t in PUBLISHED[vocabulary]} == PUBLISHED[vocabulary]
    assert len(specials) == len(spec.specials) == PUBLISHED_LAYOUT[vocabulary][0]  # one id per text
    assert spec.bpe_ids()[0] == PUBLISHED_LAYOUT[vocabulary][1]
    for role in ("bos", "eos", "pad"):
        assert getattr(spec, role) is None or getattr(spec, role) in specials, role


@pytest.mark.parametrize("preset", list(PRESET_IDS))
def test_each_presets_token_ids_are_its_published_configs(preset):
    model = model_config_for(load_config(["--model_name_or_path", preset]))
    assert tuple(getattr(model, f"{r}_token_id", None) for r in ("bos", "eos", "pad")) == PRESET_IDS[preset]


CHATS = [[{"role": "system", "content": "kilo lima"}, {"role": "user", "content": "alpha bravo"},
          {"role": "assistant", "content": "charlie delta echo"}, {"role": "user", "content": "foxtrot"},
          {"role": "assistant", "content": "golf hotel"}],
         [{"role": "user", "content": "india"}, {"role": "assistant", "content": "juliet mike"}]]
# each family's chat format: (the markers its template writes, what TRL's training variant trains of an answer: the
# text before it, after it, and after the last one)
CHAT_FORMATS = {
    "gemma-3-27b": ("gemma3", ("<bos>", "<start_of_turn>", "<end_of_turn>"), "", "<end_of_turn>\n",
                    "<end_of_turn>\n"),
    "gpt-oss-20b": ("o200k_harmony", ("<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>"),
                    "<|start|>assistant<|channel|>final<|message|>", "<|end|>", "<|return|>"),
}


def _chats(tmp_path: Path) -> str:
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS))
    return str(path)


@pytest.mark.parametrize("tiny, big", [("tiny-gemma3", "gemma-3-27b"), ("tiny-gpt-oss", "gpt-oss-20b")])
def test_a_larger_stand_in_is_taken_only_by_an_embedding_that_holds_its_ids(tiny, big):
    """The tiny presets (the Qwen BPE's 151,936 rows) and any embedding short of the stand-in's ids keep the Qwen
    BPE; the published shape takes the stand-in."""
    for preset, rows, want in ((tiny, None, "qwen3"), (big, 200_000, "qwen3"), (big, None, None)):
        model = model_config_for(load_config(["--model_name_or_path", preset]))
        model.vocab_size = rows or model.vocab_size
        fam = family(model.model_type)
        assert family_vocabulary(fam, model) == (want or fam.stand_in), (preset, rows)
        assert want or STAND_INS[fam.stand_in].vocab_size == model.vocab_size


@pytest.mark.parametrize("preset", list(CHAT_FORMATS))
def test_a_larger_vocabularys_stand_in_renders_its_familys_chat_format_and_trains_only_the_answers(preset, tmp_path):
    """Gemma 3's and gpt-oss's presets render conversations with their family's template (TRL's training variant):
    each marker is one special id at its published id, every id is below the preset's vocab_size, and
    assistant_only_loss trains exactly each answer's span as the template's generation markers give it."""
    model = model_config_for(load_config(["--model_name_or_path", preset]))
    vocabulary, markers, before, end, last_end = CHAT_FORMATS[preset]
    assert family_vocabulary(family(model.model_type), model) == vocabulary
    tok = _stand_in(vocabulary)
    marker_ids = {m: tok.hf_tokenizer.convert_tokens_to_ids(m) for m in markers}
    assert marker_ids == {m: PUBLISHED[vocabulary][m] for m in markers}
    cfg = load_config(["--model_name_or_path", preset, "--dataset_name", _chats(tmp_path), "--max_length", "512",
                       "--assistant_only_loss", "true"])
    ds = build_sequences(cfg, tok, split="train", dp_size=1)
    assert len(ds) == len(CHATS)
    for i, msgs in enumerate(CHATS):
        n = ds.real_tokens(i)
        ids, labels = ds[i]["input_ids"][:n], ds[i]["labels"][:n]
        assert int(ids.max()) < model.vocab_size and int(ids.min()) >= 0
        text = tok.hf_tokenizer.apply_chat_template(msgs, tokenize=False)
        for marker, mid in marker_ids.items():  # every marker the template wrote is its one id, none left as text
            assert int((ids == mid).sum()) == text.count(marker), marker
        specials = {i for i, _ in STAND_INS[vocabulary].specials}
        assert {int(x) for x in ids} & specials == set(marker_ids.values())  # no other special: text is BPE ids
        answers = [m["content"] for m in msgs if m["role"] == "assistant"]
        want = [t for k, a in enumerate(answers)
                for t in tok.encode(before + a + (last_end if k == len(answers) - 1 else end))]
        assert ids[labels != IGNORE_INDEX].tolist() == want, preset
        untrained = tok.decode(ids[labels == IGNORE_INDEX].tolist())
        assert all(m["content"] in untrained for m in msgs if m["role"] == "user")


@pytest.mark.parametrize("preset, name", [("gemma-3-27b", "Gemma 3's special tokens at 0-106, 255999-256000, 262144"),
                                          ("gpt-oss-20b", "gpt-oss o200k_harmony's special tokens at 199998-201087")])
def test_the_data_command_names_a_larger_vocabularys_stand_in(preset, name, tmp_path, capsys):
    """`ulysses-trainer data` on the preset's chat data: its counts name the stand-in that tokenized them."""
    from ulysses_trainer.cli.data import main as data_main

    assert data_main(["--model_name_or_path", preset, "--dataset_name", _chats(tmp_path), "--max_length", "256",
                      "--assistant_only_loss", "true", "--json"]) == 0
    counts = json.loads(capsys.readouterr().out)["counts"]
    assert "stand-in" in counts["tokenizer"] and name in counts["tokenizer"], counts["tokenizer"]
    assert counts["trained_tokens"] > 0
