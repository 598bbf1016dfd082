"""Make the reference outputs for transcription and the Qwen2-Audio family.

Run with an environment that has transformers and torch (never needed by the tests):

    python tests/golden/make_audio_goldens.py [--data ../shared/data]

Writes into tests/golden/media/:

- whisper_asr.json / .npz  a tiny random WhisperForConditionalGeneration with a
  multilingual generation config (language and task tokens, <|notimestamps|>,
  suppress_tokens, begin_suppress_tokens), and transformers' ``model.generate`` greedy
  ids on ../shared/data/audio/jfk.wav: with language detection, with a given language,
  and on a 33 s clip (jfk.wav three times) through long-form ``generate`` (timestamps on,
  whole-clip features, sequential windows).
- whisper_longform.json / .npz  a second tiny random Whisper laid out like the real ones
  (<|endoftext|> first among the specials, 1501 timestamp tokens, max_initial_timestamp_index
  50) and transformers' long-form output on 72 s (jfk.wav and 1 s of silence, six times):
  segments with their tokens and start/end times, and every window's seek; once with the
  default length limit, once with 36 new tokens per window, so windows end mid-segment and
  the next starts at a timestamp rather than 30 s on (the script asserts it). Also the short
  clip with return_timestamps=True.
- qwen2_audio_tiny.json / .npz  a tiny random Qwen2AudioForConditionalGeneration (128
  mels as the real one), the real processor's features and placeholder expansion for a
  chat prompt with the first 4 s of jfk.wav, the projected audio features, and greedy
  ids with their log-probabilities.

Weights come from ``synthetic_weight`` (a seeded generator keyed by parameter name) so
the tests rebuild the same checkpoints without storing them. This script deliberately
does not import the engine: the references stay independent.
"""

from __future__ import annotations

import argparse
import json
import wave
from pathlib import Path

import numpy as np
from synthetic_weights import synthetic_weight

HERE = Path(__file__).resolve().parent
OUT = HERE / "media"
STRIDE = 7

# ---- a tiny multilingual Whisper -------------------------------------------------

# Token layout: ordinary tokens, then Whisper's special tokens in their usual order.
WHISPER_SPECIALS = [
    "<|startoftranscript|>",
    "<|en|>",
    "<|de|>",
    "<|fr|>",
    "<|translate|>",
    "<|transcribe|>",
    "<|startoflm|>",
    "<|startofprev|>",
    "<|nospeech|>",
    "<|notimestamps|>",
]
N_ORDINARY = 100
N_TIMESTAMPS = 18
WHISPER_ASR = {
    "model_type": "whisper",
    "vocab_size": N_ORDINARY + len(WHISPER_SPECIALS) + N_TIMESTAMPS,
    "num_mel_bins": 80,
    "d_model": 64,
    "encoder_layers": 2,
    "encoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_layers": 2,
    "decoder_attention_heads": 4,
    "decoder_ffn_dim": 128,
    "max_source_positions": 1500,
    "max_target_positions": 64,
    "scale_embedding": False,
    "activation_function": "gelu",
    "tie_word_embeddings": True,
}
MAX_NEW_TOKENS = 40
SPACE_ID = 3  # the ordinary token begin_suppress_tokens holds besides <|endoftext|>


def fill(model, torch) -> dict[str, list[int]]:
    shapes = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(synthetic_weight(name, tuple(p.shape))))
            shapes[name] = list(p.shape)
    return shapes


def read_pcm16_wav(path: Path) -> np.ndarray:
    with wave.open(str(path)) as w:
        assert w.getsampwidth() == 2 and w.getnchannels() == 1 and w.getframerate() == 16000
        return np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768.0


def whisper_generation_config(eot: int) -> dict:
    first = N_ORDINARY
    ids = {tok: first + i for i, tok in enumerate(WHISPER_SPECIALS)}
    return {
        "decoder_start_token_id": ids["<|startoftranscript|>"],
        "eos_token_id": eot,
        "pad_token_id": eot,
        "bos_token_id": eot,
        "lang_to_id": {"<|en|>": ids["<|en|>"], "<|de|>": ids["<|de|>"], "<|fr|>": ids["<|fr|>"]},
        "task_to_id": {"translate": ids["<|translate|>"], "transcribe": ids["<|transcribe|>"]},
        "no_timestamps_token_id": ids["<|notimestamps|>"],
        "is_multilingual": True,
        "max_length": WHISPER_ASR["max_target_positions"],
        "begin_suppress_tokens": [SPACE_ID, eot],
        # Filled in below with tokens plain greedy decoding would otherwise pick.
        "suppress_tokens": [],
    }


def whisper_asr_goldens(audio_dir: Path) -> tuple[dict, dict]:
    import torch
    from transformers import GenerationConfig, WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    fe = WhisperFeatureExtractor(feature_size=80)
    jfk = read_pcm16_wav(audio_dir / "jfk.wav")

    def feats(samples: np.ndarray):
        return fe(samples, sampling_rate=16000, return_tensors="pt").input_features

    def build(eot: int, suppress: list[int]):
        cfg = {
            **WHISPER_ASR,
            "eos_token_id": eot,
            "pad_token_id": eot,
            "bos_token_id": eot,
            "decoder_start_token_id": N_ORDINARY,
        }
        model = WhisperForConditionalGeneration(WhisperConfig(**cfg)).eval()
        shapes = fill(model, torch)
        gen = whisper_generation_config(eot)
        gen["suppress_tokens"] = suppress
        model.generation_config = GenerationConfig(**gen)
        return model, gen, shapes

    def run(model, features, language):
        with torch.no_grad():
            out = model.generate(
                features,
                language=language,
                task="transcribe",
                return_timestamps=False,
                do_sample=False,
                num_beams=1,
                max_new_tokens=MAX_NEW_TOKENS,
                return_dict_in_generate=True,
            )
        return out.sequences[0].tolist()  # the forced prompt, then what was generated

    # Pass 1 (eot out of reach, no suppression): find what plain greedy decoding picks.
    model, _, _ = build(eot=N_ORDINARY - 1, suppress=[])
    plain = run(model, feats(jfk), None)
    prompt_len = 4
    # Suppress two tokens plain greedy decoding picks, so suppression visibly matters;
    # of the first few candidate pairs, the one whose decoding repeats itself least.
    distinct = [t for t in dict.fromkeys(plain[prompt_len:]) if t != SPACE_ID]
    best = None
    for pair in [(a, b) for i, a in enumerate(distinct[:4]) for b in distinct[i + 1 : 5]]:
        model, _, _ = build(eot=N_ORDINARY - 1, suppress=sorted(pair))
        ids = run(model, feats(jfk), None)[prompt_len:]
        variety = len(set(ids[:12]))
        if best is None or variety > best[0]:
            best = (variety, sorted(pair), ids)
    _, suppress, steered = best
    # <|endoftext|> sits on a token greedy decoding reaches after a few steps, so stopping
    # is exercised (it is begin-suppressed, so it must not be the first one either).
    k = next(i for i in range(6, len(steered)) if steered[i] not in steered[:i] and steered[i] not in suppress)
    eot = steered[k]

    model, gen, shapes = build(eot=eot, suppress=suppress)
    out: dict = {}
    detected = run(model, feats(jfk), None)
    lang_id = detected[1]
    lang = next(k for k, v in gen["lang_to_id"].items() if v == lang_id)
    other = "fr" if lang != "<|fr|>" else "en"
    given = run(model, feats(jfk), other)
    out["detect/ids"] = np.asarray(detected, dtype=np.int64)
    out["given/ids"] = np.asarray(given, dtype=np.int64)
    # Long audio: 33 s (jfk.wav three times) through transformers' sequential long-form
    # decoding. With only 18 timestamp tokens this model never closes a segment, so each
    # window is one segment and the next starts 30 s on.
    long = np.concatenate([jfk, jfk, jfk])
    windows = longform(model, long, language=None, max_new_tokens=MAX_NEW_TOKENS)
    out.update(segment_arrays("long", windows))
    print(f"whisper asr: eot {eot}, suppress {suppress}, detected {detected}, given {other}: {given}")
    meta = {
        "config": {**WHISPER_ASR, "eos_token_id": eot, "decoder_start_token_id": N_ORDINARY},
        "generation_config": gen,
        "specials": WHISPER_SPECIALS,
        "n_ordinary": N_ORDINARY,
        "n_timestamps": N_TIMESTAMPS,
        "max_new_tokens": MAX_NEW_TOKENS,
        "parameters": shapes,
        "long_windows": len(windows["seeks"]),
        "detected_language": lang.strip("<|>"),
        "given_language": other,
    }
    return out, meta


# ---- long-form decoding (audio over 30 s, timestamps) ----------------------------


def longform(model, samples: np.ndarray, *, language, max_new_tokens=None, short: bool = False) -> dict:
    """transformers' Whisper ``generate`` with timestamps, as its docs run long audio: features
    of the whole clip (truncation=False, padding="longest"), or, with ``short``, the usual
    30 s padded features with ``return_timestamps=True``. Returns the segments (tokens with
    their timestamp tokens, start and end in seconds), the output ids and every window's seek."""
    import torch
    from transformers import WhisperFeatureExtractor

    fe = WhisperFeatureExtractor(feature_size=model.config.num_mel_bins)
    if short:
        inputs = fe(samples, sampling_rate=16000, return_tensors="pt")
    else:
        inputs = fe(
            samples,
            sampling_rate=16000,
            return_tensors="pt",
            truncation=False,
            padding="longest",
            return_attention_mask=True,
        )
    seeks: list[int] = []
    with torch.no_grad():
        out = model.generate(
            inputs.input_features,
            attention_mask=inputs.get("attention_mask"),
            language=language,
            task="transcribe",
            return_timestamps=True,
            return_segments=True,
            do_sample=False,
            num_beams=1,
            max_new_tokens=max_new_tokens,
            monitor_progress=lambda p: seeks.append(int(p[0, 0])),
        )
    # The language generate detects: the first 30 s of the features, as it does.
    language_id = int(model.detect_language(input_features=inputs.input_features[:, :, :3000])[0])
    segments = [
        {"tokens": s["tokens"].tolist(), "start": float(s["start"]), "end": float(s["end"])} for s in out["segments"][0]
    ]
    return {
        "segments": segments,
        "sequence": out["sequences"][0].tolist(),
        "seeks": seeks,
        "language_id": language_id,
        "frames": int(inputs.input_features.shape[-1]),
    }


def segment_arrays(prefix: str, run: dict) -> dict[str, np.ndarray]:
    segs = run["segments"]
    return {
        f"{prefix}/sequence": np.asarray(run["sequence"], dtype=np.int64),
        f"{prefix}/tokens": np.asarray([t for s in segs for t in s["tokens"]], dtype=np.int64),
        f"{prefix}/bounds": np.cumsum([0] + [len(s["tokens"]) for s in segs]).astype(np.int64),
        f"{prefix}/times": np.asarray([[s["start"], s["end"]] for s in segs], dtype=np.float64).reshape(-1, 2),
        f"{prefix}/seeks": np.asarray(run["seeks"], dtype=np.int64),
    }


# A second tiny Whisper laid out like the real ones: <|endoftext|> is the first special
# token, and all 1501 timestamps <|0.00|> .. <|30.00|> follow <|notimestamps|>, so its
# timestamps can close segments anywhere in a window.
LONGFORM_SPECIALS = ["<|endoftext|>", *WHISPER_SPECIALS]
LONGFORM_TIMESTAMPS = 1501
WHISPER_LONGFORM = {**WHISPER_ASR, "vocab_size": N_ORDINARY + len(LONGFORM_SPECIALS) + LONGFORM_TIMESTAMPS}
LONGFORM_CAP = 36  # new tokens per window in the capped run: windows end before <|30.00|>
LONGFORM_REPEATS, LONGFORM_GAP_S = 6, 1.0  # jfk.wav and 1 s of silence, six times: 72 s


def longform_audio(jfk: np.ndarray) -> np.ndarray:
    gap = np.zeros(int(LONGFORM_GAP_S * 16000), dtype=np.float32)
    return np.concatenate([jfk, gap] * LONGFORM_REPEATS)


def whisper_longform_goldens(audio_dir: Path) -> tuple[dict, dict]:
    import torch
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    ids = {tok: N_ORDINARY + i for i, tok in enumerate(LONGFORM_SPECIALS)}
    eot = ids["<|endoftext|>"]
    cfg = {**WHISPER_LONGFORM, "eos_token_id": eot, "decoder_start_token_id": ids["<|startoftranscript|>"]}
    model = WhisperForConditionalGeneration(WhisperConfig(**cfg, pad_token_id=eot, bos_token_id=eot)).eval()
    shapes = fill(model, torch)
    gen = {
        "decoder_start_token_id": ids["<|startoftranscript|>"],
        "eos_token_id": eot,
        "pad_token_id": eot,
        "bos_token_id": eot,
        "lang_to_id": {k: ids[k] for k in ("<|en|>", "<|de|>", "<|fr|>")},
        "task_to_id": {"translate": ids["<|translate|>"], "transcribe": ids["<|transcribe|>"]},
        "no_timestamps_token_id": ids["<|notimestamps|>"],
        "is_multilingual": True,
        "max_length": cfg["max_target_positions"],
        "max_initial_timestamp_index": 50,  # as the real checkpoints: the first timestamp is at most 1.00 s
        "begin_suppress_tokens": [SPACE_ID, eot],
        "suppress_tokens": [
            ids[t]
            for t in (
                "<|startoftranscript|>",
                "<|translate|>",
                "<|transcribe|>",
                "<|startoflm|>",
                "<|startofprev|>",
                "<|nospeech|>",
            )
        ],
    }
    model.generation_config = GenerationConfig(**gen)
    jfk = read_pcm16_wav(audio_dir / "jfk.wav")
    audio = longform_audio(jfk)
    runs = {
        "long": longform(model, audio, language=None),
        "capped": longform(model, audio, language=None, max_new_tokens=LONGFORM_CAP),
        "short": longform(model, jfk, language=None, short=True),
    }
    out: dict = {}
    for name, run in runs.items():
        out.update(segment_arrays(name, run))
        print(
            f"whisper longform {name}: {run['frames']} frames, seeks {run['seeks']}, "
            f"{len(run['segments'])} segments {[(s['start'], s['end']) for s in run['segments']]}"
        )
    timestamp_begin = ids["<|notimestamps|>"] + 1
    # The golden must exercise the timestamp rules, not only fixed 30 s windows: some window
    # starts where a timestamp closed the previous one, and segments end inside windows.
    assert any(s % 3000 for s in runs["capped"]["seeks"]), runs["capped"]["seeks"]
    assert all(any(t >= timestamp_begin for t in s["tokens"]) for r in runs.values() for s in r["segments"])
    assert len(runs["long"]["segments"]) > len(runs["long"]["seeks"])
    meta = {
        "config": cfg,
        "generation_config": gen,
        "specials": LONGFORM_SPECIALS,
        "n_ordinary": N_ORDINARY,
        "n_timestamps": LONGFORM_TIMESTAMPS,
        "parameters": shapes,
        "capped_max_new_tokens": LONGFORM_CAP,
        "repeats": LONGFORM_REPEATS,
        "gap_s": LONGFORM_GAP_S,
        "frames": runs["long"]["frames"],
        "detected_language": {
            name: next(k.strip("<|>") for k, v in gen["lang_to_id"].items() if v == run["language_id"])
            for name, run in runs.items()
        },
    }
    return out, meta


# ---- a tiny Qwen2-Audio ---------------------------------------------------------

AUDIO_TOKEN = "<|AUDIO|>"
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_bos|>", AUDIO_TOKEN, "<|audio_eos|>"]
QWEN_VOCAB = 160
QWEN2_AUDIO = {
    "model_type": "qwen2_audio",
    "audio_token_index": None,  # set from the tokenizer
    "audio_config": {
        "model_type": "qwen2_audio_encoder",
        "num_mel_bins": 128,
        "d_model": 48,
        "encoder_layers": 2,
        "encoder_attention_heads": 4,
        "encoder_ffn_dim": 96,
        "max_source_positions": 1500,
        "activation_function": "gelu",
        "scale_embedding": False,
    },
    "text_config": {
        "model_type": "qwen2",
        "vocab_size": QWEN_VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "sliding_window": None,
        "use_sliding_window": False,
    },
}
QWEN_AUDIO_SECONDS = 4.0
QWEN_STEPS = 12
QWEN_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'audio' %}Audio {{ loop.index }}: <|audio_bos|><|AUDIO|><|audio_eos|>\n"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN_WORDS = ["what", "is", "said", "in", "this", "clip", "?", "the", "a", "speech", "ask", "not"]


def qwen_tokenizer():
    """A word-level tokenizer over a small vocabulary (the test builds the same one)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(QWEN_WORDS)}
    vocab["\n"] = len(vocab)
    vocab[":"] = len(vocab)
    for d in range(10):
        vocab[str(d)] = len(vocab)
    vocab["Audio"] = len(vocab)
    vocab["user"] = len(vocab)
    vocab["assistant"] = len(vocab)
    vocab["system"] = len(vocab)
    vocab["[UNK]"] = len(vocab)
    n = len(vocab)
    for i in range(n, QWEN_VOCAB - len(QWEN_SPECIALS)):
        vocab[f"w{i}"] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN_SPECIALS])
    return tok


def qwen2_audio_goldens(audio_dir: Path, tmp: Path) -> tuple[dict, dict]:
    import torch
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2AudioConfig,
        Qwen2AudioForConditionalGeneration,
        Qwen2AudioProcessor,
        WhisperFeatureExtractor,
    )

    tok = qwen_tokenizer()
    tok_dir = tmp / "qwen_tok"
    tok_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(tok_dir / "tokenizer.json"))
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_file=str(tok_dir / "tokenizer.json"), eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    hf_tok.chat_template = QWEN_TEMPLATE
    audio_id = tok.token_to_id(AUDIO_TOKEN)
    cfg = json.loads(json.dumps(QWEN2_AUDIO))
    cfg["audio_token_index"] = audio_id
    config = Qwen2AudioConfig(**{k: v for k, v in cfg.items() if k != "model_type"})
    torch.manual_seed(0)
    model = Qwen2AudioForConditionalGeneration(config).eval()
    shapes = fill(model, torch)

    fe = WhisperFeatureExtractor(feature_size=128)
    processor = Qwen2AudioProcessor(feature_extractor=fe, tokenizer=hf_tok, chat_template=QWEN_TEMPLATE)
    audio = read_pcm16_wav(audio_dir / "jfk.wav")[: int(QWEN_AUDIO_SECONDS * 16000)]
    messages = [
        {"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": "what is said in this clip ?"}]}
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=text, audio=[audio], sampling_rate=16000, return_tensors="pt")
    ids = inputs["input_ids"][0].tolist()
    n_audio = ids.count(audio_id)
    out: dict = {}
    feats = inputs["input_features"][0].numpy()
    mask = inputs["feature_attention_mask"][0].numpy()
    out["features/frames"] = feats[:, ::STRIDE].astype(np.float32)
    out["features/mask"] = mask.astype(np.int64)
    out["prompt/ids"] = np.asarray(ids, dtype=np.int64)
    with torch.no_grad():
        # The tower and projector as Qwen2AudioModel.forward runs them: padded frames
        # (past the feature mask, after the stride-2 convolution) are masked as keys.
        from transformers.masking_utils import create_bidirectional_mask

        tower = model.model.audio_tower
        conv_len, out_len = tower._get_feat_extract_output_lengths(inputs["feature_attention_mask"].sum(-1))
        keep = (torch.arange(1500)[None, :] < conv_len[:, None]).long()
        mask = create_bidirectional_mask(
            config=tower.config, inputs_embeds=torch.zeros(1, 1500, 1), attention_mask=keep
        )
        hidden = tower(inputs["input_features"], attention_mask=mask).last_hidden_state
        projected = model.model.multi_modal_projector(hidden)[0, : int(out_len[0])].numpy()
        assert projected.shape[0] == n_audio, (projected.shape, n_audio)
        out["projected"] = projected.astype(np.float32)
        gen = model.generate(
            **inputs,
            max_new_tokens=QWEN_STEPS,
            do_sample=False,
            num_beams=1,
            output_scores=True,
            return_dict_in_generate=True,
            eos_token_id=None,
        )
        new = gen.sequences[0, len(ids) :].tolist()
        logprobs, margins = [], []
        for step, scores in enumerate(gen.scores):
            lp = torch.log_softmax(scores[0].float(), -1)
            logprobs.append(float(lp[new[step]]))
            top2 = torch.topk(scores[0], 2).values
            margins.append(float(top2[0] - top2[1]))
        full_logits = model(**inputs).logits[0, -1].numpy()
    out["greedy/ids"] = np.asarray(new, dtype=np.int64)
    out["greedy/logprobs"] = np.asarray(logprobs, dtype=np.float32)
    out["greedy/margins"] = np.asarray(margins, dtype=np.float32)
    out["prompt/last_logits"] = full_logits.astype(np.float32)
    print(
        f"qwen2-audio: {n_audio} audio tokens, prompt {len(ids)} ids, greedy {new}, smallest margin {min(margins):.4f}"
    )
    meta = {
        "config": cfg,
        "parameters": shapes,
        "specials": QWEN_SPECIALS,
        "words": QWEN_WORDS,
        "vocab_size": QWEN_VOCAB,
        "chat_template": QWEN_TEMPLATE,
        "messages": messages,
        "audio_seconds": QWEN_AUDIO_SECONDS,
        "steps": QWEN_STEPS,
        "stride": STRIDE,
        "prompt_text": text,
        "audio_tokens": n_audio,
    }
    return out, meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=HERE.parents[2] / "shared" / "data")
    parser.add_argument(
        "--only",
        choices=["whisper_asr", "whisper_longform", "qwen2_audio_tiny"],
        help="remake one reference instead of all",
    )
    args = parser.parse_args()
    import tempfile

    import torch
    import transformers

    OUT.mkdir(parents=True, exist_ok=True)

    def write(name: str, made: tuple[dict, dict]) -> None:
        arrays, meta = made
        np.savez_compressed(OUT / f"{name}.npz", **arrays)
        meta["versions"] = {"transformers": transformers.__version__, "torch": torch.__version__}
        (OUT / f"{name}.json").write_text(json.dumps(meta, indent=1) + "\n")

    audio = args.data / "audio"
    if args.only in (None, "whisper_asr"):
        write("whisper_asr", whisper_asr_goldens(audio))
    if args.only in (None, "whisper_longform"):
        write("whisper_longform", whisper_longform_goldens(audio))
    if args.only in (None, "qwen2_audio_tiny"):
        with tempfile.TemporaryDirectory() as tmp:
            write("qwen2_audio_tiny", qwen2_audio_goldens(audio, Path(tmp)))


if __name__ == "__main__":
    main()
