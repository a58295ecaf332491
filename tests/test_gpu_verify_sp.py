"""verify_sp (train/verify_sp.py) on a GPU: two SP ranks as threads on one card, in bf16, through each attention
kernel installed there (cuDNN SDPA, flash-attn-4), Liger's norms, and for Qwen3.5 fla's DeltaNet kernels. The real
families pass within the contract's bf16 tolerances against stock transformers on the same card; a wrong shard
planted in the attention output's all-to-all is caught and names the layer type. The CPU twin:
tests/test_verify_sp.py."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest
import torch

from tests.threaded_ranks import run_threads

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

LENGTH, VOCAB = 2048, 1024


def _kernels() -> list[str]:
    from ulysses_trainer.attention.kernels import available_kernels

    return [k for k in ("sdpa", "flash_attention_4") if k in available_kernels()]


def _qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=128, max_position_embeddings=LENGTH)
    return Qwen3ForCausalLM(config).to("cuda", torch.bfloat16)


def _qwen3_5():
    from tests.test_qwen3_5 import build

    return build("tiny-qwen3.5", seed=1, vocab=VOCAB).to("cuda", torch.bfloat16)


def _row(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (LENGTH,), generator=g)
    docs = [700, 1000, 348]  # packed: three documents, none crossing another
    labels = ids.clone()
    labels[:16] = -100
    return {"input_ids": ids, "position_ids": torch.cat([torch.arange(n) for n in docs]), "labels": labels,
            "real_tokens": LENGTH}


@contextlib.contextmanager
def _autotune_one_at_a_time() -> Iterator[None]:
    """Triton's autotuner keeps a launch's arguments on the kernel object while it benchmarks, so two rank threads
    tuning one kernel at once break it (fla's conv on an H100: `'NoneType' object is not a mapping` in
    Autotuner.run); a trainer's ranks are processes. Here the autotuned launches go one at a time (they are
    asynchronous: the threads still overlap on the card)."""
    try:
        from triton.runtime.autotuner import Autotuner
    except ImportError:
        yield
        return
    lock, run = threading.RLock(), Autotuner.run

    def serial(self, *args, **kwargs):
        with lock:
            return run(self, *args, **kwargs)

    Autotuner.run = serial
    try:
        yield
    finally:
        Autotuner.run = run


def _check(build, kernel: str):
    """run_check on 2 SP ranks (threads) on this card: [result or VerifySpError] per rank."""
    from ulysses_trainer import ParallelizeConfig, make_parallel_state
    from ulysses_trainer.train.verify_sp import VerifySpError, run_check

    source = build()
    mechanisms = ParallelizeConfig(attn_implementation=kernel, loss_chunk_size=256, tiled_mlp=2,
                                   gradient_checkpointing=True, norm_kernel="auto", deltanet_kernel="auto")

    # torch starts CUDA's linear algebra lazily and refuses two threads starting it at once ("lazy wrapper should
    # be called at most once"; the torch DeltaNet kernel's triangular solves): start it here, as ranks are processes
    eye = torch.eye(2, device="cuda")
    torch.linalg.solve_triangular(eye, eye, upper=False)

    def rank(r: int, world_size: int):
        state = make_parallel_state(world_size)
        try:
            return run_check(source, build, mechanisms, state, _row(), bf16=True, pad_to_multiple_of=None,
                             max_length=LENGTH, device=torch.device("cuda"))
        except VerifySpError as exc:
            return exc

    with _autotune_one_at_a_time():
        return run_threads(2, rank, timeout=600.0)


@pytest.mark.parametrize("kernel", _kernels())
@pytest.mark.parametrize("family", ["qwen3", "qwen3.5"])
def test_the_real_families_pass_on_the_card(family, kernel):
    out = _check(_qwen3 if family == "qwen3" else _qwen3_5, kernel)
    for result in out:
        assert not isinstance(result, Exception), result
        assert result.tokens == LENGTH
    print(f"{family} {kernel} on {torch.cuda.get_device_name()}: {out[0].line()} ({out[0].seconds:.2f} s)")


@pytest.mark.parametrize("kernel", _kernels())
def test_a_wrong_shard_is_caught_on_the_card(monkeypatch, kernel):
    import torch.distributed as dist

    import ulysses_trainer.parallel.ulysses as ulysses

    real = ulysses.heads_to_seq

    def planted(x, sp_size, group):
        out = real(x, sp_size, group)  # [b, s/sp, h, d]
        return out.roll(1, dims=1) if dist.get_rank() == 1 else out  # rank 1's shard one token off

    monkeypatch.setattr(ulysses, "heads_to_seq", planted)
    out = _check(_qwen3, kernel)
    assert all(type(e).__name__ == "VerifySpError" for e in out), out
    assert "Qwen3Attention" in str(out[0])
