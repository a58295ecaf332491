"""Checkpointing with offload of layer inputs: policy, host pool, and exactness against no checkpointing."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from torch import nn

from tests.dist_utils import JOB_TIMEOUT_S, run_ranks, stock_zero3_step
from ulysses_trainer.errors import ConfigError
from ulysses_trainer.levers.host_pool import HostPool, detect_host_memory_gb, host_bytes_needed
from ulysses_trainer.levers.recompute import LayerRecompute
from ulysses_trainer.vocabulary.names import GIB

# --------------------------------------------------------------------------------------------
# Policy and arithmetic


def test_configure_sets_thinning_and_the_offloaded_block_starts():
    ck = LayerRecompute(6)
    ck.configure(2, [0, 2])
    assert (ck.every, ck.saved_layers, ck.offload_layers) == (2, [0, 2, 4], [0, 2])
    ck.configure(1, [])
    assert (ck.every, ck.saved_layers, ck.offload_layers) == (1, list(range(6)), [])
    with pytest.raises(ConfigError, match="keep no input with checkpoint_every=3"):
        ck.configure(3, [1])  # not a block start
    with pytest.raises(ValueError, match="checkpoint_every must be an int >= 1"):
        ck.configure(0, [])


def test_fixed_levers_of_a_parallelize_config():
    from ulysses_trainer.model.parallelize import ParallelizeConfig

    def resolved(**kw):  # what parallelize(model, state, ParallelizeConfig(...)) installs on a 5-layer model
        return ParallelizeConfig(**kw).resolve(transformers.Qwen3Config(num_hidden_layers=5))

    # true = every kept input (the block starts with checkpoint_every 2), n = the first n of them
    assert resolved(activation_offload=True, checkpoint_every=2).offload_layers == (0, 2, 4)
    assert resolved(activation_offload=2, checkpoint_every=2).offload_layers == (0, 2)
    # auto is left to apply(model, plan): nothing offloaded or kept until then
    auto = resolved()
    assert (auto.checkpoint_every, auto.offload_layers, auto.kept_attention_layers) == (1, (), ())
    with pytest.raises(ConfigError, match="between 0 and 3 layers"):
        resolved(activation_offload=4, checkpoint_every=2)
    with pytest.raises(ConfigError, match="activation_offload 1 needs gradient_checkpointing: true"):
        resolved(activation_offload=1, gradient_checkpointing=False)


def test_host_bytes_needed():
    assert host_bytes_needed(3, 2, 100, 64, 2) == 3 * 2 * 100 * 64 * 2
    assert host_bytes_needed(0, 2, 100, 64, 2) == 0
    with pytest.raises(ConfigError, match="local_seq"):
        host_bytes_needed(3, 2, -1, 64, 2)


def test_detect_host_memory_gb():
    gb = detect_host_memory_gb()
    with open("/proc/meminfo") as f:
        total_kib = int(next(line for line in f if line.startswith("MemTotal:")).split()[1])
    assert 0 < gb <= total_kib / 1024**2 + 1e-9


# --------------------------------------------------------------------------------------------
# Host pool


def test_host_pool_slots_are_disjoint_views_of_one_buffer():
    pool = HostPool(host_memory_gb=1.0)
    pool.allocate(slot_bytes=5000, num_slots=3, pin=False)
    assert pool.allocations == 1
    assert pool.slot_stride == 8192 and pool.nbytes == 3 * 8192  # 5000 rounded up to whole pages
    base = pool.buffer.data_ptr()
    assert base % 4096 == 0
    spans = []
    for k in range(3):
        s = pool.slot(k)
        assert s.numel() == 5000 and s.dtype == torch.uint8
        assert s.untyped_storage().data_ptr() == pool.buffer.untyped_storage().data_ptr()  # a view
        spans.append((s.data_ptr() - base, s.data_ptr() - base + s.numel()))
    for prev, nxt in zip(spans, spans[1:]):
        assert prev[1] <= nxt[0]
    assert spans[-1][1] <= pool.nbytes
    # Writing one slot leaves the others untouched.
    for k in range(3):
        pool.slot(k).fill_(k + 1)
    assert [int(pool.slot(k).float().mean()) for k in range(3)] == [1, 2, 3]
    # A request that fits is a no-op; a larger one raises (shapes are fixed per run).
    pool.allocate(4000, 2, pin=False)
    assert pool.allocations == 1
    with pytest.raises(RuntimeError, match="3 slots of 5000 bytes"):
        pool.allocate(6000, 3, pin=False)
    with pytest.raises(IndexError):
        pool.slot(3)


def test_host_pool_held_slots_alias_the_rest_and_check_the_budget_for_all():
    """The memory rehearsal's host stand-in: 5 slots over 2 held ones (slot k is slot k % 2); the budget is
    checked against all 5, and counted_bytes says what a real run holds."""
    pool = HostPool(host_memory_gb=1.0, held_slots=2)
    pool.allocate(slot_bytes=5000, num_slots=5, pin=False)
    assert pool.nbytes == 2 * 8192 and pool.counted_bytes == 5 * 8192
    assert [pool.slot(k).data_ptr() - pool.buffer.data_ptr() for k in range(5)] == [0, 8192, 0, 8192, 0]
    small = HostPool(host_memory_gb=4 * 8192 / GIB, held_slots=2)  # room for 4 slots: 2 held, but 5 counted
    with pytest.raises(ConfigError, match="5 layers"):
        small.allocate(slot_bytes=5000, num_slots=5, pin=False)
    with pytest.raises(ConfigError, match="held_slots"):
        HostPool(host_memory_gb=1.0, held_slots=0)


def test_host_pool_refuses_more_than_the_host_has():
    pool = HostPool(host_memory_gb=0.001)  # 1073741 bytes
    with pytest.raises(ConfigError) as e:
        pool.allocate(slot_bytes=1 << 20, num_slots=4, pin=False)
    msg = str(e.value)
    assert str(4 * (1 << 20)) in msg and str(int(0.001 * GIB)) in msg
    assert "fewer layers" in msg and "sp" in msg and "host_memory_gb" in msg
    assert pool.buffer is None and pool.allocations == 0
    # Split among the ranks of one host.
    assert HostPool(host_memory_gb=8.0, ranks_per_node=4).budget_bytes == 2 * GIB
    with pytest.raises(ConfigError):
        HostPool(host_memory_gb=-1.0)


# --------------------------------------------------------------------------------------------
# Checkpointing a tiny Qwen3


def _tiny_qwen3(num_layers: int = 4) -> nn.Module:
    cfg = transformers.Qwen3Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
        num_attention_heads=8, num_key_value_heads=2, head_dim=16, use_cache=False)
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(cfg)


def _wire(model: nn.Module, ckpt: LayerRecompute | None) -> None:
    for i, layer in enumerate(model.model.layers):
        layer.gradient_checkpointing = ckpt is not None
        if ckpt is not None:
            layer._gradient_checkpointing_func = ckpt.for_layer(i)


def _loss_and_grads(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def _backward_after_a_second_forward_raises(model: nn.Module, ids: torch.Tensor, match: str) -> None:
    """Two forwards, then the first one's backward: the checkpointer must refuse (`match`)."""
    first = model(input_ids=ids, labels=ids).loss
    second = model(input_ids=ids, labels=ids).loss
    with pytest.raises(RuntimeError, match=match):
        first.backward()
    del first, second


def _assert_close(loss, grads, ref_loss, ref_grads, tol=1e-5):
    assert abs(loss.item() - ref_loss.item()) <= tol * abs(ref_loss.item())
    assert grads.keys() == ref_grads.keys()
    for n, g in grads.items():
        rel = (g.float() - ref_grads[n].float()).norm() / ref_grads[n].float().norm().clamp_min(1e-30)
        assert rel <= tol, f"{n}: rel err {rel:.3e}"


@pytest.fixture(scope="module")
def tiny():
    model = _tiny_qwen3().train()
    ids = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(1))
    _wire(model, None)
    return model, ids, _loss_and_grads(model, ids)


@pytest.mark.parametrize("offload, sync_fetches, prefetches", [
    ([], 0, 0),
    ([0, 1], 0, 2),  # layer 2 (on device) prefetches 1, layer 1 prefetches 0
    ([1, 3], 1, 1),  # 3 is fetched when needed; layer 2 prefetches 1
    ([0, 1, 2, 3], 1, 3),  # only the first backward (layer 3) waits for its fetch
])
def test_checkpointed_qwen3_matches_plain(tiny, offload, sync_fetches, prefetches):
    model, ids, (ref_loss, ref_grads) = tiny
    ckpt = LayerRecompute(4, offload, HostPool(host_memory_gb=1.0))
    _wire(model, ckpt)
    try:
        loss, grads = _loss_and_grads(model, ids)
    finally:
        _wire(model, None)
    # The layers really went through the checkpointer: one no-grad forward and one recompute each.
    assert ckpt.forward_calls == [1] * 4 and ckpt.recompute_calls == [1] * 4
    assert (ckpt.sync_fetches, ckpt.prefetches) == (sync_fetches, prefetches)
    assert ckpt.pool.allocations == (1 if offload else 0)
    if offload:
        assert ckpt.pool.slot_bytes == 2 * 24 * 64 * 4  # [b, s, h] fp32
    _assert_close(loss, grads, ref_loss, ref_grads)


def test_backward_reads_the_host_copy(tiny):
    """Corrupting the host slot between forward and backward must change the gradients."""
    model, ids, (ref_loss, ref_grads) = tiny
    ckpt = LayerRecompute(4, [2], HostPool(host_memory_gb=1.0))
    _wire(model, ckpt)
    try:
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        host = ckpt.state(2).host
        assert host.shape == (2, 24, 64)
        assert host.untyped_storage().data_ptr() == ckpt.pool.buffer.untyped_storage().data_ptr()
        host.mul_(1.5)
        loss.backward()
    finally:
        _wire(model, None)
    g = model.model.layers[2].mlp.down_proj.weight.grad
    ref = ref_grads["model.layers.2.mlp.down_proj.weight"]
    assert (g - ref).norm() / ref.norm() > 1e-3


def test_second_forward_before_backward_raises_but_skipped_backward_is_fine(tiny):
    model, ids, (ref_loss, ref_grads) = tiny
    ckpt = LayerRecompute(4, [0, 1, 2, 3], HostPool(host_memory_gb=1.0))
    _wire(model, ckpt)
    try:
        _backward_after_a_second_forward_raises(model, ids, "overwritten by a later forward")
        # A forward whose backward never ran (e.g. a skipped step) leaves nothing behind.
        model(input_ids=ids, labels=ids)
        loss, grads = _loss_and_grads(model, ids)
    finally:
        _wire(model, None)
    assert ckpt.pool.allocations == 1
    _assert_close(loss, grads, ref_loss, ref_grads)


class _TupleLayer(nn.Module):
    """Returns (hidden, extra) and takes a second positional tensor that needs grad."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor, scale: torch.Tensor, *, shift: torch.Tensor):
        out = torch.tanh(self.lin(h) * scale + shift)
        return out, "not a tensor"


@pytest.mark.parametrize("offload", [[], [0]])
@pytest.mark.parametrize("input_needs_grad", [True, False])
def test_tuple_outputs_extra_args_and_frozen_input(offload, input_needs_grad):
    torch.manual_seed(0)
    layer = _TupleLayer()
    x = torch.randn(3, 5, 8, requires_grad=input_needs_grad)
    scale = torch.randn(8, requires_grad=True)
    shift = torch.randn(8)  # bound in kwargs, like HF's position embeddings

    def run(fn):
        layer.zero_grad(set_to_none=True)
        for t in (x, scale):
            t.grad = None
        out, extra = fn(lambda h, s: layer(h, s, shift=shift), x, scale)
        assert extra == "not a tensor"
        (out**2).sum().backward()
        return [t.grad for t in (layer.lin.weight, layer.lin.bias, scale, x)]

    ref = run(lambda f, *a: f(*a))
    ckpt = LayerRecompute(1, offload, HostPool(host_memory_gb=1.0))
    got = run(ckpt.for_layer(0))
    assert ckpt.recompute_calls == [1]
    for g, r in zip(got, ref):
        if r is None:
            assert g is None
        else:
            torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7)


def _zero3_loss_and_grads(rank: int, world_size: int, offload: list[int] | None):
    model = _tiny_qwen3(3)  # the same initial weights on every rank and in every run
    ckpt = None if offload is None else LayerRecompute(3, offload, HostPool(host_memory_gb=1.0))

    def wire(engine):
        _wire(engine.module, ckpt)
        engine.train()

    ids = torch.randint(0, 128, (1, 19), generator=torch.Generator().manual_seed(100 + rank))
    # tiny parameters partitioned, so that the recompute in backward really re-gathers them
    loss, grads, _ = stock_zero3_step(model, world_size, ids, wire=wire)
    calls = None if ckpt is None else (ckpt.forward_calls, ckpt.recompute_calls)
    return loss, grads, calls


def _zero3_runs(rank: int, world_size: int):
    return [_zero3_loss_and_grads(rank, world_size, offload) for offload in (None, [0, 2])]


@pytest.mark.slow
def test_checkpoint_offload_under_zero3():
    pytest.importorskip("deepspeed")
    for (ref_loss, ref_grads, _), (loss, grads, calls) in run_ranks(2, _zero3_runs, timeout=JOB_TIMEOUT_S):
        assert calls == ([1, 1, 1], [1, 1, 1])
        _assert_close(torch.tensor(loss), {n: torch.from_numpy(g) for n, g in grads.items()},
                      torch.tensor(ref_loss), {n: torch.from_numpy(g) for n, g in ref_grads.items()})


def test_invalid_offload_layers():
    with pytest.raises(ConfigError, match="outside 0..3"):
        LayerRecompute(4, [0, 4])


# --------------------------------------------------------------------------------------------
# GPU (the H200): the same exactness with real streams, pinned memory and the memory saving

needs_cuda = pytest.mark.gpu


def _cuda_model(hidden: int, layers: int, dtype: torch.dtype) -> nn.Module:
    cfg = transformers.Qwen3Config(
        vocab_size=1024, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, head_dim=hidden // 8, use_cache=False)
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(cfg).to(device="cuda", dtype=dtype).train()


@needs_cuda
def test_gpu_offload_matches_plain_fp32():
    model = _cuda_model(256, 4, torch.float32)
    ids = torch.randint(0, 1024, (2, 512), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    _wire(model, None)
    ref = _loss_and_grads(model, ids)
    for offload in ([], [0, 1, 2, 3]):
        ckpt = LayerRecompute(4, offload, HostPool(host_memory_gb=4.0))
        _wire(model, ckpt)
        got = _loss_and_grads(model, ids)
        _wire(model, None)
        assert ckpt.recompute_calls == [1] * 4
        _assert_close(*got, *ref)


@needs_cuda
def test_gpu_copies_are_pinned_and_off_the_compute_stream(tmp_path):
    layers, seq, hidden = 4, 2048, 256
    model = _cuda_model(hidden, layers, torch.bfloat16)
    ids = torch.randint(0, 1024, (1, seq), device="cuda")
    ckpt = LayerRecompute(layers, range(layers), HostPool(host_memory_gb=4.0))
    _wire(model, ckpt)
    _loss_and_grads(model, ids)  # warm up: allocates the pool
    assert ckpt.pool.pinned
    # Page-locked, the device->host copy is asynchronous: it returns while the stream is still busy.
    # (Tensor.is_pinned() does not recognise memory page-locked by cudaHostRegister on torch 2.11.)
    src = torch.empty(ckpt.pool.slot_bytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(2_000_000_000)  # about a second of spinning on this stream
        ckpt.pool.slot(0).copy_(src, non_blocking=True)
        done = stream.record_event()
    assert not done.query()
    torch.cuda.synchronize()
    assert ckpt.side_stream is not None and ckpt.side_stream != torch.cuda.current_stream()
    assert all(isinstance(ckpt.state(i).copy_event, torch.cuda.Event) for i in range(layers))
    torch.cuda.synchronize()
    assert all(ckpt.state(i).copy_event.query() for i in range(layers))

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _loss_and_grads(model, ids)
        torch.cuda.synchronize()
    _wire(model, None)
    trace = os.path.join(tmp_path, "trace.json")
    prof.export_chrome_trace(trace)
    with open(trace) as f:
        events = json.load(f)["traceEvents"]
    slot = seq * hidden * 2
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and e.get("args", {}).get("bytes") == slot]
    kernel_streams = {e["args"]["stream"] for e in events
                      if e.get("cat") == "kernel" and "stream" in e.get("args", {})}
    d2h = [e for e in copies if "DtoH" in e["name"]]
    h2d = [e for e in copies if "HtoD" in e["name"]]
    assert len(d2h) == layers and len(h2d) == layers, [e["name"] for e in copies]
    assert all("Pinned" in e["name"] for e in copies), [e["name"] for e in copies]
    copy_streams = {e["args"]["stream"] for e in copies}
    assert len(copy_streams) == 1 and not copy_streams & kernel_streams


@needs_cuda
def test_gpu_offload_lowers_peak_memory():
    layers, seq, hidden = 8, 8192, 1024
    model = _cuda_model(hidden, layers, torch.bfloat16)
    ids = torch.randint(0, 1024, (1, seq), device="cuda")
    ckpt_bytes = seq * hidden * 2

    def peak(ckpt: LayerRecompute) -> int:
        _wire(model, ckpt)
        for _ in range(2):  # the first step allocates the grads and the pool
            model.zero_grad(set_to_none=False)
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            model(input_ids=ids, labels=ids).loss.backward()
            torch.cuda.synchronize()
        _wire(model, None)
        return torch.cuda.max_memory_allocated() - base

    on_device = peak(LayerRecompute(layers, []))
    offloaded = peak(LayerRecompute(layers, range(layers), HostPool(host_memory_gb=8.0)))
    # At most two layer inputs are on the device at once with offload (the current and the prefetch).
    expected = (layers - 2) * ckpt_bytes
    print(f"peak extra memory: on device {on_device / 2**20:.0f} MiB, offloaded {offloaded / 2**20:.0f} MiB, "
          f"expected saving about {expected / 2**20:.0f} MiB")
    assert on_device - offloaded >= expected / 2
