"""Make the reference outputs for the media preprocessing tests.

Run with an environment that has transformers, torch and scipy (never needed by the
tests themselves):

    python tests/golden/make_media_goldens.py [--data ../shared/data]

It reads the speech clip and photos in ../shared/data and writes compact summaries of
what the outside references compute on them into tests/golden/media/:

- whisper_features.npz  transformers' WhisperFeatureExtractor (80 and 128 mels) on jfk.wav
- resample.npz          scipy.signal.resample_poly on jfk.wav and on a synthetic tone mix
- gemma3_images.npz     transformers' Gemma3 image processor (PIL backend) on the photos
- qwen2vl_images.npz    transformers' Qwen2-VL image processor (PIL backend) on the photos
- gemma3_pan_and_scan.npz / .json
                        transformers' Gemma3Processor with do_pan_and_scan on (PIL backend,
                        the tiny vision model's 32 px size) for a wide and a tall picture made
                        from the photos (see pan_and_scan_pictures) and for chelsea.png, whose
                        crops would fall below the minimum crop size: every view's pixels, the
                        number of crops of each photo, the expanded prompt text and ids; and
                        the tiny Gemma 3 model of tests/golden/vision/gemma3 run greedily on
                        the wide and tall prompts (ids and each chosen token's log-probability)
- whisper_tiny.npz      a tiny random WhisperForConditionalGeneration (weights drawn from
                        a seeded generator, see synthetic_weight) run on jfk.wav's features:
                        encoder output, and greedy decoding with its logits at every step
- whisper_tiny.json     that model's config and parameter names/shapes
- versions.json         library versions and the settings used

Large arrays are stored as exact float32 summaries: totals, per-row and per-column means
and a strided sample, which together localise any disagreement.
This script deliberately does not import the engine: the references stay independent.
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
IMAGES = ["astronaut.png", "chelsea.png", "coffee.png", "rocket.jpg"]
MEL_FRAME_STRIDE = 5
RESAMPLE_STRIDE = 13
IMAGE_STRIDE = 1999
ENCODER_STRIDE = 13

# Image processor settings covered by the goldens (name -> constructor kwargs).
GEMMA3_CASES = {
    "bilinear896": {
        "size": {"height": 896, "width": 896},
        "resample": 2,
        "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3,
    },
    "bicubic896": {
        "size": {"height": 896, "width": 896},
        "resample": 3,
        "image_mean": [0.5] * 3,
        "image_std": [0.5] * 3,
    },
}
QWEN2VL_CASES = {
    "default": {},
    # Forces the downscale branch of smart_resize on every photo.
    "max200k": {"min_pixels": 3136, "max_pixels": 200_704},
    # Forces the upscale branch.
    "min1m": {"min_pixels": 1_000_000, "max_pixels": 2_000_000},
}
# A tone mix sampled at 44.1 kHz (synthesised identically in the test).
TONES_HZ = (220.0, 1000.0, 3500.0, 7000.0, 7900.0, 12000.0)


def tone_mix(rate: int, seconds: float) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return sum(np.sin(2 * np.pi * f * t + i) / len(TONES_HZ) for i, f in enumerate(TONES_HZ))


def read_pcm16_wav(path: Path) -> np.ndarray:
    with wave.open(str(path)) as w:
        assert w.getsampwidth() == 2 and w.getnchannels() == 1 and w.getframerate() == 16000
        return np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768.0


def summarise(prefix: str, x: np.ndarray, stride: int, out: dict) -> None:
    """Exact totals plus a strided sample of a float array."""
    x64 = x.astype(np.float64)
    out[f"{prefix}/shape"] = np.asarray(x.shape, dtype=np.int64)
    out[f"{prefix}/stats"] = np.asarray([x64.sum(), np.abs(x64).sum(), (x64**2).sum(), x64.min(), x64.max()])
    out[f"{prefix}/strided"] = x.reshape(-1)[::stride].astype(np.float32)


def whisper_goldens(audio_dir: Path) -> dict:
    from transformers import WhisperFeatureExtractor

    audio = read_pcm16_wav(audio_dir / "jfk.wav")
    out: dict = {}
    for n_mels in (80, 128):
        fe = WhisperFeatureExtractor(feature_size=n_mels)
        feats = fe(audio, sampling_rate=16000, return_tensors="np").input_features[0]
        key = f"mel{n_mels}"
        out[f"{key}/frames"] = feats[:, ::MEL_FRAME_STRIDE].astype(np.float32)
        summarise(key, feats, 1 << 30, out)
        out[f"{key}/filters"] = fe.mel_filters.astype(np.float32)
    return out


def resample_goldens(audio_dir: Path) -> dict:
    from scipy.signal import resample_poly

    jfk = read_pcm16_wav(audio_dir / "jfk.wav").astype(np.float64)
    out: dict = {}
    for name, x, up, down in [
        ("jfk_16000_to_22050", jfk, 441, 320),
        ("jfk_16000_to_8000", jfk, 1, 2),
        ("tones_44100_to_16000", tone_mix(44100, 2.0), 160, 441),
        ("tones_44100_to_48000", tone_mix(44100, 0.5), 160, 147),
    ]:
        y = resample_poly(x, up, down)  # Kaiser beta 5, 10 zero crossings (scipy's defaults)
        summarise(name, y, RESAMPLE_STRIDE, out)
    return out


def image_summary(prefix: str, chw: np.ndarray, out: dict) -> None:
    summarise(prefix, chw, IMAGE_STRIDE, out)
    out[f"{prefix}/row_means"] = chw.astype(np.float64).mean(axis=-1).astype(np.float32)
    out[f"{prefix}/col_means"] = chw.astype(np.float64).mean(axis=-2).astype(np.float32)


def gemma3_goldens(image_dir: Path) -> dict:
    from PIL import Image
    from transformers import Gemma3ImageProcessorPil

    out: dict = {}
    for case, kwargs in GEMMA3_CASES.items():
        proc = Gemma3ImageProcessorPil(**kwargs)
        for name in IMAGES:
            with Image.open(image_dir / name) as im:
                pv = proc(im, return_tensors="np")["pixel_values"]
            assert pv.shape[0] == 1
            image_summary(f"{case}/{name}", pv[0], out)
    return out


def qwen2vl_goldens(image_dir: Path) -> dict:
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    out: dict = {}
    for case, kwargs in QWEN2VL_CASES.items():
        proc = Qwen2VLImageProcessorPil(**kwargs)
        for name in IMAGES:
            with Image.open(image_dir / name) as im:
                res = proc(im, return_tensors="np")
            pv, thw = res["pixel_values"], res["image_grid_thw"]
            prefix = f"{case}/{name}"
            out[f"{prefix}/grid_thw"] = np.asarray(thw, dtype=np.int64)
            summarise(prefix, pv, IMAGE_STRIDE, out)
            out[f"{prefix}/patch_means"] = pv.astype(np.float64).mean(axis=1).astype(np.float32)
            out[f"{prefix}/feature_means"] = pv.astype(np.float64).mean(axis=0).astype(np.float32)
    # Several images in one call concatenate their patches in order.
    proc = Qwen2VLImageProcessorPil()
    ims = [Image.open(image_dir / n) for n in IMAGES]
    res = proc(ims, return_tensors="np")
    out["batch/grid_thw"] = np.asarray(res["image_grid_thw"], dtype=np.int64)
    summarise("batch", res["pixel_values"], IMAGE_STRIDE, out)
    return out


WHISPER_TINY = {
    "vocab_size": 100,
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
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "decoder_start_token_id": 1,
    "scale_embedding": False,
    "activation_function": "gelu",
    "tie_word_embeddings": True,
}
WHISPER_PROMPT = [1, 7, 11]
WHISPER_STEPS = 24


def whisper_tiny_goldens(audio_dir: Path) -> tuple[dict, dict]:
    import torch
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(WhisperConfig(**WHISPER_TINY)).eval()
    params = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(synthetic_weight(name, tuple(p.shape))))
            params[name] = list(p.shape)
    assert model.proj_out.weight.data_ptr() == model.model.decoder.embed_tokens.weight.data_ptr()
    audio = read_pcm16_wav(audio_dir / "jfk.wav")
    feats = WhisperFeatureExtractor(feature_size=80)(audio, sampling_rate=16000, return_tensors="pt").input_features
    out: dict = {}
    with torch.no_grad():
        encoded = model.model.encoder(feats).last_hidden_state[0].numpy()
        summarise("encoder", encoded, ENCODER_STRIDE, out)
        out["encoder/position_means"] = encoded.astype(np.float64).mean(axis=1).astype(np.float32)
        # Plain greedy decoding, each step recomputed from scratch (no cache, no
        # Whisper-specific suppression): the reference for the engine's cached loop.
        ids = list(WHISPER_PROMPT)
        step_logits, margins = [], []
        for _ in range(WHISPER_STEPS):
            logits = model(input_features=feats, decoder_input_ids=torch.tensor([ids])).logits[0, -1].numpy()
            top2 = np.sort(logits)[-2:]
            margins.append(top2[1] - top2[0])
            step_logits.append(logits)
            ids.append(int(np.argmax(logits)))
    out["greedy/ids"] = np.asarray(ids[len(WHISPER_PROMPT) :], dtype=np.int64)
    out["greedy/logits"] = np.stack(step_logits).astype(np.float32)
    out["greedy/margins"] = np.asarray(margins, dtype=np.float32)
    print(f"whisper tiny: greedy ids {out['greedy/ids'].tolist()}, smallest top-2 margin {min(margins):.4f}")
    meta = {
        "config": WHISPER_TINY,
        "prompt": WHISPER_PROMPT,
        "steps": WHISPER_STEPS,
        "encoder_stride": ENCODER_STRIDE,
        "parameters": params,
    }
    return out, meta


VISION_GEMMA3 = HERE / "vision" / "gemma3"
PAS_SIZE = 32  # the tiny vision model's image size keeps the pixel goldens small
PAS_QUESTION = "What is in this picture?"
PAS_NEW_TOKENS = 10


def pan_and_scan_pictures(image_dir: Path) -> dict:
    """Pictures elongated enough to be cropped, built from the photos by pasting crops of
    them onto a plain canvas (the tests rebuild them the same way and check the pixel hash)."""
    from PIL import Image

    def rgb(name):
        with Image.open(image_dir / name) as im:
            return im.convert("RGB")

    wide = Image.new("RGB", (1003, 300), (40, 90, 160))  # 3.3:1 -> 3 crops, the last one narrower
    wide.paste(rgb("chelsea.png"), (0, 0))
    wide.paste(rgb("coffee.png").crop((0, 50, 552, 350)), (451, 0))
    tall = Image.new("RGB", (300, 1100), (200, 180, 40))  # 1:3.7 -> 4 crops
    tall.paste(rgb("astronaut.png").crop((100, 0, 400, 512)), (0, 0))
    tall.paste(rgb("rocket.jpg").crop((170, 0, 470, 427)), (0, 512))
    # 1.5:1 but its two crops would be 226 px wide, under the 256 px minimum: no crops.
    return {"wide": wide, "tall": tall, "below": rgb("chelsea.png")}


def gemma3_pan_and_scan_goldens(image_dir: Path) -> tuple[dict, dict]:
    import hashlib

    import torch
    import transformers
    from PIL import Image

    specials = {"boi_token": "<start_of_image>", "image_token": "<image_soft_token>", "eoi_token": "<end_of_image>"}
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(VISION_GEMMA3, extra_special_tokens=specials)
    model_config = json.loads((VISION_GEMMA3 / "config.json").read_text())
    image_proc = transformers.Gemma3ImageProcessorPil(size={"height": PAS_SIZE, "width": PAS_SIZE}, resample=2)
    proc = transformers.Gemma3Processor(
        image_processor=image_proc, tokenizer=tok, image_seq_length=model_config["mm_tokens_per_image"]
    )
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(VISION_GEMMA3, dtype=torch.float32).eval()
    model.config._attn_implementation = "eager"
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PAS_QUESTION}]}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    arrays: dict = {}
    meta: dict = {
        "size": PAS_SIZE,
        "messages": messages,
        "template_text": text,
        "defaults": {k: v for k, v in proc.images_kwargs.items() if k.startswith("pan_and_scan")},
        "cases": {},
        "num_crops": {},
    }
    for name in IMAGES:  # how many crops each photo gets with the processor's defaults
        with Image.open(image_dir / name) as im:
            res = image_proc(
                im.convert("RGB"),
                do_pan_and_scan=True,
                pan_and_scan_min_crop_size=256,
                pan_and_scan_max_num_crops=4,
                pan_and_scan_min_ratio_to_activate=1.2,
                return_tensors="np",
            )
        meta["num_crops"][name] = int(res["num_crops"][0])
    for case, picture in pan_and_scan_pictures(image_dir).items():
        out = proc(images=[picture], text=[text], do_pan_and_scan=True, return_tensors="pt")
        pixels = out["pixel_values"]
        arrays[f"{case}/pixel_values"] = pixels.numpy().astype(np.float32)
        ids = out["input_ids"]
        entry = {
            "picture_size": list(picture.size),
            "picture_sha256": hashlib.sha256(picture.tobytes()).hexdigest(),
            "num_crops": int(out["num_crops"][0]) if "num_crops" in out else pixels.shape[0] - 1,
            "prompt_ids": ids[0].tolist(),
            "prompt_text": tok.decode(ids[0], skip_special_tokens=False),
        }
        if entry["num_crops"]:
            with torch.no_grad():
                gen = model.generate(
                    input_ids=ids,
                    attention_mask=out["attention_mask"],
                    pixel_values=pixels,
                    token_type_ids=out["token_type_ids"],
                    max_new_tokens=PAS_NEW_TOKENS,
                    do_sample=False,
                    output_logits=True,
                    return_dict_in_generate=True,
                    pad_token_id=0,
                )
            new = gen.sequences[0, ids.shape[1] :].tolist()
            entry["token_ids"] = new
            entry["token_logprobs"] = [
                torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(gen.logits, new)
            ]
        meta["cases"][case] = entry
        print(
            f"pan-and-scan {case}: {picture.size}, {entry['num_crops']} crops, "
            f"{len(entry['prompt_ids'])} prompt ids, greedy {entry.get('token_ids')}"
        )
    return arrays, meta


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", type=Path, default=HERE.parents[2] / "shared" / "data")
    args = parser.parse_args()
    import PIL
    import scipy
    import torch
    import transformers

    OUT.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(OUT / "whisper_features.npz", **whisper_goldens(args.data / "audio"))
    np.savez_compressed(OUT / "resample.npz", **resample_goldens(args.data / "audio"))
    np.savez_compressed(OUT / "gemma3_images.npz", **gemma3_goldens(args.data / "images"))
    np.savez_compressed(OUT / "qwen2vl_images.npz", **qwen2vl_goldens(args.data / "images"))
    pas_arrays, pas_meta = gemma3_pan_and_scan_goldens(args.data / "images")
    np.savez_compressed(OUT / "gemma3_pan_and_scan.npz", **pas_arrays)
    (OUT / "gemma3_pan_and_scan.json").write_text(json.dumps(pas_meta, indent=1) + "\n")
    whisper_arrays, whisper_meta = whisper_tiny_goldens(args.data / "audio")
    np.savez_compressed(OUT / "whisper_tiny.npz", **whisper_arrays)
    (OUT / "whisper_tiny.json").write_text(json.dumps(whisper_meta, indent=1) + "\n")
    meta = {
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "scipy": scipy.__version__,
        "pillow": PIL.__version__,
        "numpy": np.__version__,
        "image_backend": "pil",
        "mel_frame_stride": MEL_FRAME_STRIDE,
        "resample_stride": RESAMPLE_STRIDE,
        "image_stride": IMAGE_STRIDE,
        "gemma3_cases": GEMMA3_CASES,
        "qwen2vl_cases": QWEN2VL_CASES,
        "tones_hz": TONES_HZ,
        "images": IMAGES,
    }
    (OUT / "versions.json").write_text(json.dumps(meta, indent=2) + "\n")
    total = sum(p.stat().st_size for p in OUT.iterdir())
    print(f"wrote {OUT} ({total / 1e3:.0f} kB)")


if __name__ == "__main__":
    main()
