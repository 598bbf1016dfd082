"""Make the reference folder and outputs for the Voxtral family.

Run with an environment that has transformers and torch (never needed by the tests):

    python tests/golden/make_voxtral_goldens.py [--data ../shared/data]

Writes tests/golden/voxtral_tiny/, a Hugging Face folder as ``save_pretrained`` writes it:
a tiny random VoxtralForConditionalGeneration (128 mels and 1500 encoder positions as the
real one; audio width 16 with an intermediate size of 4 x 16, so four encoder frames make
one audio token as in the real 1280/5120 model; a 2-layer Llama of width 48), a word-level
tokenizer whose special ids sit where Mistral's tekken vocabulary has them ([AUDIO] = 24,
[BEGIN_AUDIO] = 25, the id VoxtralProcessor hard-codes), and a chat template laying out
a user turn as mistral-common's instruct encoder does: ``<s>[INST][BEGIN_AUDIO][AUDIO]..
text[/INST]``. tests/golden/media/voxtral_tiny.npz / .json hold:

- the features of transformers' processor path (WhisperFeatureExtractor with
  VoxtralProcessor's audio settings: padded to a multiple of 30 s, then cut into chunks
  of 3000 frames) for jfk.wav (11 s, one chunk) and for jfk.wav three times (33 s, two
  chunks, one global log-mel range);
- the projected audio embeddings ``get_audio_features`` gives for both;
- for a chat asking about jfk.wav: the prompt ids with 375 [AUDIO] tokens per 30 s chunk
  (mistral-common's count: padded samples / hop 160 / 8 frames per token), transformers'
  greedy ids with their log-probabilities and the last prompt position's logits.

The real processor tokenizes through mistral-common's tekken tokenizer, which a tiny
vocabulary cannot stand in for; the template here reproduces its layout instead. Weights
come from ``synthetic_weight``. This script does not import the engine.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import wave
from pathlib import Path

import numpy as np
from synthetic_weights import synthetic_weight

HERE = Path(__file__).resolve().parent
OUT = HERE / "voxtral_tiny"
STRIDE = 7
STEPS = 12
VOCAB = 160
# Tekken's first special ids, as Voxtral-Mini-3B-2507 numbers them; fillers elsewhere.
SPECIALS = {
    0: "<unk>",
    1: "<s>",
    2: "</s>",
    3: "[INST]",
    4: "[/INST]",
    11: "<pad>",
    17: "[SYSTEM_PROMPT]",
    18: "[/SYSTEM_PROMPT]",
    24: "[AUDIO]",
    25: "[BEGIN_AUDIO]",
    34: "[TRANSCRIBE]",
}
N_SPECIAL = 36
WORDS = [
    "what",
    "is",
    "said",
    "in",
    "this",
    "clip",
    "?",
    "the",
    "a",
    "speech",
    "ask",
    "not",
    "who",
    "speaks",
    "summarise",
    "it",
    ".",
    ",",
]
CONFIG = {
    "model_type": "voxtral",
    "audio_token_id": 24,
    "projector_hidden_act": "gelu",
    "audio_config": {
        "model_type": "voxtral_encoder",
        "num_mel_bins": 128,
        "hidden_size": 16,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "max_source_positions": 1500,
        "activation_function": "gelu",
        "scale_embedding": False,
        "vocab_size": 51866,
    },
    "text_config": {
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": 48,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 12,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
    },
}
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'user' %}[INST]"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'audio' %}[BEGIN_AUDIO][AUDIO]"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}[/INST]"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)
QUESTION = "what is said in this clip ?"
# VoxtralProcessor's default audio settings (its audio_kwargs).
CHUNK_SAMPLES = 480000
CHUNK_FRAMES = 3000


def read_pcm16_wav(path: Path) -> np.ndarray:
    with wave.open(str(path)) as w:
        assert w.getsampwidth() == 2 and w.getnchannels() == 1 and w.getframerate() == 16000
        return np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768.0


def tokenizer():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {SPECIALS.get(i, f"<SPECIAL_{i}>"): i for i in range(N_SPECIAL)}
    for w in WORDS:
        vocab[w] = len(vocab)
    for i in range(len(vocab), VOCAB):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens(
        [AddedToken(SPECIALS.get(i, f"<SPECIAL_{i}>"), special=True, normalized=False) for i in range(N_SPECIAL)]
    )
    return tok


def audio_tokens(n_samples: int) -> int:
    """mistral-common's count for one clip: pad to whole 30 s chunks, 160-sample hops, 8 per token."""
    padded = math.ceil(n_samples / CHUNK_SAMPLES) * CHUNK_SAMPLES
    return math.ceil((padded // 160) / 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=HERE.parents[2] / "shared" / "data")
    args = parser.parse_args()

    import torch
    import transformers
    from transformers import (
        PreTrainedTokenizerFast,
        VoxtralConfig,
        VoxtralForConditionalGeneration,
        WhisperFeatureExtractor,
    )

    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir(parents=True)
    tok = tokenizer()
    tok.save(str(OUT / "tokenizer.json"))
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_file=str(OUT / "tokenizer.json"),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    hf_tok.chat_template = TEMPLATE
    assert tok.token_to_id("[AUDIO]") == CONFIG["audio_token_id"]

    config = VoxtralConfig(**{k: v for k, v in CONFIG.items() if k != "model_type"})
    torch.manual_seed(0)
    model = VoxtralForConditionalGeneration(config).eval()
    shapes = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(synthetic_weight(name, tuple(p.shape))))
            shapes[name] = list(p.shape)
    model.save_pretrained(OUT, safe_serialization=True)
    hf_tok.save_pretrained(OUT)
    fe = WhisperFeatureExtractor(feature_size=128)
    fe.save_pretrained(OUT)

    def features(samples: np.ndarray) -> torch.Tensor:
        # VoxtralProcessor._retrieve_input_features with its default audio_kwargs.
        out = fe(
            samples,
            sampling_rate=16000,
            padding=True,
            truncation=False,
            pad_to_multiple_of=CHUNK_SAMPLES,
            return_tensors="pt",
        )["input_features"]
        return out.reshape(128, -1, CHUNK_FRAMES).transpose(0, 1)

    jfk = read_pcm16_wav(args.data / "audio" / "jfk.wav")
    clips = {"short": jfk, "long": np.concatenate([jfk, jfk, jfk])}
    arrays: dict[str, np.ndarray] = {}
    for key, samples in clips.items():
        feats = features(samples)
        with torch.no_grad():
            projected = model.get_audio_features(feats).pooler_output.numpy()
        assert projected.shape[0] == audio_tokens(samples.shape[0]), (projected.shape, key)
        arrays[f"{key}/features"] = feats.numpy()[:, :, ::STRIDE].astype(np.float32)
        arrays[f"{key}/projected"] = projected.astype(np.float32)

    messages = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": QUESTION}]}]
    text = hf_tok.apply_chat_template(messages, tokenize=False)
    n_audio = audio_tokens(jfk.shape[0])
    ids = hf_tok(text.replace("[AUDIO]", "[AUDIO]" * n_audio), add_special_tokens=False)["input_ids"]
    assert ids.count(24) == n_audio and ids[0] == 1
    inputs = {
        "input_ids": torch.tensor([ids]),
        "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
        "input_features": features(jfk),
    }
    with torch.no_grad():
        gen = model.generate(
            **inputs,
            max_new_tokens=STEPS,
            do_sample=False,
            num_beams=1,
            output_scores=True,
            return_dict_in_generate=True,
            eos_token_id=None,
        )
        last_logits = model(**inputs).logits[0, -1].numpy()
    new = gen.sequences[0, len(ids) :].tolist()
    logprobs, margins = [], []
    for step, scores in enumerate(gen.scores):
        lp = torch.log_softmax(scores[0].float(), -1)
        logprobs.append(float(lp[new[step]]))
        top2 = torch.topk(scores[0], 2).values
        margins.append(float(top2[0] - top2[1]))
    arrays["prompt/ids"] = np.asarray(ids, dtype=np.int64)
    arrays["prompt/last_logits"] = last_logits.astype(np.float32)
    arrays["greedy/ids"] = np.asarray(new, dtype=np.int64)
    arrays["greedy/logprobs"] = np.asarray(logprobs, dtype=np.float32)
    np.savez_compressed(HERE / "media" / "voxtral_tiny.npz", **arrays)
    meta = {
        "config": CONFIG,
        "parameters": shapes,
        "chat_template": TEMPLATE,
        "messages": messages,
        "prompt_text": text,
        "audio_tokens": {k: audio_tokens(v.shape[0]) for k, v in clips.items()},
        "steps": STEPS,
        "stride": STRIDE,
        "smallest_margin": min(margins),
        "versions": {"transformers": transformers.__version__, "torch": torch.__version__},
    }
    (HERE / "media" / "voxtral_tiny.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(f"voxtral: {n_audio} audio tokens, prompt {len(ids)} ids, greedy {new}, smallest margin {min(margins):.4f}")
    print("files:", sorted((p.name, p.stat().st_size) for p in OUT.iterdir()))


if __name__ == "__main__":
    main()
