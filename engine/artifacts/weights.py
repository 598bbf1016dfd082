"""Finding safetensors files, reading their headers, and loading them.

The header of a safetensors file is a little-endian u64 length followed by that many
bytes of JSON naming every tensor with its dtype, shape and byte range. Reading it
ourselves costs a few kilobytes of I/O per file, so sizes, parameter counts and
truncation are known before a single weight is loaded.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1,
    "U64": 8, "U32": 4, "U16": 2, "U8": 1,
    "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
}  # fmt: skip
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}

# A header larger than this is not a header: the file is something else or corrupt.
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # safetensors spelling: "BF16", "F32", "U32", ...
    shape: tuple[int, ...]
    nbytes: int
    file: Path
    offset: int = 0  # where the tensor's bytes start in ``file`` (header included)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def find_weights(folder: str | Path) -> list[Path]:
    """The safetensors files of a model folder, in a stable order.

    An index (``model.safetensors.index.json``) is authoritative: every shard it names
    must exist. Without one, ``model.safetensors`` or else every ``*.safetensors``.
    """
    folder = Path(folder)
    index = folder / INDEX_NAME
    if index.is_file():
        from engine.artifacts.config import read_json

        data = read_json(index)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index} has no weight_map; re-download the model")
        files = [folder / name for name in dict.fromkeys(weight_map.values())]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(
                f"{folder.name} is missing {missing[0]}"
                + (f" and {len(missing) - 1} more shard(s)" if len(missing) > 1 else "")
                + f" listed in {INDEX_NAME}: download it again"
            )
        return files
    single = folder / SINGLE_NAME
    if single.is_file():
        return [single]
    files = sorted(folder.glob("*.safetensors"))
    # Mistral repos ship consolidated.safetensors (their own layout) beside HF shards.
    hf_files = [f for f in files if not f.name.startswith("consolidated")]
    files = hf_files or files
    if not files:
        raise ModelLoadError(f"{folder} holds no *.safetensors weights; download the model's weight files")
    return files


def read_header(file: str | Path) -> dict[str, TensorInfo]:
    """One file's tensors, checking that the file is as long as its header says."""
    file = Path(file)
    try:
        size = file.stat().st_size
        with file.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelLoadError(f"{file.name} is truncated ({size} bytes, no header): download it again")
            (length,) = struct.unpack("<Q", head)
            if length > _MAX_HEADER:
                raise ModelLoadError(
                    f"{file.name} is not a safetensors file (header length {length}): download it again"
                )
            raw = f.read(length)
    except OSError as e:
        raise ModelLoadError(f"cannot read {file}: {e.strerror or e}") from None
    if len(raw) < length:
        raise ModelLoadError(
            f"{file.name} is truncated (expected at least {8 + length} bytes, found {size}): download it again"
        )
    try:
        header: dict[str, Any] = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ModelLoadError(f"{file.name} has a corrupt safetensors header: download it again") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{file.name} has a corrupt safetensors header: download it again")

    tensors: dict[str, TensorInfo] = {}
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = entry["dtype"]
            shape = tuple(int(d) for d in entry["shape"])
            begin, stop = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ModelLoadError(f"{file.name} has a corrupt entry for {name}: download it again") from None
        nbytes = stop - begin
        expected = math.prod(shape) * DTYPE_BYTES.get(dtype, 0)
        if dtype in DTYPE_BYTES and nbytes != expected:
            raise ModelLoadError(
                f"{file.name} is corrupt: {name} holds {nbytes} bytes but {dtype}{list(shape)} needs {expected}"
            )
        tensors[name] = TensorInfo(dtype=dtype, shape=shape, nbytes=nbytes, file=file, offset=8 + length + begin)
        end = max(end, stop)
    expected_size = 8 + length + end
    if size < expected_size:
        raise ModelLoadError(
            f"{file.name} is truncated (expected {expected_size} bytes, found {size}): download it again"
        )
    return tensors


def read_headers(files: list[Path]) -> dict[str, TensorInfo]:
    """Every tensor of a model, by name, across its shards."""
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        for name, info in read_header(file).items():
            if name in tensors:
                raise ModelLoadError(
                    f"{name} appears in both {tensors[name].file.name} and {file.name}; re-download the model"
                )
            tensors[name] = info
    return tensors


def check_index(folder: Path, headers: dict[str, TensorInfo]) -> None:
    """Every tensor the index promises must be in the shard it names."""
    index = folder / INDEX_NAME
    if not index.is_file():
        return
    from engine.artifacts.config import read_json

    for name, shard in read_json(index).get("weight_map", {}).items():
        info = headers.get(name)
        if info is None or info.file.name != shard:
            raise ModelLoadError(f"{shard} does not hold {name} as {INDEX_NAME} says: download it again")


def load_weights(files: list[Path]) -> dict[str, Any]:
    """Every tensor of the files as mx.arrays (lazy: data is read when evaluated)."""
    import mlx.core as mx

    weights: dict[str, Any] = {}
    for file in files:
        try:
            loaded = mx.load(str(file))
        except Exception as e:  # mlx raises RuntimeError/ValueError with C++ text
            raise ModelLoadError(f"cannot load {file.name}: {str(e).splitlines()[0]}; download it again") from None
        if not isinstance(loaded, dict):
            raise ModelLoadError(f"{file.name} did not load as a set of named tensors")
        weights.update(loaded)
    return weights


def weights_bytes(headers: dict[str, TensorInfo], cast_bytes: int | None = None) -> int:
    """Bytes the tensors take once loaded; float tensors re-sized when cast to another width."""
    total = 0
    for info in headers.values():
        if cast_bytes is not None and info.dtype in FLOAT_DTYPES:
            total += info.numel * cast_bytes
        else:
            total += info.nbytes
    return total


def parameter_count(headers: dict[str, TensorInfo], quantization: Any = None) -> int:
    """Parameters as the unquantized model counts them.

    A quantized ``x.weight`` packs several values per uint32 word; its ``x.scales`` hold
    one value per group, so columns = groups * group_size, the group size coming from
    the config's quantization block (per-layer overrides included). Scales and biases
    of quantized weights (and nvfp4's per-expert global scales) are not parameters.
    """
    total = 0
    for name, info in headers.items():
        if name.endswith("_blocks") and info.dtype == "U8":  # OpenAI's MXFP4: two values a byte
            total += info.numel * 2
            continue
        if name.endswith("_scales") and name[: -len("_scales")] + "_blocks" in headers:
            continue
        base, _, leaf = name.rpartition(".")
        packed = headers.get(base + ".weight")
        if leaf in ("scales", "biases", "global_scale") and packed is not None and packed.dtype == "U32":
            continue
        scales = headers.get(base + ".scales")
        if leaf == "weight" and info.dtype == "U32" and scales is not None and scales.shape:
            group_size = 64
            if quantization is not None:
                params = quantization.params_for(base)
                group_size = params["group_size"] if params else quantization.group_size
            total += math.prod(info.shape[:-1]) * scales.shape[-1] * group_size
            continue
        total += info.numel
    return total
