"""``python -m engine bench --media image|video``: time to first token for one image or
one clip, on random weights of a vision-language model's shape (no download).

The media is made here: a 1024 x 1024 picture of noise, or a clip of ``--media-seconds``
at ``--media-size`` (720p by default) written with PyAV. The time to first token is split
into its parts: decoding and preprocessing (the model's own processor settings, as
published), the vision tower over every run of soft tokens, and the language model's
prefill up to the first token. Engine only: mlx-vlm is not timed here yet.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.errors import EngineError

# Qwen/Qwen3-VL-4B-Instruct's published shape (text and vision), and a tiny one for CPU checks.
MEDIA_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-vl-4b": {
        "text": dict(
            hidden_size=2560,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=9728,
            vocab_size=151936,
            rms_norm_eps=1e-6,
            rope_theta=5000000.0,
            max_position_embeddings=262144,
            tie_word_embeddings=True,
            rope_scaling={"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True},
        ),
        "vision": dict(
            depth=24,
            hidden_size=1024,
            intermediate_size=4096,
            num_heads=16,
            out_hidden_size=2560,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            num_position_embeddings=2304,
            deepstack_visual_indexes=[5, 11, 17],
            hidden_act="gelu_pytorch_tanh",
        ),
    },
    "qwen3-vl-tiny": {
        "text": dict(
            hidden_size=64,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=96,
            vocab_size=256,
            rms_norm_eps=1e-6,
            rope_theta=10000.0,
            max_position_embeddings=65536,
            tie_word_embeddings=True,
            rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
        ),
        "vision": dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            out_hidden_size=64,
            patch_size=16,
            spatial_merge_size=2,
            temporal_patch_size=2,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0],
            hidden_act="gelu_pytorch_tanh",
        ),
    },
}
# Qwen3-VL's published processor settings.
IMAGE_SETTINGS = {
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5] * 3,
    "image_std": [0.5] * 3,
}
VIDEO_SETTINGS = {
    "size": {"shortest_edge": 4096, "longest_edge": 25165824},
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "fps": 2,
    "min_frames": 4,
    "max_frames": 768,
    "image_mean": [0.5] * 3,
    "image_std": [0.5] * 3,
}
IMAGE_ID, VIDEO_ID = 5, 6  # soft-token ids of the random vocabulary


def add_media_arguments(p: Any) -> None:
    p.add_argument(
        "--media",
        choices=["image", "video"],
        help="time to first token for one image or clip on a vision model's shape (--shape qwen3-vl-4b)",
    )
    p.add_argument("--media-seconds", type=float, default=30.0, help="the clip's length (with --media video)")
    p.add_argument("--media-size", default="1280x720", help="the clip's frame size WxH (with --media video)")


def _clip(path: Path, seconds: float, width: int, height: int, fps: int = 30) -> Path:
    import av
    import numpy as np

    out = av.open(str(path), "w", format="mp4")
    stream = out.add_stream("mpeg4", rate=fps)
    stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    for i in range(max(1, round(seconds * fps))):
        frame = np.roll(base, 4 * i, axis=1)  # motion, so frames differ
        for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
            out.mux(packet)
    for packet in stream.encode():
        out.mux(packet)
    out.close()
    return path


def _prepare(kind: str, source: Any) -> tuple[list[tuple[Any, tuple[int, int, int]]], int]:
    """(runs of (pixels, grid in patches), merge size): the processor's work."""
    import numpy as np
    from PIL import Image

    from engine.media.image_processors import Qwen2VLImageProcessor
    from engine.media.qwen3_vl.processor import VideoProcessor
    from engine.media.video import probe, read_frames

    if kind == "image":
        proc = Qwen2VLImageProcessor.from_config(IMAGE_SETTINGS)
        vision = proc([Image.fromarray(source)])
        t, h, w = (int(v) for v in vision.image_grid_thw[0])
        return [(vision.pixel_values, (t, h, w))], proc.merge_size
    proc = VideoProcessor.from_config(VIDEO_SETTINGS)
    info = probe(source)
    indices = proc.sample(info.frames, info.fps)
    patches = proc(read_frames(source, indices), indices, info.fps)
    groups, h, w = patches.grid
    rows = np.split(patches.pixel_values, groups)
    return [(r, (1, h, w)) for r in rows], proc.merge_size


def run_media_bench(args: Any) -> int:
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np

    from engine.decode.loop import PromptInputs, generate_step
    from engine.media.qwen3_vl.tower import VisionConfig, VisionModel
    from engine.models import get_family
    from engine.models.kv_cache import make_prompt_cache

    shape = MEDIA_SHAPES.get(args.shape)
    if shape is None or not args.media:
        raise EngineError(f"--media image|video goes with a vision shape: --shape {' or '.join(sorted(MEDIA_SHAPES))}")
    mx.random.seed(args.seed)
    family = get_family("qwen3_vl")
    model = family.Model(
        family.ModelArgs.from_dict(
            {"model_type": "qwen3_vl", "text_config": shape["text"], "vision_config": shape["vision"]}
        )
    )
    model.set_dtype(mx.bfloat16)
    if args.bits in (4, 8):
        nn.quantize(
            model,
            group_size=args.group_size,
            bits=args.bits,
            class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % args.group_size == 0,
        )
    mx.eval(model.parameters())
    tower = VisionModel(VisionConfig.from_dict(shape["vision"]))
    tower.set_dtype(mx.bfloat16)
    mx.eval(tower.parameters())

    with tempfile.TemporaryDirectory() as tmp:
        if args.media == "image":
            source: Any = np.random.default_rng(args.seed).integers(0, 256, (1024, 1024, 3), dtype=np.uint8)
            what = "one 1024x1024 image"
        else:
            width, height = (int(v) for v in args.media_size.lower().split("x"))
            source = _clip(Path(tmp) / "clip.mp4", args.media_seconds, width, height)
            what = f"one {args.media_seconds:g} s {width}x{height} clip"
        print(f"{args.shape} (random weights) on {mx.default_device()}: time to first token for {what}", flush=True)
        runs = []
        for _ in range(max(1, args.repeat) + 1):  # the first run warms up
            runs.append(_time_once(args.media, source, model, tower, make_prompt_cache, PromptInputs, generate_step))
    best = min(runs[1:], key=lambda r: r["ttft_s"])
    print(
        f"engine   ttft {best['ttft_s']:.3f} s = preprocess {best['preprocess_s']:.3f} + tower "
        f"{best['tower_s']:.3f} + prefill {best['prefill_s']:.3f}  ({best['prompt_tokens']} prompt tokens, "
        f"{best['runs']} runs of soft tokens)",
        flush=True,
    )
    if args.json:
        print(
            json.dumps({"shape": args.shape, "media": args.media, "device": str(mx.default_device()), "engine": best})
        )
    return 0


def _time_once(kind, source, model, tower, make_prompt_cache, PromptInputs, generate_step) -> dict[str, Any]:
    import mlx.core as mx
    import numpy as np

    start = time.perf_counter()
    runs, merge = _prepare(kind, source)
    prepared = time.perf_counter()
    features = [tower(mx.array(pixels), grid).astype(mx.bfloat16) for pixels, grid in runs]
    mx.eval(features)
    encoded = time.perf_counter()
    soft = IMAGE_ID if kind == "image" else VIDEO_ID
    ids: list[int] = list(range(20, 36))
    spans = []
    for (_, (t, h, w)), f in zip(runs, features):
        ids += [40, 41, 42]  # a timestamp's and the vision markers' worth of text
        spans.append((len(ids), len(ids) + f.shape[0], (t, h // merge, w // merge)))
        ids += [soft] * f.shape[0]
    ids += list(range(50, 66))
    text = model.embed(mx.array(ids, dtype=mx.uint32)[None])[0]
    width = features[0].shape[-1]
    pieces, cursor = [], 0
    for (s, e, _), f in zip(spans, features):
        pieces += [mx.pad(text[cursor:s], [(0, 0), (0, width - text.shape[-1])]), f]
        cursor = e
    pieces.append(mx.pad(text[cursor:], [(0, 0), (0, width - text.shape[-1])]))
    positions = np.asarray(model.rope_index(ids, spans))
    inputs = PromptInputs(
        embeddings=mx.concatenate(pieces),
        positions=mx.array(positions, dtype=mx.int32),
        position_delta=int(positions.max()) + 1 - len(ids),
    )
    cache = make_prompt_cache(model)
    for _ in generate_step(
        mx.array(ids, dtype=mx.uint32), model, cache, max_tokens=1, inputs=inputs, prefill_chunk=2048
    ):
        break
    done = time.perf_counter()
    return {
        "ttft_s": done - start,
        "preprocess_s": prepared - start,
        "tower_s": encoded - prepared,
        "prefill_s": done - encoded,
        "prompt_tokens": len(ids),
        "runs": len(runs),
        "peak_memory_bytes": int(mx.get_peak_memory()),
    }
