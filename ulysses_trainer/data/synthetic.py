"""Deterministic synthetic long documents with long-range structure (no network, no third-party text).

Each document opens with a ledger of key–value pairs ("The code of Velmora is 4821."), continues
with filler prose from a small hand-written grammar, and closes by recalling every pair in a new
order ("Question: what is the code of Velmora? Answer: 4821."). Predicting the recalled values needs
attention back to the top of the document, so the loss can keep falling only if attention really
spans the sequence. Everything derives from one integer seed.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

_SYLLABLES = ("ka", "lo", "mi", "ver", "dan", "sul", "tor", "bre", "nix", "qua", "fel", "ro", "zan", "pim",
              "gar", "oth", "wen", "lu", "sab", "dre", "cor", "jin", "hal", "mev")
_ADJECTIVES = ("quiet", "narrow", "bright", "heavy", "distant", "early", "patient", "hollow", "gentle",
               "crooked", "steady", "pale", "restless", "warm", "plain", "silver", "careful", "broad")
_NOUNS = ("river", "lantern", "market", "engine", "garden", "harbor", "ladder", "window", "tower",
          "valley", "letter", "bridge", "kettle", "meadow", "signal", "orchard", "cabinet", "island",
          "compass", "wagon")
_VERBS = ("follows", "crosses", "watches", "repairs", "carries", "finds", "measures", "passes", "guards",
          "circles", "reaches", "paints", "counts", "opens", "leaves", "builds")
_PREPOSITIONS = ("near", "beyond", "under", "behind", "beside", "above", "toward", "around")
_ADVERBS = ("slowly", "again", "at dawn", "without a sound", "every winter", "by noon", "once more",
            "in turn")
_ATTRIBUTES = ("code", "number", "room", "gate", "badge")


def _name(rng: random.Random) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()


def _sentence(rng: random.Random) -> str:
    subject = f"the {rng.choice(_ADJECTIVES)} {rng.choice(_NOUNS)}"
    obj = f"the {rng.choice(_NOUNS)}"
    form = rng.randrange(3)
    if form == 0:
        text = f"{subject} {rng.choice(_VERBS)} {obj} {rng.choice(_PREPOSITIONS)} the {rng.choice(_NOUNS)}"
    elif form == 1:
        text = f"{subject} {rng.choice(_VERBS)} {obj} {rng.choice(_ADVERBS)}"
    else:
        text = f"{rng.choice(_ADVERBS)}, {subject} {rng.choice(_VERBS)} {obj}"
    return text[0].upper() + text[1:] + "."


def new_facts(rng: random.Random, num_pairs: int) -> dict[str, tuple[str, int]]:
    """`num_pairs` facts {key: (attribute, value)} with distinct keys ("Velmora": ("code", 4821))."""
    pairs: dict[str, tuple[str, int]] = {}
    while len(pairs) < num_pairs:
        pairs.setdefault(_name(rng), (rng.choice(_ATTRIBUTES), rng.randint(1000, 99999)))
    return pairs


def fact_statement(key: str, attr: str, value: int) -> tuple[str, str, str]:
    """The ledger's sentence, cut around its value: ("The code of Velmora is", " 4821", ".")."""
    return f"The {attr} of {key} is", f" {value}", "."


def fact_question(key: str, attr: str, value: int) -> tuple[str, str, str]:
    """The recall line, cut around its answer: ("Question: what is the code of Velmora? Answer:", " 4821", ".")."""
    return f"Question: what is the {attr} of {key}? Answer:", f" {value}", "."


def synthetic_document(rng: random.Random, num_words: int, num_pairs: int = 12) -> str:
    """One document of about `num_words` words: ledger, filler, recall (in that order)."""
    pairs = new_facts(rng, num_pairs)
    ledger = " ".join("".join(fact_statement(key, attr, value)) for key, (attr, value) in pairs.items())
    order = list(pairs)
    rng.shuffle(order)
    recall = "\n".join("".join(fact_question(k, *pairs[k])) for k in order)

    paragraphs, words = [], len(ledger.split()) + len(recall.split())
    while words < num_words:
        para = " ".join(_sentence(rng) for _ in range(rng.randint(4, 9)))
        paragraphs.append(para)
        words += len(para.split())
    return "Ledger.\n" + ledger + "\n\n" + "\n\n".join(paragraphs) + "\n\nRecall.\n" + recall


def synthetic_documents(seed: int, mean_words: int) -> Iterator[str]:
    """An endless deterministic stream of documents of 0.5–1.5 × mean_words words."""
    rng = random.Random(seed)
    while True:
        n = max(64, int(mean_words * rng.uniform(0.5, 1.5)))
        yield synthetic_document(rng, n, num_pairs=rng.randint(8, 16))
