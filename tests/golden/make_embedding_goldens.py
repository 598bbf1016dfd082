"""Make the reference embeddings the embedding tests compare against.

Needs torch, transformers and sentence-transformers (the tests do not). Two tiny random
sentence-transformers models, each saved the way sentence-transformers saves it (weights
bfloat16 on disk; the reference runs in float32 on exactly those rounded values):

- qwen3_embedding: a Qwen3 backbone, last-token pooling, normalised (Qwen3-Embedding);
  the tokenizer appends an end token, as Qwen3-Embedding's does.
- embeddinggemma: a Gemma 3 text backbone with bidirectional attention (one layer
  full, two with a window shorter than the texts), mean pooling, two Dense layers,
  normalised (EmbeddingGemma). Its module files are rewritten to the older spelling the
  published repository uses (``sentence_transformers.models.*``, ``pooling_mode_*``
  flags, ``max_seq_length`` in sentence_bert_config.json) and reloaded from there, so the reference reads that spelling too.

expected.json holds the texts, their token ids and sentence-transformers' embeddings
(each text encoded alone; the script checks that batching them, padded, agrees).

    python tests/golden/make_embedding_goldens.py
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.base.modules import Dense, Normalize, Transformer
from sentence_transformers.sentence_transformer.modules import Pooling
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import AutoConfig, AutoModel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from synthetic_weights import synthetic_weight  # noqa: E402

OUT = Path(__file__).resolve().parent / "embeddings"
WORDS = (
    "the a cat dog sat on mat ran fast slow red blue green big small house tree river sky sun moon star "
    "bird fish runs jumps over under near far happy sad old new one two three four five six seven eight "
    "nine ten apple pear bread milk water fire stone wind rain snow day night morning evening city road"
).split()
TEXTS = [
    "the cat sat on the mat",
    "a big red dog ran fast over the old stone road near the river under the blue sky",
    "one two three four five six seven eight nine ten apple pear bread milk water fire stone wind",
    "night",
    # longer than max_seq_length (24): truncated before the end token is added
    "the sun and the moon and the stars over the city road in the morning and the evening day and night "
    "rain snow wind fire water stone",
]

COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

VARIANTS = {
    "qwen3_embedding": dict(
        config=dict(model_type="qwen3", num_hidden_layers=2, head_dim=32, rope_theta=5000.0, tie_word_embeddings=True),
        append_eos=True,
        prepend_bos=False,
        pooling="lasttoken",
        dense=[],
        padding_side="left",
    ),
    "embeddinggemma": dict(
        config=dict(
            model_type="gemma3_text",
            num_hidden_layers=3,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=8,
            use_bidirectional_attention=True,
            rope_theta=20000.0,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            final_logit_softcapping=None,
            hidden_activation="gelu_pytorch_tanh",
        ),
        append_eos=True,
        prepend_bos=True,
        pooling="mean",
        dense=[(64, 96), (96, 48)],
        padding_side="right",
    ),
}


def make_tokenizer(folder: Path, prepend_bos: bool, append_eos: bool, padding_side: str) -> None:
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3}
    for word in WORDS:
        vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    single = " ".join((["<bos>"] if prepend_bos else []) + ["$A"] + (["<eos>"] if append_eos else []))
    tok.post_processor = processors.TemplateProcessing(single=single, special_tokens=[("<bos>", 1), ("<eos>", 2)])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "pad_token": "<pad>",
                "bos_token": "<bos>",
                "eos_token": "<eos>",
                "unk_token": "<unk>",
                "model_max_length": 256,
                "padding_side": padding_side,
            },
            indent=2,
        )
    )


def fill(module: torch.nn.Module, prefix: str = "") -> None:
    """Deterministic weights, rounded to bfloat16 (what is stored) and kept in float32."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            w = torch.from_numpy(synthetic_weight(prefix + name, tuple(p.shape)))
            p.copy_(w.to(torch.bfloat16).to(torch.float32))


def to_published_spelling(folder: Path) -> None:
    modules = json.loads((folder / "modules.json").read_text())
    for m in modules:
        m["type"] = "sentence_transformers.models." + m["type"].rsplit(".", 1)[-1]
    (folder / "modules.json").write_text(json.dumps(modules, indent=2))
    pool_file = folder / "1_Pooling" / "config.json"
    pool = json.loads(pool_file.read_text())
    mode = pool.pop("pooling_mode")
    legacy = {"word_embedding_dimension": pool.pop("embedding_dimension")}
    for key, name in (
        ("cls_token", "cls"),
        ("mean_tokens", "mean"),
        ("max_tokens", "max"),
        ("mean_sqrt_len_tokens", "mean_sqrt_len_tokens"),
        ("weightedmean_tokens", "weightedmean"),
        ("lasttoken", "lasttoken"),
    ):
        legacy[f"pooling_mode_{key}"] = mode == name
    legacy["include_prompt"] = pool.pop("include_prompt", True)
    pool_file.write_text(json.dumps(legacy, indent=2))
    # The published files keep the length limit here, not in the tokenizer's config.
    (folder / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 24, "do_lower_case": False}))
    tok_file = folder / "tokenizer_config.json"
    tok_file.write_text(json.dumps({**json.loads(tok_file.read_text()), "model_max_length": 256}, indent=2))


def make(name: str) -> None:
    spec = VARIANTS[name]
    out = OUT / name
    shutil.rmtree(out, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp) / "hf"
        hf.mkdir()
        config = AutoConfig.for_model(**{**COMMON, **spec["config"]})
        torch.manual_seed(0)
        backbone = AutoModel.from_config(config, dtype=torch.float32)
        fill(backbone, f"{name}.")
        backbone.save_pretrained(hf)
        make_tokenizer(hf, spec["prepend_bos"], spec["append_eos"], spec["padding_side"])
        modules = [Transformer(str(hf), max_seq_length=24), Pooling(64, pooling_mode=spec["pooling"])]
        for i, (n_in, n_out) in enumerate(spec["dense"]):
            dense = Dense(n_in, n_out, bias=False, activation_function=torch.nn.Identity())
            fill(dense, f"{name}.dense{i}.")
            modules.append(dense)
        modules.append(Normalize())
        st = SentenceTransformer(modules=modules, device="cpu")
        st.to(torch.bfloat16)
        st.save(str(out), safe_serialization=True)
    for junk in ("README.md", "config_sentence_transformers.json"):
        (out / junk).unlink(missing_ok=True)
    if name == "embeddinggemma":
        to_published_spelling(out)

    st = SentenceTransformer(str(out), device="cpu", model_kwargs={"dtype": torch.float32})
    st.to(torch.float32)
    alone = np.stack([st.encode([t], convert_to_numpy=True)[0] for t in TEXTS])
    batched = st.encode(TEXTS, convert_to_numpy=True, batch_size=len(TEXTS))
    cos = (alone * batched).sum(-1) / np.linalg.norm(alone, axis=-1) / np.linalg.norm(batched, axis=-1)
    assert (1 - cos).max() < 1e-5, f"{name}: batched and alone disagree: {cos}"
    ids = [st.tokenize([t])["input_ids"][0].tolist() for t in TEXTS]
    assert max(len(i) for i in ids) > 8, "a text must be longer than the sliding window"
    expected = {
        "texts": TEXTS,
        "token_ids": ids,
        "embeddings": alone.astype(float).round(7).tolist(),
        "dimensions": int(alone.shape[1]),
        "max_seq_length": st.max_seq_length,
    }
    (out / "expected.json").write_text(json.dumps(expected, indent=1))
    size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{name}: dims {alone.shape[1]}, tokens {[len(i) for i in ids]}, {size // 1024} KB")


if __name__ == "__main__":
    for variant in sys.argv[1:] or VARIANTS:
        make(variant)
