"""A sentence-transformers model folder: what turns the backbone's hidden states into one vector.

``modules.json`` lists the steps after the transformer: Pooling (its ``config.json``
says how), Dense layers (``in_features``/``out_features``/``bias``/activation, weights
in their own safetensors), Normalize. The length limit is ``max_seq_length`` in
``sentence_bert_config.json`` (the published repos) or the tokenizer's
``model_max_length`` (what sentence-transformers 5+ writes). Both spellings of the
pooling config are read: the ``pooling_mode_*`` flags of the published repos and the
single ``pooling_mode`` of newer writers. A folder without ``modules.json`` is not an
embedding model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.artifacts.config import read_json
from engine.artifacts.weights import find_weights
from engine.errors import UnsupportedModelError

POOLING_MODES = ("cls", "mean", "max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
_LEGACY_POOLING = {
    "pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken",
}  # fmt: skip
ACTIVATIONS = {"Identity": "identity", "Tanh": "tanh", "ReLU": "relu", "GELU": "gelu", "Sigmoid": "sigmoid"}
_HUGE = 10**9  # tokenizers write model_max_length 1e30 to mean "no limit"


@dataclass(frozen=True)
class DenseSpec:
    in_features: int
    out_features: int
    bias: bool
    activation: str  # a key of ACTIVATIONS' values
    files: tuple[Path, ...]  # its safetensors (tensor names "linear.weight", "linear.bias")


@dataclass(frozen=True)
class EmbeddingSpec:
    pooling: tuple[str, ...]  # concatenated in this order, as sentence-transformers does
    dense: tuple[DenseSpec, ...] = ()
    normalize: bool = False
    max_seq_length: int | None = None
    dimensions: int = 0  # of the final vector
    include_prompt: bool = True
    prompts: dict[str, str] = field(default_factory=dict)


def _kind(module: dict[str, Any]) -> str:
    return str(module.get("type", "")).rsplit(".", 1)[-1]


def _pooling(config: dict[str, Any]) -> tuple[str, ...]:
    mode = config.get("pooling_mode")
    if mode is None:
        modes = tuple(name for key, name in _LEGACY_POOLING.items() if config.get(key))
    else:
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    unknown = [m for m in modes if m not in POOLING_MODES]
    if unknown or not modes:
        raise UnsupportedModelError(
            f"Unsupported sentence-transformers pooling {unknown or 'none'}; supported: {', '.join(POOLING_MODES)}."
        )
    return modes


def _dense(folder: Path) -> DenseSpec:
    config = read_json(folder / "config.json")
    name = str(config.get("activation_function") or "torch.nn.modules.activation.Tanh").rsplit(".", 1)[-1]
    if name not in ACTIVATIONS:
        raise UnsupportedModelError(
            f"Unsupported Dense activation {name!r} in {folder.name}; supported: {', '.join(ACTIVATIONS)}."
        )
    return DenseSpec(
        int(config["in_features"]),
        int(config["out_features"]),
        bool(config.get("bias", True)),
        ACTIVATIONS[name],
        tuple(find_weights(folder)),
    )


def _max_length(folder: Path) -> int | None:
    for name, key in (("sentence_bert_config.json", "max_seq_length"), ("tokenizer_config.json", "model_max_length")):
        path = folder / name
        value = read_json(path).get(key) if path.is_file() else None
        if isinstance(value, (int, float)) and 0 < value < _HUGE:
            return int(value)
    return None


def read_embedding_spec(folder: str | Path, hidden_size: int) -> EmbeddingSpec | None:
    """The pooling/dense/normalize steps of a sentence-transformers folder; None when it is not one."""
    folder = Path(folder)
    if not folder.is_dir() or not (folder / "modules.json").is_file():
        return None
    modules = read_json(folder / "modules.json")
    if not isinstance(modules, list):
        raise UnsupportedModelError(f"{folder / 'modules.json'} is not a list of modules.")
    pooling: tuple[str, ...] = ()
    include_prompt = True
    dense: list[DenseSpec] = []
    normalize = False
    for module in sorted(modules, key=lambda m: int(m.get("idx", 0))):
        kind, sub = _kind(module), folder / str(module.get("path") or "")
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            config = read_json(sub / "config.json")
            pooling, include_prompt = _pooling(config), bool(config.get("include_prompt", True))
        elif kind == "Dense":
            dense.append(_dense(sub))
        elif kind == "Normalize":
            normalize = True
        else:
            raise UnsupportedModelError(
                f"Unsupported sentence-transformers module {kind!r}; supported: Transformer, Pooling, Dense, Normalize."
            )
    if not pooling:
        raise UnsupportedModelError(f"{folder.name} has no Pooling module, so it makes no sentence embedding.")
    dims = dense[-1].out_features if dense else hidden_size * len(pooling)
    st_config = folder / "config_sentence_transformers.json"
    prompts = read_json(st_config).get("prompts") if st_config.is_file() else None
    return EmbeddingSpec(
        pooling,
        tuple(dense),
        normalize,
        _max_length(folder),
        dims,
        include_prompt,
        dict(prompts) if isinstance(prompts, dict) else {},
    )
