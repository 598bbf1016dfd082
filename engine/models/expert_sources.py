"""Where each expert's bytes are in a checkpoint, for every MoE layout the families load.

A streamed ``SwitchGLU`` at module path ``P`` (``model.layers.3.mlp.switch_mlp``,
gemma4's ``...experts.switch_glu``, gpt-oss's ``...mlp.experts``) holds ``{P}.{proj}.{part}``
for proj in gate/up/down and part in weight, scales, biases, bias, global_scale. The stored
tensors these come from, tried in this order:

* mlx-lm's layout (every quantization mode): ``{P}.{proj}.{part}`` stacked [E, ...];
  expert e is the e-th of E equal runs of bytes.
* gpt-oss as OpenAI/transformers store it: ``{P}.gate_up_proj_blocks`` / ``_scales`` /
  ``_bias`` (MXFP4, gate and up interleaved along the rows) or unquantized
  ``{P}.gate_up_proj`` [E, in, 2*inner] (transposed), and the ``down_proj`` ones.
* one tensor per expert: ``{parent}.experts.{e}.{proj}.{part}`` (also LFM2's w1/w3/w2).
* transformers 5's fused ``{parent}[.experts].gate_up_proj`` [E, 2*inner, hidden]: gate
  is the first half of each expert's run, up the second; ``down_proj`` as it is.

Every source is expert-major, so an expert's bytes are one contiguous range per tensor.
Names are matched from ``layers.N.`` on when the stored prefix differs from the module
path (a multimodal checkpoint's ``model.language_model.layers.N`` for ``model.layers.N``).
"""

from __future__ import annotations

import re
from typing import Any

import mlx.core as mx

from engine.artifacts.weights import TensorInfo
from engine.models.expert_store import ExpertSource

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_LAYER = re.compile(r"(?:^|\.)(layers\.\d+\..*)$")
_ALIASES = {"gate_proj": ("gate_proj", "w1"), "up_proj": ("up_proj", "w3"), "down_proj": ("down_proj", "w2")}


class NoSource(ValueError):
    """A parameter of a streamed layer whose stored bytes this module cannot locate."""


class ByLayer(dict):
    """Stored tensors by name, also found by the part of the name from ``layers.N.`` on."""

    def __init__(self, headers: dict[str, TensorInfo]):
        super().__init__(headers)
        self.tails = {t: info for name, info in headers.items() if (t := _tail(name))}

    def get(self, name, default=None):
        found = super().get(name)
        return found if found is not None else self.tails.get(_tail(name) or "", default)

    def __contains__(self, name) -> bool:
        return self.get(name) is not None

    def __getitem__(self, name):
        found = self.get(name)
        if found is None:
            raise KeyError(name)
        return found


def _tail(name: str) -> str | None:
    m = _LAYER.search(name)
    return m.group(1) if m else None


def expert_sources(
    path: str, params: dict[str, Any], num_experts: int, headers: dict[str, TensorInfo]
) -> dict[str, ExpertSource]:
    """Sources for each of a SwitchGLU's parameters (``params``: "gate_proj.weight" -> the
    sanitized stacked array, whose shape and dtype the slab takes); NoSource when one is
    not found or would not give the slab's shape."""
    out = {}
    headers = headers if isinstance(headers, ByLayer) else ByLayer(headers)
    for name, array in params.items():
        proj, leaf = name.split(".")
        source = _find(path, proj, leaf, num_experts, headers)
        if source is None:
            raise NoSource(f"{path}.{name}")
        if source.row_shape() != tuple(array.shape[1:]):
            raise NoSource(f"{path}.{name} (stored as {source.shape}, held as {tuple(array.shape[1:])})")
        out[name] = source
    return out


def _find(path: str, proj: str, leaf: str, n: int, headers: dict[str, TensorInfo]) -> ExpertSource | None:
    parent = path.rsplit(".", 1)[0]
    stacked = headers.get(f"{path}.{proj}.{leaf}")
    if stacked is not None and stacked.shape[:1] == (n,):
        return _stacked(stacked, n)
    found = _gpt_oss(path, proj, leaf, n, headers)
    if found is not None:
        return found
    for alias in _ALIASES[proj]:
        names = [f"{parent}.experts.{e}.{alias}.{leaf}" for e in range(n)]
        if all(name in headers for name in names):
            infos = [headers[name] for name in names]
            first = infos[0]
            offsets = tuple((str(i.file), i.offset) for i in infos)
            return ExpertSource(offsets, first.nbytes, first.dtype, first.shape)
    if leaf != "weight":
        return None
    for base in (f"{parent}.experts", parent):
        if proj == "down_proj" and f"{base}.gate_up_proj" in headers:
            info = headers.get(f"{base}.down_proj")
            return _stacked(info, n) if info is not None and info.shape[:1] == (n,) else None
        fused = headers.get(f"{base}.gate_up_proj")
        if fused is not None and fused.shape[:1] == (n,) and len(fused.shape) == 3:
            half = _stacked(fused, n)
            rows = fused.shape[1] // 2
            shift = 0 if proj == "gate_proj" else half.nbytes // 2
            return ExpertSource(
                tuple((f, o + shift) for f, o in half.offsets),
                half.nbytes // 2,
                fused.dtype,
                (rows, *fused.shape[2:]),
            )
    return None


def _stacked(info: TensorInfo, n: int, transform=None) -> ExpertSource:
    stride = info.nbytes // n
    offsets = tuple((str(info.file), info.offset + e * stride) for e in range(n))
    return ExpertSource(offsets, stride, info.dtype, tuple(info.shape[1:]), transform)


def _gpt_oss(path: str, proj: str, leaf: str, n: int, headers: dict[str, TensorInfo]) -> ExpertSource | None:
    """OpenAI's layout: gate and up interleaved along the rows of one tensor (gate even, up odd)."""
    stem = "down_proj" if proj == "down_proj" else "gate_up_proj"
    pick = None if proj == "down_proj" else (0 if proj == "gate_proj" else 1)
    names = {
        "weight": (f"{path}.{stem}_blocks", f"{path}.{stem}"),
        "scales": (f"{path}.{stem}_scales",),
        "bias": (f"{path}.{stem}_bias",),
    }.get(leaf, ())
    for name in names:
        info = headers.get(name)
        if info is None or info.shape[:1] != (n,):
            continue
        if name.endswith("_blocks"):  # [E, out, in/32, 16] bytes -> [E, out, in/8] words
            steps = [lambda a: a.reshape(*a.shape[:2], -1).view(mx.uint32)]
        elif leaf == "weight":  # transformers' unquantized [E, in, out]
            steps = [lambda a: a.swapaxes(-1, -2)]
        else:
            steps = []
        if pick is not None:
            steps.append(lambda a, k=pick: mx.contiguous(a[:, k::2]))
        return _stacked(info, n, _chain(steps) if steps else None)
    return None


def _chain(steps):
    def run(a):
        for step in steps:
            a = step(a)
        return a

    return run
