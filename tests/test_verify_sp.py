"""verify_sp (train/verify_sp.py): the parallelized model against stock transformers on the first row, with ranks as
threads (tests/threaded_ranks.py) running the real all-to-alls. The real families pass at sp 2 and 4; a wrong shard
planted in one layer type's attention (forward, or backward only) is caught and the line names that layer type,
and through the real command on 2 gloo ranks it is exit 2 before step 1 with nothing written; auto is off at
resume. The first step's loss with the check on and off: tests/test_train_runs.py, tests/test_e2e_train.py."""

from __future__ import annotations

import pytest
import torch

from tests.test_qwen3_5 import build as build_preset
from tests.test_sp_exact import build_model as build_qwen3
from tests.threaded_ranks import run_threads
from ulysses_trainer.errors import ConfigError
from ulysses_trainer.train.verify_sp import VerifySpError, first_row_cut, run_check, verify_due

MECHANISMS = dict(attn_implementation="sdpa", loss_chunk_size=7, tiled_mlp=2, gradient_checkpointing=True)


def _row(length: int, vocab: int, docs: list[int] | None = None, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (length,), generator=g)
    pos = torch.cat([torch.arange(n) for n in docs]) if docs else torch.arange(length)
    labels = ids.clone()
    labels[:5] = -100  # a prompt: untrained
    return {"input_ids": ids, "position_ids": pos, "labels": labels, "real_tokens": length}


def _check(source, build, row, sp_size: int):
    """run_check on every rank (threads); [result or the exception] per rank."""
    from ulysses_trainer import ParallelizeConfig, make_parallel_state

    def rank(r: int, world_size: int):
        state = make_parallel_state(world_size)
        try:
            return run_check(source, build, ParallelizeConfig(**MECHANISMS), state, row, bf16=False,
                             pad_to_multiple_of=None, max_length=4096, device=torch.device("cpu"))
        except VerifySpError as exc:
            return exc

    return run_threads(sp_size, rank)


@pytest.mark.parametrize("family, sp_size, docs", [("qwen3", 2, [20, 31, 13]), ("qwen3", 4, None),
                                                   ("tiny-qwen3.5-moe", 2, [30, 34])])
def test_the_real_families_pass(family, sp_size, docs):
    build = build_qwen3 if family == "qwen3" else (lambda: build_preset(family, seed=1))
    source = build()
    out = _check(source, build, _row(64, 503, docs), sp_size)
    for result in out:
        assert not isinstance(result, Exception), result
        assert abs(result.loss - result.ref_loss) <= 1e-5 * abs(result.ref_loss)
        assert abs(result.grad_norm - result.ref_grad_norm) <= 1e-5 * result.ref_grad_norm
        assert result.worst <= 1e-5 and result.tokens == 64
    assert out[0].line().startswith(f"verify_sp: loss {out[0].loss:.8g} vs {out[0].ref_loss:.8g}, grad norm ")


@pytest.mark.parametrize("world, sp_size", [(2, 1), (4, 2)])
def test_data_parallel_ranks_each_check_their_own_row(world, sp_size):
    """dp ranks verify their own rows: no number is summed over the dp ranks (sp 1's group is the world's None)."""
    from ulysses_trainer import ParallelizeConfig, make_parallel_state

    source = build_qwen3()

    def rank(r: int, world_size: int):
        state = make_parallel_state(sp_size)
        row = _row(64, 503, seed=state.dp_rank)  # each dp rank its own row, as the trainer gives it
        return run_check(source, build_qwen3, ParallelizeConfig(**MECHANISMS), state, row, bf16=False,
                         pad_to_multiple_of=None, max_length=4096, device=torch.device("cpu"))

    out = run_threads(world, rank)
    for result in out:
        assert abs(result.loss - result.ref_loss) <= 1e-5 * abs(result.ref_loss)
        assert abs(result.grad_norm - result.ref_grad_norm) <= 1e-5 * result.ref_grad_norm
    assert out[0].ref_loss != out[-1].ref_loss  # the dp ranks did check different rows



MOE_PRESETS = {"tiny-moe", "tiny-mixtral", "tiny-qwen2-moe", "tiny-gpt-oss"}


def _tiny_presets() -> list[str]:
    from ulysses_trainer.families import FAMILIES

    return [next(p for p in f.presets if p.startswith("tiny")) for f in FAMILIES.values()]


@pytest.mark.parametrize("sp_size", [2, 4])
@pytest.mark.parametrize("preset", _tiny_presets())
def test_every_familys_tiny_preset_passes(preset, sp_size):
    """Every family at sp 2 and 4 (KV heads split, and replicated where the preset has fewer than 4) on a packed row;
    the MoE ones (but Qwen3.5's, built as above) with their routers drawn wide and the load-balancing loss on,
    gpt-oss eager (its sinks)."""
    from tests.test_moe_families import build as build_moe

    def build():
        return (build_moe if preset in MOE_PRESETS else build_preset)(preset, seed=1, pad_token_id=0)

    out = _check(build(), build, _row(64, 503, [30, 34]), sp_size)
    for result in out:
        assert not isinstance(result, Exception), result
        assert abs(result.loss - result.ref_loss) <= 1e-5 * abs(result.ref_loss)
        assert abs(result.grad_norm - result.ref_grad_norm) <= 1e-5 * result.ref_grad_norm
        assert result.worst <= 1e-5 and result.tokens == 64


def _shift_rank_1(x: torch.Tensor) -> torch.Tensor:
    """Rank 1's sequence shard rolled by one token: a wrong shard that keeps every shape."""
    import torch.distributed as dist

    return x.roll(1, dims=1) if dist.get_rank() == 1 else x


class _WrongGradient(torch.autograd.Function):
    """Identity forward; rank 1's gradient rolled by one token in backward only."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return _shift_rank_1(g)


@pytest.mark.parametrize("family, backward_only, layer_type", [
    ("qwen3", False, "Qwen3Attention"),
    ("qwen3", True, "Qwen3Attention"),
    ("tiny-qwen3.5", False, "Qwen3_5Attention"),  # its full-attention layers come after three DeltaNet layers
])
def test_a_wrong_shard_in_one_layer_type_is_caught_and_named(monkeypatch, family, backward_only, layer_type):
    import ulysses_trainer.parallel.ulysses as ulysses

    real = ulysses.heads_to_seq  # the attention output's all-to-all (the full-attention layers only)

    def planted(x, sp_size, group):
        out = real(x, sp_size, group)  # [b, s/sp, h, d]
        return _WrongGradient.apply(out) if backward_only else _shift_rank_1(out)

    monkeypatch.setattr(ulysses, "heads_to_seq", planted)
    build = build_qwen3 if family == "qwen3" else (lambda: build_preset(family, seed=1))
    out = _check(build(), build, _row(64, 503), 2)
    for exc in out:
        assert isinstance(exc, VerifySpError) and isinstance(exc, ConfigError)  # exit 2, one line
        msg = str(exc)
        assert "\n" not in msg and msg.startswith("verify_sp: the parallelized model differs")
        assert f"of {layer_type} (" in msg, msg
        assert ("in backward" in msg) == backward_only, msg
        if family == "tiny-qwen3.5":
            assert "model.layers.3.self_attn" in msg, msg  # the first full-attention layer, not a DeltaNet one
    assert str(out[0]) == str(out[1])  # every rank stops with the same line


def test_the_check_leaves_the_source_weights_and_the_rng_as_they_were():
    source = build_qwen3()
    before = {n: p.detach().clone() for n, p in source.named_parameters()}
    from ulysses_trainer import ParallelizeConfig
    from ulysses_trainer.parallel.state import single_process_state

    rng = torch.get_rng_state()  # one rank (threads share the process's RNG): the factory seeds it, the check restores
    result = run_check(source, build_qwen3, ParallelizeConfig(**MECHANISMS), single_process_state(), _row(64, 503),
                       bf16=False, pad_to_multiple_of=None, max_length=4096, device=torch.device("cpu"))
    assert result.worst <= 1e-5  # sp 1: the mechanisms alone (loss head, lean norms, tiled MLP, checkpointing)
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(p, before[n]) and p.grad is None for n, p in source.named_parameters())


def test_the_cut_is_a_multiple_the_sharding_accepts_and_keeps_a_target():
    row = _row(103, 503)
    ids, labels, pos = first_row_cut(row, 4, 8, 4096)
    assert ids.shape == (1, 96) and torch.equal(ids[0], row["input_ids"][:96])
    row["labels"][:] = -100  # nothing trained in the cut: the check trains every token
    assert torch.equal(first_row_cut(row, 2, None, 4096)[1], first_row_cut(row, 2, None, 4096)[0])
    assert first_row_cut(_row(3, 503), 4, None, 4096) is None  # too short to shard
    assert first_row_cut(row, 1, None, 40)[0].shape == (1, 40)  # at most max_length


def test_auto_is_on_at_the_first_start_and_off_at_resume():
    assert verify_due("auto", resuming=False) and not verify_due("auto", resuming=True)
    assert verify_due(True, resuming=True) and not verify_due(False, resuming=False)


def _planted_rank(rank: int, world_size: int, argv: list[str]) -> tuple[int, str]:
    """The real command's main on this rank, rank 1's attention output shard rolled by one token."""
    import ulysses_trainer.parallel.ulysses as ulysses
    from tests.dist_utils import main_captured

    real = ulysses.heads_to_seq
    ulysses.heads_to_seq = lambda x, sp_size, group: _shift_rank_1(real(x, sp_size, group))
    return main_captured(argv)


@pytest.mark.slow
def test_the_real_command_stops_a_wrong_shard_before_step_1_with_exit_2(tmp_path):
    from tests.dist_utils import run_ranks
    from tests.tiny_checkpoint import write_checkpoint, write_documents

    model = write_checkpoint(tmp_path / "model")
    docs = write_documents(tmp_path / "docs.jsonl", num_docs=40, words_per_doc=31)
    out = tmp_path / "run"
    argv = ["--model_name_or_path", str(model), "--dataset_name", str(docs), "--max_length", "32", "--bf16",
            "false", "--max_steps", "2", "--sp_size", "2", "--output_dir", str(out)]
    (c0, e0), (c1, e1) = run_ranks(2, _planted_rank, argv)
    assert (c0, c1) == (2, 2), e0 + e1
    errors = [line for line in e0.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and "Traceback" not in e0 + e1, e0[-3000:]
    assert errors[0].startswith("error: verify_sp: the parallelized model differs") and "of Qwen3Attention (" in \
        errors[0], errors[0]
    assert not (out / "metrics.jsonl").exists() and not list(out.glob("*checkpoint*")) and not (out / "final").exists()


def _no_room_rank(rank: int, world_size: int, argv: list[str]) -> tuple[int, str]:
    """As _planted_rank, on a rank whose memory has no room for the check's copy of the model."""
    import contextlib
    import io

    import ulysses_trainer.train.verify_sp_run as verify_sp_run

    verify_sp_run.free_memory_bytes = lambda device: 1024
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code, err = _planted_rank(rank, world_size, argv)
    return code, out.getvalue() + err


@pytest.mark.slow
def test_auto_skips_where_the_copy_does_not_fit_and_true_insists(tmp_path):
    """A copy of the model and its gradients is whole on every rank: `auto` says it skips where it would not fit
    (the wrong shard then goes unseen: the line is the user's warning), `true` runs it all the same and stops."""
    from tests.dist_utils import run_ranks
    from tests.tiny_checkpoint import write_checkpoint, write_documents

    model = write_checkpoint(tmp_path / "model")
    docs = write_documents(tmp_path / "docs.jsonl", num_docs=40, words_per_doc=31)
    base = ["--model_name_or_path", str(model), "--dataset_name", str(docs), "--max_length", "32", "--bf16",
            "false", "--max_steps", "1", "--sp_size", "2", "--save_strategy", "no"]
    (c0, o0), (c1, _) = run_ranks(2, _no_room_rank, [*base, "--output_dir", str(tmp_path / "auto")])
    assert (c0, c1) == (0, 0), o0[-3000:]
    assert "verify_sp: skipped: a copy of the model and its gradients" in o0 and "verify_sp true insists" in o0
    (c0, o0), (c1, _) = run_ranks(2, _no_room_rank, [*base, "--verify_sp", "true",
                                                     "--output_dir", str(tmp_path / "true")])
    assert (c0, c1) == (2, 2) and "error: verify_sp: the parallelized model differs" in o0, o0[-3000:]
