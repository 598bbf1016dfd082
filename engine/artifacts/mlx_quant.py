"""MLX quantization modes: what each allows, reading a layer's mode from its stored arrays,
and what a quantized weight costs in memory.

mlx-lm writes four modes (``mlx_lm convert -q --q-mode ...``):

- ``affine``: each group of ``group_size`` weights has a scale and a bias in the model's
  float dtype; 1-6 or 8 bits, groups of 32, 64 or 128.
- ``mxfp4`` / ``mxfp8``: OCP microscaling floats (e2m1 / e4m3) with one 8-bit power-of-two
  scale per 32 weights; no biases.
- ``nvfp4``: e2m1 with one 8-bit e4m3 scale per 16 weights; no biases. mlx-lm can give
  stacked experts one extra float32 scale per expert (``global_scale``).

A config's top-level block sets the default; a module's own entry (mlx-lm's mixed recipes,
a MoE router kept at 8 bits) replaces it whole, with ``to_quantized``'s defaults (affine)
for what it leaves out, exactly as mlx-lm's loader passes it on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.errors import UnsupportedModelError


@dataclass(frozen=True)
class Mode:
    bits: tuple[int, ...]
    group_sizes: tuple[int, ...]
    default: tuple[int, int]  # (bits, group_size) when a block leaves them out
    biases: bool  # affine stores a bias per group beside each scale
    scale_bytes: int | None  # bytes per stored scale; None: the model's float dtype

    def describe(self, name: str) -> str:
        bits = "1-6 or 8" if name == "affine" else str(self.bits[0])
        groups = ", ".join(map(str, self.group_sizes))
        return f"{name} ({bits} bits, group {groups})"


MODES: dict[str, Mode] = {
    "affine": Mode((1, 2, 3, 4, 5, 6, 8), (32, 64, 128), (4, 64), biases=True, scale_bytes=None),
    "mxfp4": Mode((4,), (32,), (4, 32), biases=False, scale_bytes=1),
    "mxfp8": Mode((8,), (32,), (8, 32), biases=False, scale_bytes=1),
    "nvfp4": Mode((4,), (16,), (4, 16), biases=False, scale_bytes=1),
}


def supported() -> str:
    """What the engine runs, for refusals: 'affine (1-6 or 8 bits, group 32, 64, 128), ...'."""
    return "; ".join(mode.describe(name) for name, mode in MODES.items())


def check_params(params: dict[str, Any], *, where: str) -> None:
    """Refuse (UnsupportedModelError, one line) a mode, bit width or group size MLX cannot run.

    ``params`` is what ``to_quantized`` will receive; missing values take the mode's default.
    """
    name = params.get("mode") or "affine"
    mode = MODES.get(str(name))
    if mode is None:
        raise UnsupportedModelError(
            f"{where} uses quantization mode {name!r}, which this engine cannot run; it runs {supported()}"
        )
    bits = params.get("bits") or mode.default[0]
    group = params.get("group_size") or mode.default[1]
    if bits not in mode.bits or group not in mode.group_sizes:
        raise UnsupportedModelError(
            f"{where} asks for {name} quantization at {bits} bits with group size {group}, which this "
            f"engine cannot run; it runs {supported()}"
        )


def check_spec(spec: Any, *, where: str) -> None:
    """Refuse a config's quantization block (top level and each module's entry) MLX cannot run."""
    check_params({"bits": spec.bits, "group_size": spec.group_size, "mode": spec.mode}, where=where)
    for path, override in spec.overrides.items():
        if isinstance(override, dict):
            check_params(spec.params_for(path), where=f"{where} ({path})")


def module_params(override: Any, default: dict[str, Any]) -> dict[str, Any]:
    """A module's to_quantized() arguments: its own config entry (replacing the default whole,
    as mlx-lm's loader does) or the top-level default."""
    if not isinstance(override, dict):
        return dict(default)
    name = override.get("mode") or "affine"
    mode = MODES.get(name)
    bits, group = mode.default if mode is not None else (None, None)
    params = {"bits": override.get("bits") or bits, "group_size": override.get("group_size") or group, "mode": name}
    if override.get("global_scale"):
        params["global_scale"] = True
    return params


def stored_params(in_dims: int, weight: Any, scales: Any) -> dict[str, Any]:
    """The (bits, group_size, mode) a module was packed with, read off its stored arrays
    (as mlx-lm's ``infer_quant_config``): affine keeps float scales, the others uint8.
    The dtype is read by name, so reading a config never needs mlx."""
    group = in_dims // scales.shape[-1]
    bits = weight.shape[-1] * 32 // in_dims
    if not str(scales.dtype).endswith("uint8"):
        return {"bits": bits, "group_size": group, "mode": "affine"}
    for name, mode in MODES.items():
        if mode.scale_bytes == 1 and (bits, group) == (mode.bits[0], mode.group_sizes[0]):
            return {"bits": bits, "group_size": group, "mode": name}
    return {"bits": bits, "group_size": group, "mode": f"an 8-bit-scaled {bits}-bit g{group} format"}


def bits_per_weight(mode_name: str, bits: int, group_size: int, float_bytes: int = 2) -> float:
    """Memory per weight, scales and biases included (affine 4-bit g64 in bf16: 4.5)."""
    mode = MODES[mode_name]
    scale_bits = 8 * (mode.scale_bytes or float_bytes) * (2 if mode.biases else 1)
    return bits + scale_bits / group_size
