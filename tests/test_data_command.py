"""`ulysses-trainer data --json`: the sequences the trainer sees, with trained spans, and their counts."""

import json
import random

from tests.test_conversations import random_conversation
from ulysses_trainer.cli.data import main


def _run(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_data_json_trains_every_assistant_content_and_no_other(tmp_path, capsys):
    rng = random.Random(7)
    convs = [random_conversation(rng, n)[0] for n in range(10)]
    path = tmp_path / "c.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in convs))
    out = _run(capsys, ["--dataset_name", str(path), "--max_length", "2048", "--assistant_only_loss", "true",
                        "--show", "10", "--json"])
    assert set(out) == {"sequences", "counts"} and len(out["sequences"]) == 10
    assert out["counts"]["examples_read"] == 10 and out["counts"]["truncated"] == 0
    assert sorted(seq["row"] for seq in out["sequences"]) == list(range(10))  # shown in the training order
    for seq in out["sequences"]:
        m = convs[seq["row"]]
        assert set(seq) == {"row", "segments", "tokens", "trained_tokens"}
        assert all(set(g) == {"text", "trained"} for g in seq["segments"])
        trained = [g["text"] for g in seq["segments"] if g["trained"]]
        other = "".join(g["text"] for g in seq["segments"] if not g["trained"])
        assert seq["trained_tokens"] > 0
        for msg in m:
            if msg["role"] == "assistant":
                assert any(msg["content"].strip() in t for t in trained), msg
            else:
                tag = msg["content"].split()[0]
                assert not any(tag in t for t in trained) and tag in other, msg
    assert out["counts"]["trained_tokens"] == sum(s["trained_tokens"] for s in out["sequences"])


def test_data_prompt_completion_and_refusal(tmp_path, capsys):
    path = tmp_path / "pc.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"PROMPT{i} says", "completion": f" DONE{i}"}) + "\n"
                            for i in range(3)))
    out = _run(capsys, ["--dataset_name", str(path), "--max_length", "64", "--json"])
    for seq in out["sequences"]:
        i = seq["row"]
        assert [g for g in seq["segments"] if g["trained"]] == [{"text": f" DONE{i}<|endoftext|>", "trained": True}]
    assert main(["--dataset_name", str(path), "--dataset_text_field", "completion"]) == 2
    assert "would drop the other one" in capsys.readouterr().err
