"""GGUF import: the real stories260K model's published greedy sample, and quantized files.

The quantized files are written here block by block as llama.cpp lays out Q8_0 and
Q4_0, from a model in Hugging Face layout, with Q/K permuted the way llama.cpp's
converter does; the loaded model must match the float model built from the same
dequantized values.
"""

from __future__ import annotations

import re
import struct

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from tiny_checkpoints import build_model

from engine.artifacts.gguf import read_gguf_header, unpermute_rope
from engine.errors import ModelLoadError, UnsupportedModelError
from engine.runtime.loading import load_model

# ---- stories260K: a real trained model ----------------------------------------------


def _decode(pieces: list[str], ids: list[int]) -> str:
    out = b""
    for i in ids:
        piece = pieces[i]
        if re.fullmatch(r"<0x[0-9A-F]{2}>", piece):
            out += bytes([int(piece[3:5], 16)])
        else:
            out += piece.replace("\u2581", " ").encode()
    return out.decode("utf-8")


def test_stories260k_greedy_sample_matches_the_published_text(shared_data):
    """Greedy argmax from BOS=1 for 256 tokens gives Karpathy's sample character for character."""
    folder = shared_data / "tiny_llm"
    doc = (folder / "stories260K.md").read_text()
    expected = doc.split("-t 0.0\n", 1)[1].split("\n```", 1)[0]

    loaded = load_model(folder / "stories260K.gguf")
    assert loaded.config.model_type == "llama" and loaded.dtype == "float32"
    assert loaded.gguf_metadata["tokenizer.ggml.bos_token_id"] == 1
    assert loaded.config.eos_token_ids == [2]
    model, cache = loaded.model, loaded.model.make_cache()
    token, ids = 1, []
    for _ in range(256):
        logits = model(mx.array([[token]]), cache=cache)
        token = int(mx.argmax(logits[0, -1]).item())
        ids.append(token)
    text = _decode(loaded.gguf_metadata["tokenizer.ggml.tokens"], ids)
    assert text.lstrip(" ") == expected  # SentencePiece's leading space is the detokenizer's to drop


def test_stories260k_header_and_config(shared_data):
    header = read_gguf_header(shared_data / "tiny_llm" / "stories260K.gguf")
    assert header.version == 3 and len(header.tensors) == 48 and len(header.metadata) == 19
    assert header.tensors["blk.0.attn_k.weight"].shape == (32, 64)  # (out, in)
    assert sum(t.numel for t in header.tensors.values()) == 292_800
    loaded = load_model(shared_data / "tiny_llm" / "stories260K.gguf")
    raw = loaded.config.raw
    assert (raw["hidden_size"], raw["num_hidden_layers"], raw["intermediate_size"]) == (64, 5, 172)
    assert (raw["num_attention_heads"], raw["num_key_value_heads"], raw["head_dim"]) == (8, 4, 8)
    assert raw["vocab_size"] == 512 and raw["max_position_embeddings"] == 2048
    assert abs(raw["rms_norm_eps"] - 1e-5) < 1e-9 and raw["tie_word_embeddings"] is False
    assert loaded.tokenizer_path is None


def test_unpermute_inverts_the_llama_cpp_permutation():
    rng = np.random.default_rng(0)
    n_heads, head_dim, cols = 3, 8, 5
    hf = rng.standard_normal((n_heads * head_dim, cols)).astype(np.float32)
    # llama.cpp's converter: HF rotate-half rows -> GGML adjacent pairs.
    ggml = hf.reshape(n_heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(hf.shape)
    back = np.array(unpermute_rope(mx.array(ggml), n_heads))
    np.testing.assert_array_equal(back, hf)
    bias = rng.standard_normal(n_heads * head_dim).astype(np.float32)
    ggml_bias = bias.reshape(n_heads, 2, head_dim // 2).swapaxes(1, 2).reshape(-1)
    np.testing.assert_array_equal(np.array(unpermute_rope(mx.array(ggml_bias), n_heads)), bias)


# ---- a GGUF writer for test files -----------------------------------------------------

F32, Q4_0, Q8_0 = 0, 2, 8
CONFIG = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 96,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
HF_TO_GGUF = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _string(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _value(v) -> bytes:
    if isinstance(v, str):
        return struct.pack("<I", 8) + _string(v)
    if isinstance(v, float):
        return struct.pack("<If", 6, v)
    if isinstance(v, int):
        return struct.pack("<II", 4, v)
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        return struct.pack("<IIQ", 9, 8, len(v)) + b"".join(_string(x) for x in v)
    raise TypeError(v)


def quantize_q8_0(x: np.ndarray) -> tuple[bytes, np.ndarray]:
    blocks = x.reshape(-1, 32).astype(np.float32)
    d = (np.abs(blocks).max(axis=1) / 127).astype(np.float16)
    q = np.round(blocks / np.where(d == 0, 1, d.astype(np.float32))[:, None]).astype(np.int8)
    raw = b"".join(d[i].tobytes() + q[i].tobytes() for i in range(len(blocks)))
    return raw, (q.astype(np.float32) * d.astype(np.float32)[:, None]).reshape(x.shape)


def quantize_q4_0(x: np.ndarray) -> tuple[bytes, np.ndarray]:
    blocks = x.reshape(-1, 32).astype(np.float32)
    idx = np.abs(blocks).argmax(axis=1)
    d = (blocks[np.arange(len(blocks)), idx] / -8).astype(np.float16)
    inv = 1 / np.where(d == 0, 1, d.astype(np.float32))
    q = np.minimum(15, np.floor(blocks * inv[:, None] + 8.5)).astype(np.uint8)
    packed = q[:, :16] | (q[:, 16:] << 4)
    raw = b"".join(d[i].tobytes() + packed[i].tobytes() for i in range(len(blocks)))
    return raw, ((q.astype(np.float32) - 8) * d.astype(np.float32)[:, None]).reshape(x.shape)


def write_gguf(path, metadata: dict, tensors: list[tuple[str, int, np.ndarray, bytes]]) -> None:
    """tensors: (name, ggml type, array in numpy order, raw data bytes)."""
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata))
    for key, value in metadata.items():
        out += _string(key) + _value(value)
    offset, blobs = 0, []
    for name, gtype, array, raw in tensors:
        dims = list(reversed(array.shape))
        out += _string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        out += struct.pack("<IQ", gtype, offset)
        pad = -len(raw) % 32
        blobs.append(raw + b"\0" * pad)
        offset += len(raw) + pad
    out += b"\0" * (-len(out) % 32)
    path.write_bytes(out + b"".join(blobs))


def make_gguf(path, quant: dict[str, int], arch: str = "llama"):
    """A tiny llama as GGUF; ``quant`` maps GGUF short names to a ggml type (default F32).

    Returns the float model holding exactly the values the file encodes.
    """
    model = build_model(CONFIG, seed=5)
    params = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    heads, kv_heads = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"]
    tensors, decoded = [], {}
    for hf_name, value in sorted(params.items()):
        m = re.match(r"model\.layers\.(\d+)\.(.+)\.weight$", hf_name)
        if m:
            short = HF_TO_GGUF[m.group(2)]
            name = f"blk.{m.group(1)}.{short}.weight"
        else:
            short = {
                "model.embed_tokens.weight": "token_embd",
                "model.norm.weight": "output_norm",
                "lm_head.weight": "output",
            }[hf_name]
            name = f"{short}.weight"
        n = {"attn_q": heads, "attn_k": kv_heads}.get(short)
        ggml = value
        if n:  # the converter's HF -> GGML permutation
            ggml = value.reshape(n, 2, value.shape[0] // n // 2, -1).swapaxes(1, 2).reshape(value.shape)
        gtype = quant.get(short, F32) if value.ndim == 2 else F32
        if gtype == Q8_0:
            raw, values = quantize_q8_0(ggml)
        elif gtype == Q4_0:
            raw, values = quantize_q4_0(ggml)
        else:
            raw, values = ggml.astype(np.float32).tobytes(), ggml.astype(np.float32)
        if n:
            values = values.reshape(n, values.shape[0] // n // 2, 2, -1).swapaxes(1, 2).reshape(values.shape)
        decoded[hf_name] = mx.array(values)
        tensors.append((name, gtype, ggml, raw))
    metadata = {
        "general.architecture": arch,
        f"{arch}.context_length": 256,
        f"{arch}.embedding_length": 64,
        f"{arch}.block_count": 2,
        f"{arch}.feed_forward_length": 128,
        f"{arch}.attention.head_count": heads,
        f"{arch}.attention.head_count_kv": kv_heads,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [f"t{i}" for i in range(CONFIG["vocab_size"])],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }
    write_gguf(path, metadata, tensors)
    reference = build_model(CONFIG)
    reference.load_weights(list(decoded.items()))
    return reference


IDS = mx.array([[1, 5, 9, 33, 70, 2, 95, 14]])


def assert_same_function(loaded, reference):
    """Each packed layer computes what the float layer with the decoded values computes;
    the whole model agrees up to the float16 rounding of dequantized embedding rows."""
    x = mx.random.normal((3, 64), key=mx.random.key(1))
    for name in ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj"):
        ours = loaded.model.layers[1]
        theirs = reference.model.layers[1]
        for part in name.split("."):
            ours, theirs = getattr(ours, part), getattr(theirs, part)
        assert mx.allclose(ours(x), theirs(x), atol=1e-4).item(), name
    assert mx.allclose(loaded.lm_head(x), reference.lm_head(x), atol=1e-4).item()
    ours, theirs = loaded(IDS), reference(IDS)
    assert mx.abs(ours - theirs).max().item() < 2e-2
    assert mx.array_equal(ours.argmax(-1), theirs.argmax(-1)).item()


def test_float_gguf_matches_its_hf_layout_model(tmp_path):
    reference = make_gguf(tmp_path / "f32.gguf", {})
    loaded = load_model(tmp_path / "f32.gguf")
    assert loaded.config.quantization is None
    assert mx.allclose(loaded.model(IDS), reference(IDS), atol=1e-4).item()


@pytest.mark.parametrize(("gtype", "bits"), [(Q8_0, 8), (Q4_0, 4)])
def test_quantized_gguf_stays_quantized(tmp_path, gtype, bits):
    linear = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down", "token_embd", "output"]
    reference = make_gguf(tmp_path / "q.gguf", dict.fromkeys(linear, gtype))
    assert read_gguf_header(tmp_path / "q.gguf").quantization() == {8: "Q8_0", 4: "Q4_0"}[bits]
    loaded = load_model(tmp_path / "q.gguf")
    q_proj = loaded.model.model.layers[0].self_attn.q_proj
    assert (q_proj.bits, q_proj.group_size) == (bits, 32)
    assert loaded.model.model.embed_tokens.bits == bits
    assert_same_function(loaded.model, reference)


def test_mixed_gguf_gets_per_layer_overrides(tmp_path):
    quant = dict.fromkeys(["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "token_embd"], Q4_0)
    quant.update(ffn_down=Q8_0, output=Q8_0)
    reference = make_gguf(tmp_path / "mixed.gguf", quant)
    loaded = load_model(tmp_path / "mixed.gguf")
    block = loaded.config.quantization
    assert (block.bits, block.group_size) == (4, 32)
    assert block.params_for("lm_head")["bits"] == 8
    assert loaded.model.model.layers[1].mlp.down_proj.bits == 8
    assert loaded.model.model.layers[1].mlp.up_proj.bits == 4
    assert_same_function(loaded.model, reference)


def test_other_architectures_are_refused_by_name(tmp_path):
    make_gguf(tmp_path / "phi.gguf", {}, arch="phi2")
    with pytest.raises(UnsupportedModelError, match="architecture 'phi2'.*supports llama"):
        load_model(tmp_path / "phi.gguf")


def test_truncated_gguf(tmp_path):
    make_gguf(tmp_path / "t.gguf", {})
    data = (tmp_path / "t.gguf").read_bytes()
    (tmp_path / "t.gguf").write_bytes(data[:-1000])
    with pytest.raises(ModelLoadError, match=r"t.gguf is truncated \(expected \d+ bytes"):
        load_model(tmp_path / "t.gguf")
    (tmp_path / "t.gguf").write_bytes(data[:100])
    with pytest.raises(ModelLoadError, match="truncated inside its GGUF header"):
        load_model(tmp_path / "t.gguf")


def test_not_a_gguf(tmp_path):
    (tmp_path / "x.gguf").write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(tmp_path / "x.gguf")
