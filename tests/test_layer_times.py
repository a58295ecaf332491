"""train/layer_times.py: one step's seconds layer by layer, from the layers' forward hooks and the checkpointer's
marks. A layer made slow (its MLP, which runs inside the checkpoint, forward and recompute, advances the clock
the timer reads on CPU) must show in its own forward and recompute spans and nowhere else; the spans add up to the
step. The clock moves only there, so a busy machine changes nothing. Both places transformers runs a layer's hooks
are covered: outside the checkpoint (5.25: they fire once a forward) and inside it (5.17: the recompute and the
rebuilds fire them again, which must not move the forward's marks)."""

from types import SimpleNamespace

import pytest
import torch
import transformers

from ulysses_trainer.levers.recompute import LayerRecompute
from ulysses_trainer.train import layer_times
from ulysses_trainer.train.layer_times import LayerTimes, summary

SLEEP_S = 0.125  # a power of two: sums and differences of the clock stay exact


def _model(layers: int) -> torch.nn.Module:
    cfg = transformers.Qwen3Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                   num_attention_heads=8, num_key_value_heads=2, head_dim=16, use_cache=False)
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(cfg).train()


def _hooks_inside(layer: torch.nn.Module, checkpoint_fn):
    """The layer's checkpoint function as transformers 5.17 drives it: the module's forward hooks run inside the
    checkpoint (around run_fn), so they fire in the forward and again whenever backward re-runs the layer."""
    def run_in_checkpoint(run_fn, *args):
        def run(*a):
            for h in list(layer._forward_pre_hooks.values()):
                h(layer, a)
            out = run_fn(*a)
            for h in list(layer._forward_hooks.values()):
                h(layer, a, out)
            return out
        return checkpoint_fn(run, *args)
    return run_in_checkpoint


@pytest.mark.parametrize("hooks", ["outside", "inside"])
@pytest.mark.parametrize("layers, every, slow", [(4, 1, 2), (6, 2, 3), (6, 2, 4), (3, 1, 0)])
def test_a_slow_layer_shows_in_its_own_spans(layers, every, slow, hooks, monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(layer_times, "time", SimpleNamespace(perf_counter=lambda: clock[0]))
    model = _model(layers)
    ckpt = LayerRecompute(layers, [], None, checkpoint_every=every)
    for i, layer in enumerate(model.model.layers):
        layer.gradient_checkpointing = True
        fn = ckpt.for_layer(i)
        layer._gradient_checkpointing_func = fn if hooks == "outside" else _hooks_inside(layer, fn)
    model.model.layers[slow].mlp.register_forward_hook(lambda *a: clock.__setitem__(0, clock[0] + SLEEP_S))
    seen = []
    ckpt.observer = lambda layer, stage: seen.append(layer)  # kept: the timer chains to it
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(1))
    with LayerTimes(list(model.model.layers), ckpt) as timer:
        model(input_ids=ids, labels=ids).loss.backward()
    assert ckpt.observer is not None and seen  # restored, and told while the timer ran
    r = timer.result()
    fwd, rec, bwd = r["forward_s"], r["recompute_s"], r["backward_s"]
    assert all(x is not None and x >= 0 for x in fwd + rec)
    assert fwd[slow] >= SLEEP_S and max(x for i, x in enumerate(fwd) if i != slow) < SLEEP_S
    # its recompute runs the MLP again in its own span, and once more in the layer above's where that layer's input
    # is rebuilt from it (checkpoint_every > 1, the two in one block)
    slow_spans = {slow} | ({slow + 1} if slow % every != every - 1 and slow + 1 < layers else set())
    assert all((rec[i] >= SLEEP_S) == (i in slow_spans) for i in range(layers)), (slow_spans, rec)
    assert bwd[0] is None and all(x is not None and x >= 0 for x in bwd[1:])
    parts = [r["before_layers_s"], *fwd, r["loss_s"], *rec, *bwd[1:], r["last_backward_and_update_s"]]
    assert all(x >= 0 for x in parts) and sum(parts) <= r["step_s"] + 1e-6
    # every slow MLP call falls in one span: the forward's, the recompute's, the rebuild's (the clock moves only there)
    assert r["step_s"] == pytest.approx(sum(parts)) and r["unaccounted_s"] == pytest.approx(0.0)
    assert "layer times of the last step" in summary(r)
    assert "host" not in r  # on CPU the device's clock is the host's: no second copy
