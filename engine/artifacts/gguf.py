"""GGUF import for the llama family: header reading, name mapping, RoPE layout.

``read_gguf_header`` parses the key/value metadata and tensor table ourselves (no
weights loaded), which gives the config, parameter count, memory plan and truncation
check up front. ``load_gguf`` then lets MLX read the tensors and turns them into the
Hugging Face names and layout that ``engine.models.llama`` expects, so one model file
serves both formats.
"""

from __future__ import annotations

import math
import re
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from engine.errors import ModelLoadError, UnsupportedModelError

SUPPORTED_ARCHITECTURES = ("llama",)

# ggml tensor types: id -> (name, values per block, bytes per block).
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8),
    28: ("F64", 1, 8), 30: ("BF16", 1, 2),
}  # fmt: skip
# What MLX's GGUF reader can hand back (others it cannot decode).
MLX_READABLE = {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0"}

# GGUF metadata value types: id -> struct format (strings, arrays handled apart).
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

# GGUF tensor name -> Hugging Face module path ({} is the layer index).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Modules that are Linear or Embedding in the model, so a quantized tensor can stay packed.
_QUANTIZABLE = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "token_embd", "output"}
# Tensors the HF layout has no place for: llama 3's rope_freqs is recomputed from rope_scaling.
_SKIPPED = {"rope_freqs"}
_BLOCK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias|scales|biases)$")
_TOP = re.compile(r"^([a-z_]+)\.(weight|bias|scales|biases)$")


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type_name: str
    shape: tuple[int, ...]  # numpy order (rows first), as MLX hands it back
    nbytes: int
    offset: int  # from the start of the file

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class GGUFHeader:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    def quantization(self) -> str:
        """The most common type among 2-D tensors: "Q8_0", "Q4_0", "F16", ..."""
        counts = Counter(t.type_name for t in self.tensors.values() if len(t.shape) >= 2)
        return counts.most_common(1)[0][0] if counts else "F32"

    def weights_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


class _Reader:
    def __init__(self, f: BinaryIO, path: Path, size: int):
        self.f, self.path, self.size = f, path, size

    def take(self, n: int) -> bytes:
        # A count in the header (an array of 2**40 items) is checked against the bytes the
        # file has left before anything is allocated for it.
        if n > self.size - self.f.tell():
            raise ModelLoadError(f"{self.path.name} is truncated inside its GGUF header: download it again")
        data = self.f.read(n)
        if len(data) < n:
            raise ModelLoadError(f"{self.path.name} is truncated inside its GGUF header: download it again")
        return data

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.scalar("<Q")
        if n > 1 << 30:
            raise ModelLoadError(f"{self.path.name} has a corrupt GGUF header (string of {n} bytes)")
        return self.take(n).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("<I"), self.scalar("<Q")
            if etype in _SCALARS:  # read numeric arrays in one go
                fmt = _SCALARS[etype]
                size = struct.calcsize(fmt)
                return list(struct.unpack(f"<{count}{fmt[1]}", self.take(size * count)))
            return [self.value(etype) for _ in range(count)]
        raise ModelLoadError(f"{self.path.name} has a corrupt GGUF header (value type {vtype})")


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Metadata and tensor table of a GGUF file, checking the file holds every tensor."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            r = _Reader(f, path, size)
            if r.take(4) != b"GGUF":
                raise ModelLoadError(f"{path.name} is not a GGUF file (bad magic bytes)")
            version = r.scalar("<I")
            if version not in (2, 3):
                raise UnsupportedModelError(f"{path.name} is GGUF version {version}; only versions 2 and 3 are read")
            n_tensors, n_kv = r.scalar("<Q"), r.scalar("<Q")
            metadata: dict[str, Any] = {}
            for _ in range(n_kv):
                key = r.string()
                metadata[key] = r.value(r.scalar("<I"))
            raw_tensors = []
            for _ in range(n_tensors):
                name = r.string()
                dims = [r.scalar("<Q") for _ in range(r.scalar("<I"))]
                raw_tensors.append((name, dims, r.scalar("<I"), r.scalar("<Q")))
            header_end = f.tell()
    except OSError as e:
        raise ModelLoadError(f"cannot read {path}: {e.strerror or e}") from None

    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or not 0 < alignment <= 1 << 20:
        raise ModelLoadError(
            f"{path.name} has a corrupt GGUF header (general.alignment {alignment!r}, "
            "a positive number of bytes such as 32): download it again"
        )
    data_start = -(-header_end // alignment) * alignment
    tensors: dict[str, GGUFTensor] = {}
    end = data_start
    for name, dims, type_id, offset in raw_tensors:
        type_name, block, block_bytes = GGML_TYPES.get(type_id, (f"type{type_id}", 1, 0))
        numel = math.prod(dims)
        nbytes = numel // block * block_bytes
        # GGUF lists dims fastest-first (ne0 = columns); numpy order is the reverse.
        tensors[name] = GGUFTensor(name, type_name, tuple(reversed(dims)), nbytes, data_start + offset)
        end = max(end, data_start + offset + nbytes)
    if size < end:
        raise ModelLoadError(f"{path.name} is truncated (expected {end} bytes, found {size}): download it again")
    return GGUFHeader(path=path, version=version, metadata=metadata, tensors=tensors)


def gguf_config(header: GGUFHeader) -> dict[str, Any]:
    """A config.json-style dict for the llama family from GGUF metadata."""
    arch = header.architecture
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{header.path.name} is a GGUF of architecture {arch!r}; GGUF import supports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}. Use an MLX or safetensors version of this model."
        )
    md = header.metadata

    def get(key: str, default: Any = None) -> Any:
        return md.get(f"{arch}.{key}", default)

    hidden = get("embedding_length")
    heads = get("attention.head_count")
    if hidden is None or heads is None or get("block_count") is None:
        raise ModelLoadError(f"{header.path.name} lacks {arch}.embedding_length/block_count/head_count metadata")
    kv_heads = get("attention.head_count_kv", heads)
    head_dim = get("attention.key_length", hidden // heads)
    embed = header.tensors.get("token_embd.weight")
    vocab = len(md.get("tokenizer.ggml.tokens", [])) or (embed.shape[0] if embed else get("vocab_size", 0))
    config: dict[str, Any] = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": int(hidden),
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length", 4 * hidden)),
        "num_attention_heads": int(heads),
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "vocab_size": int(vocab),
        "tie_word_embeddings": "output.weight" not in header.tensors,
        "attention_bias": False,
        "mlp_bias": False,
        "rope_scaling": None,
    }
    scaling = get("rope.scaling.type")
    if scaling in ("linear", "yarn") and get("rope.scaling.factor"):
        config["rope_scaling"] = {"rope_type": scaling, "type": scaling, "factor": float(get("rope.scaling.factor"))}
    for key, md_key in (
        ("bos_token_id", "tokenizer.ggml.bos_token_id"),
        ("eos_token_id", "tokenizer.ggml.eos_token_id"),
    ):
        if md_key in md:
            config[key] = int(md[md_key])
    return config


def check_readable(header: GGUFHeader) -> None:
    unreadable = sorted({t.type_name for t in header.tensors.values()} - MLX_READABLE)
    if unreadable:
        raise UnsupportedModelError(
            f"{header.path.name} holds {', '.join(unreadable)} tensors, which MLX cannot read; "
            "pick a Q4_0, Q8_0, F16 or F32 GGUF, or an MLX version of the model"
        )


def hf_name(gguf_name: str) -> tuple[str, str] | None:
    """(module path, leaf) in HF naming, or None for tensors the HF layout leaves out."""
    m = _BLOCK.match(gguf_name)
    if m:
        layer, part, leaf = m.groups()
        if part not in _LAYER_NAMES:
            raise UnsupportedModelError(f"GGUF tensor {gguf_name} has no place in a llama model")
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}", leaf
    m = _TOP.match(gguf_name)
    if m and m.group(1) in _SKIPPED:
        return None
    if m and m.group(1) in _TOP_NAMES:
        return _TOP_NAMES[m.group(1)], m.group(2)
    raise UnsupportedModelError(f"GGUF tensor {gguf_name} has no place in a llama model")


def unpermute_rope(w: Any, n_heads: int) -> Any:
    """GGML's adjacent-pair RoPE rows back to Hugging Face's rotate-half order.

    Within each head, GGML rotates rows (2i, 2i+1) together; HF rotates (i, i + d/2).
    Rows are independent, so the same reordering works for a packed quantized matrix,
    its scales and biases, and a 1-D bias.
    """
    rows = w.shape[0]
    head_dim = rows // n_heads
    rest = tuple(w.shape[1:])
    return w.reshape(n_heads, head_dim // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def load_gguf(path: str | Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """(config dict, HF-named weights, metadata as plain Python values) of a llama GGUF."""
    import mlx.core as mx

    header = read_gguf_header(path)
    config = gguf_config(header)
    check_readable(header)
    try:
        loaded = mx.load(str(header.path))
    except Exception as e:
        raise ModelLoadError(f"cannot load {header.path.name}: {str(e).splitlines()[0]}") from None

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    weights: dict[str, Any] = {}
    packed: dict[str, int] = {}  # module path -> bits, for tensors kept quantized
    for name in sorted(loaded):
        mapped = hf_name(name)
        if mapped is None:
            continue
        module, leaf = mapped
        gguf_part = name.split(".")[-2]
        value = loaded[name]
        if leaf in ("scales", "biases"):
            continue  # handled with their weight
        if f"{name[: -len(leaf)]}scales" in loaded:
            base = name[: -len(leaf)]
            scales, biases = loaded[base + "scales"], loaded[base + "biases"]
            bits = value.shape[-1] * 32 // (scales.shape[-1] * 32)
            if gguf_part in _QUANTIZABLE:
                weights[f"{module}.scales"], weights[f"{module}.biases"] = scales, biases
                packed[module] = bits
            else:  # a quantized tensor where the model wants floats: unpack it
                value = mx.dequantize(value, scales, biases, group_size=32, bits=bits)
        weights[f"{module}.{'weight' if leaf == 'weight' else 'bias'}"] = value

    for module in {k.rsplit(".", 1)[0] for k in weights}:
        n = heads if module.endswith("q_proj") else kv_heads if module.endswith("k_proj") else 0
        if n:
            for leaf in ("weight", "bias", "scales", "biases"):
                key = f"{module}.{leaf}"
                if key in weights:
                    weights[key] = unpermute_rope(weights[key], n)

    if packed:
        common = Counter(packed.values()).most_common(1)[0][0]
        block: dict[str, Any] = {"group_size": 32, "bits": common, "mode": "affine"}
        for module, bits in packed.items():
            if bits != common:
                block[module] = {"group_size": 32, "bits": bits}
        config["quantization"] = block
    # Metadata as the header parser yields it: plain ints, floats, str, bool and lists.
    return config, weights, dict(header.metadata)
