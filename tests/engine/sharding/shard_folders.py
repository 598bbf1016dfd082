"""Model folders for the sharding tests: the tiny float32 golden checkpoints of each family
(tests/golden/models) in float32, one safetensors file per layer listed in an index (so a rank's
share is a set of files), with the tiny test tokenizer beside them (prompts are ids)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import mlx.core as mx

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "models"
INDEX = "model.safetensors.index.json"
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def split_by_layer(source: Path, folder: Path) -> None:
    """``source``'s model.safetensors, in float32 (a split's sums are then exact to ~1e-6), as
    one file per layer plus one for the rest, indexed."""
    weights = {
        k: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v
        for k, v in mx.load(str(source / "model.safetensors")).items()
    }
    parts: dict[str, dict[str, mx.array]] = {}
    for name, value in weights.items():
        m = _LAYER.search(name)
        part = f"model-layer{int(m.group(1)):03d}.safetensors" if m else "model-rest.safetensors"
        parts.setdefault(part, {})[name] = value
    weight_map = {}
    for part, tensors in parts.items():
        mx.save_safetensors(str(folder / part), tensors, metadata={"format": "pt"})
        weight_map.update({n: part for n in tensors})
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def family_folder(root: Path, name: str, tokenizer_dir: Path) -> Path:
    folder = root / name
    folder.mkdir(parents=True)
    source = GOLDEN / name
    for f in ("config.json", "generation_config.json"):
        if (source / f).is_file():
            shutil.copy(source / f, folder / f)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / f, folder / f)
    split_by_layer(source, folder)
    return folder


def prompt_ids(name: str, n: int = 8) -> list[int]:
    """The golden's prompt (a converted copy, ``q4_<family>``, takes its family's)."""
    return json.loads((GOLDEN / name.removeprefix("q4_") / "expected.json").read_text())["prompt_ids"][:n]


def single_process(folder: Path, ids: list[int], max_tokens: int) -> tuple[list[int], list[float], int]:
    """The reference: the same request on one process (greedy, with log-probs), and the
    bytes of the whole model's arrays."""
    from engine.api import GenerationParams
    from engine.models.sharding import held_bytes
    from engine.runtime.host import ModelHost

    host = ModelHost()
    host.load(str(folder))
    result = host.generate_ids(ids, GenerationParams(max_tokens=max_tokens, ignore_eos=True, logprobs=True))
    whole = held_bytes(host.model)
    host.unload()
    return result.token_ids, result.token_logprobs, whole
