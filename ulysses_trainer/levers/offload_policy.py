"""Which decoder layers send their checkpointed input to pinned host memory: the `activation_offload`
policy as layer indices (levers/offload.py carries it out)."""

from __future__ import annotations

from ..errors import ConfigError


def plan_offload(policy: bool | int | str, num_layers: int, bytes_per_layer: int, free_device_bytes: int,
                 reserve_bytes: int) -> list[int]:
    """Layer indices whose checkpointed input goes to the host (the `activation_offload` field).

    False: none. True: all. int n: the first n layers (their backward comes last, which gives the
    prefetch the most time; later layers keep their input on the device). "auto": as few of the
    first layers as needed so that the device-resident inputs fit in free_device_bytes - reserve_bytes
    (all of them if even none fit).
    """
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 0:
        raise ConfigError(f"num_layers must be an int >= 0, got {num_layers!r}")
    if policy is False:
        return []
    if policy is True:
        return list(range(num_layers))
    if isinstance(policy, int):
        if not 0 <= policy <= num_layers:
            raise ConfigError(
                f"activation_offload={policy} is out of range: give an int from 0 to {num_layers} "
                f"(the layers that keep an input: all of them, or 1 in checkpoint_every), or true, false or auto")
        return list(range(policy))
    if isinstance(policy, str) and policy.strip().lower() == "auto":
        if bytes_per_layer < 0:
            raise ConfigError(f"bytes_per_layer must be >= 0, got {bytes_per_layer}")
        budget = free_device_bytes - reserve_bytes
        if bytes_per_layer == 0:
            return []
        if budget < 0:
            return list(range(num_layers))
        keep = min(num_layers, budget // bytes_per_layer)  # layers whose input fits on the device
        return list(range(num_layers - keep))
    raise ConfigError(
        f"activation_offload must be true, false, auto or an int from 0 to {num_layers}, got {policy!r}")
