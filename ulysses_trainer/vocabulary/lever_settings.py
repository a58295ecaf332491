"""The memory levers as the user wrote them, decoded once: `decode_levers` is the one reader of the raw fields
(`gradient_checkpointing`, `checkpoint_every`, `activation_offload`, `keep_attention_outputs`, `tiled_mlp`,
`optimizer_offload`) of a TrainConfig or of a loop of your own's settings (ParallelizeConfig decodes them into its
`levers`). The config checks, the planner (plan/resolve.py) and `parallelize` read its `Levers`, and
`Levers.bind` gives the same record bound to a model, which the search and the ModelSetup read. Torch-free;
imports nothing of the package but its errors.

Meanings, one each: `false` / 0 layers = none, `true` = every layer (that keeps an input, for the offload),
`auto` = None (the plan decides; a loop of your own leaves it unset until `apply`). `tiled_mlp`: false or 1 =
untiled, N >= 1 tiles, true = the lever's own count (names.auto_num_tiles), 0 is refused. Without
gradient_checkpointing nothing is offloaded or kept and every layer keeps its input. The attention-output stash
is installed when some layer may keep its output: checkpointing on and keep_attention_outputs not 0/false.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from ..errors import ConfigError

# the levers the plan's search decides when they are `auto` (in the order the messages name them)
AUTO_LEVERS = ("checkpoint_every", "activation_offload", "keep_attention_outputs", "tiled_mlp", "optimizer_offload")
# the training config's fields decode_levers reads
LEVER_FIELDS = ("gradient_checkpointing", *AUTO_LEVERS)

TRUE_TILES = "rule"  # tiled_mlp true: the lever's own count for the tokens per rank (names.auto_num_tiles)


def _need(ok: bool, msg: str) -> None:
    if not ok:
        raise ConfigError(msg)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class Levers:
    """The memory levers, one record from the user's value to the search: `decode_levers` makes it of a config
    (checked on its own, no model yet), `bind` the same record against a model (its "all" / "rule" made counts),
    which the planner's search reads (None = auto: searched) and the ModelSetup is made of. Without checkpointing
    offload and keep are 0 and every is 1."""

    gradient_checkpointing: bool
    checkpoint_every: int | None  # 1 without checkpointing
    # offloaded layer inputs; "all": every layer that keeps one (stays "all" once bound: the count is the thinning's)
    activation_offload: int | Literal["all"] | None  # 0 without checkpointing
    keep_attention_outputs: int | Literal["all"] | None  # 0 without checkpointing; bound: a count
    tiled_mlp: int | Literal["rule"] | None  # 1 untiled, TRUE_TILES: names.auto_num_tiles; bound: a count
    optimizer_offload: bool | None
    pinned: tuple[str, ...] = ()  # the searched levers the config fixed; "gradient_checkpointing" first when off

    @property
    def decided(self) -> bool:
        """Every lever a value (none auto, no "all" or "rule" left): a plan's record, the only kind the planner's
        Settings, the comm model's Job and the MLP terms hold."""
        return (_is_int(self.checkpoint_every) and _is_int(self.activation_offload)
                and _is_int(self.keep_attention_outputs) and _is_int(self.tiled_mlp)
                and isinstance(self.optimizer_offload, bool))

    def offload_for(self, saved: int) -> int | None:
        """The fixed offload count where `saved` layers keep an input (None: auto)."""
        return saved if self.activation_offload == "all" else self.activation_offload

    @property
    def attention_stash(self) -> bool:
        """Whether the attention-output stash is installed: some layer may keep its output (auto or > 0)."""
        return self.keep_attention_outputs != 0

    # the layers each lever covers, of a bound record on a model of `num_layers` layers: an auto lever (None) as
    # installed before a plan sets it (every layer keeps its input, none offloaded, none keeps its output)

    def saved_layers(self, num_layers: int) -> tuple[int, ...]:
        """The layers whose input is kept for backward: every checkpoint_every-th one (none without checkpoints)."""
        return tuple(range(0, num_layers, self.checkpoint_every or 1)) if self.gradient_checkpointing else ()

    def offload_layers(self, num_layers: int) -> tuple[int, ...]:
        """Of the saved layers, those whose input lives in pinned host memory (the first ones)."""
        saved = self.saved_layers(num_layers)
        return saved[:self.offload_for(len(saved)) or 0]

    def kept_attention_layers(self) -> tuple[int, ...]:
        """The layers keeping their attention output for the recompute (the first ones)."""
        keep = self.keep_attention_outputs
        if keep == "all":
            raise ValueError("kept_attention_layers of an unbound record: bind it to the model first (Levers.bind)")
        return tuple(range(keep or 0))

    def with_json_placement(self, json_offload: bool | None) -> Levers:
        """The optimizer's placement once the ZeRO JSON is read: where the JSON has an offload_optimizer section
        (json_offload not None) it says where Adam lives and wins over `auto`; a config that says otherwise is
        refused (ConfigError naming the fix)."""
        if json_offload is None:
            return self
        if self.optimizer_offload is not None and self.optimizer_offload != json_offload:
            raise ConfigError(f"optimizer_offload {str(self.optimizer_offload).lower()} but the ZeRO JSON "
                              f"{'has' if json_offload else 'has no'} offload_optimizer: set "
                              f"optimizer_offload auto (the JSON wins) or edit the JSON")
        return replace(self, optimizer_offload=json_offload)

    def bind(self, layers: int, true_tiles: Callable[[], int]) -> Levers:
        """The levers against a model of `layers` decoder layers (ConfigError naming the fix): `true` kept
        outputs are `layers`, `true` tiles `true_tiles()` (asked only then)."""
        keep = self.keep_attention_outputs
        if _is_int(keep) and keep > layers:
            raise ConfigError(f"keep_attention_outputs={keep} exceeds the model's {layers} layers; "
                              f"give 0..{layers}, true (all of them) or auto")
        offload, every = self.activation_offload, self.checkpoint_every or 1
        if _is_int(offload):
            saved = -(-layers // every)  # checkpoint_every auto: at most every layer keeps one
            if offload > saved:
                raise ConfigError(f"activation_offload={offload} must be between 0 and {saved} layers (the "
                                  f"layers that keep an input: {layers} / checkpoint_every {every}, "
                                  f"rounded up); true offloads all of them")
        return replace(self, keep_attention_outputs=layers if keep == "all" else keep,
                       tiled_mlp=true_tiles() if self.tiled_mlp == TRUE_TILES else self.tiled_mlp)


# a decided record where none is given: every layer checkpointed (keeps its input), untiled, nothing offloaded or
# kept, Adam on the GPU; the planner's Settings and the comm model's Job start from it
EVERY_LAYER = Levers(gradient_checkpointing=True, checkpoint_every=1, activation_offload=0, keep_attention_outputs=0,
                     tiled_mlp=1, optimizer_offload=False)


def _count(name: str, v: Any, unit: str) -> int | Literal["all"] | None:
    """false -> 0, true -> "all", auto -> None, n >= 0 -> n."""
    _need(v == "auto" or isinstance(v, bool) or _is_int(v),
          f"{name} must be >= 0 {unit} (or true/false/auto), got {v!r}")
    _need(not _is_int(v) or v >= 0, f"{name} must be >= 0 {unit} (or true/false/auto), got {v}")
    return None if v == "auto" else "all" if v is True else int(v)


def decode_levers(cfg: Any) -> Levers:
    """The levers of a TrainConfig (or of an object holding the same LEVER_FIELDS: ParallelizeConfig's values),
    checked on their own and together (ConfigError, exit 2, naming the fix); the checks against the model are
    `Levers.bind`'s."""
    ckpt, off, keep, tiled, every = (cfg.gradient_checkpointing, cfg.activation_offload, cfg.keep_attention_outputs,
                                     cfg.tiled_mlp, cfg.checkpoint_every)
    # a loop of your own (ParallelizeConfig) has no optimizer_offload: its placement is the caller's optimizer's
    opt = getattr(cfg, "optimizer_offload", "auto")
    _need(isinstance(ckpt, bool), f"gradient_checkpointing must be true or false, got {ckpt!r}")
    offload = _count("activation_offload", off, "layers")
    kept = _count("keep_attention_outputs", keep, "layers")
    _need(tiled == "auto" or isinstance(tiled, bool) or (_is_int(tiled) and tiled >= 1),
          f"tiled_mlp must be >= 1 tiles (or true/false/auto), got {tiled}")
    _need(every == "auto" or (_is_int(every) and every >= 1),
          f"checkpoint_every must be >= 1 layers (1 = every layer) or auto, got {every}")
    _need(opt == "auto" or isinstance(opt, bool), f"optimizer_offload must be true, false or auto, got {opt!r}")
    _need(ckpt or keep in (False, 0, "auto"),
          "keep_attention_outputs needs gradient_checkpointing: true (only a recompute reuses them)")
    _need(ckpt or every in (1, "auto"), "checkpoint_every > 1 needs gradient_checkpointing: true (it thins the "
                                        "checkpoints); set checkpoint_every 1 or gradient_checkpointing true")
    _need(ckpt or off in (False, 0, "auto"),
          f"activation_offload {str(off).lower()} needs gradient_checkpointing: true (it offloads the layer "
          f"checkpoints); set activation_offload false or gradient_checkpointing true")
    raw = {"checkpoint_every": every, "activation_offload": off, "keep_attention_outputs": keep,
           "tiled_mlp": tiled, "optimizer_offload": opt}
    pinned = ("gradient_checkpointing",) * (not ckpt) + tuple(n for n in AUTO_LEVERS if raw[n] != "auto")
    if not ckpt:  # nothing to offload or keep without checkpoints; every layer keeps its input
        offload, kept, every = 0, 0, 1
    return Levers(gradient_checkpointing=ckpt, checkpoint_every=None if every == "auto" else every,
                  activation_offload=offload, keep_attention_outputs=kept,
                  tiled_mlp=None if tiled == "auto" else 1 if tiled is False else TRUE_TILES if tiled is True
                  else tiled,
                  optimizer_offload=None if opt == "auto" else opt, pinned=pinned)
