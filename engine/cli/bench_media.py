"""``python -m engine bench --media image|video``: time to first token for one image or
one clip, on random weights of a vision-language model's shape (no download).

The media is made here: a 1024 x 1024 picture of noise, or a clip of ``--media-seconds``
at ``--media-size`` (720p by default) written with PyAV. The time to first token is split
into its parts: decoding and preprocessing (the model's own processor settings, as
published), the vision tower over every run of soft tokens, and the language model's
prefill up to the first token.

``--vs mlx-vlm`` (mlx-vlm installed; imported only here) saves the same random weights
once, in the layout mlx-vlm's converted checkpoints use (``language_model.*``,
``vision_tower.*``, Qwen3.5's norms already 1 + w), loads them with mlx-vlm's own loader
and quantizes its language model as the engine's, then times mlx-vlm's ``generate_step``
to its first token (its tower, its embedding merge and mRoPE positions, its prefill) on the
same pixel values and prompt ids. A clip's preprocessing is timed on each side as each
does it: the engine's (PyAV with frame threads, only the packets the samples need, frames
patched on a thread pool as they decode), and mlx-vlm's (its ``load_video``, OpenCV seeking to each sampled frame, then its
numpy port of the Qwen3-VL video processor); the bench prints how far mlx-vlm's pixel
values are from the engine's, and both models then run on the engine's, so the first
tokens must agree. Without OpenCV (mlx-vlm's video loader needs it) mlx-vlm's side is
given the engine's preprocessing time, and the bench says so. An image's preprocessing
is the engine's on both sides.

The engine's video preprocessing is also timed stage by stage, one after another (open and
sample, decode, convert to RGB, resize, normalise into patches), once, after the runs. And
a follow-up turn's media work through the engine's own towers (engine/media/towers.py):
every turn sends the clip again; the first prepares and encodes it, the next finds both
by the file's content (what each follow-up used to cost: preparing it all again).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.cli.bench_shapes import SHAPES
from engine.cli.numbers import frame_size, real
from engine.errors import EngineError


def _text_part(name: str, **changes: Any) -> dict[str, Any]:
    """A text shape of engine/cli/bench_shapes.py by name, as a vision model's text_config (its
    model_type is the vision model's), with what the multimodal release changes."""
    return {**{k: v for k, v in SHAPES[name].items() if k != "model_type"}, **changes}


# Qwen3-VL-4B's vision tower (Qwen3.5-4B's is the same without deepstack taps), and the
# same at toy size.
_VISION_4B: dict[str, Any] = dict(
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
)
_VISION_TINY: dict[str, Any] = {
    **_VISION_4B,
    "depth": 2,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_heads": 2,
    "out_hidden_size": 64,
    "num_position_embeddings": 64,
    "deepstack_visual_indexes": [0],
}
# Published shapes (text and vision): Qwen/Qwen3-VL-4B-Instruct, whose text part is
# Qwen3-4B's with a longer mRoPE; Qwen/Qwen3.5-4B, whose text part is bench's qwen3.5-4b.
# And tiny ones for CPU checks.
MEDIA_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-vl-4b": {
        "model_type": "qwen3_vl",
        "text": _text_part(
            "qwen3-4b",
            rope_theta=5000000.0,
            max_position_embeddings=262144,
            rope_scaling={"rope_type": "default", "mrope_section": [24, 20, 20], "mrope_interleaved": True},
        ),
        "vision": _VISION_4B,
    },
    "qwen3-vl-tiny": {
        "model_type": "qwen3_vl",
        "text": _text_part(
            "tiny",
            num_hidden_layers=3,
            head_dim=16,
            intermediate_size=96,
            rms_norm_eps=1e-6,
            max_position_embeddings=65536,
            tie_word_embeddings=True,
            rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True},
        ),
        "vision": _VISION_TINY,
    },
    "qwen3.5-4b": {
        "model_type": "qwen3_5",
        "text": _text_part("qwen3.5-4b"),
        "vision": {**_VISION_4B, "deepstack_visual_indexes": []},
    },
    "qwen3.5-tiny": {
        "model_type": "qwen3_5",
        "text": _text_part(
            "tiny-qwen3.5",
            intermediate_size=96,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            max_position_embeddings=65536,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000000,
                "partial_rotary_factor": 0.25,
                "mrope_section": [2, 1, 1],
                "mrope_interleaved": True,
            },
        ),
        "vision": {**_VISION_TINY, "deepstack_visual_indexes": []},
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
# Soft-token and vision-marker ids of the random vocabulary.
IMAGE_ID, VIDEO_ID, VISION_START, VISION_END = 5, 6, 3, 4


def add_media_arguments(p: Any) -> None:
    p.add_argument(
        "--media",
        choices=["image", "video"],
        help="time to first token for one image or clip on a vision model's shape (--shape qwen3-vl-4b, qwen3.5-4b)",
    )
    p.add_argument(
        "--media-seconds",
        type=real("--media-seconds", 0, 3600, above=True),
        default=30.0,
        help="the clip's length (with --media video)",
    )
    p.add_argument(
        "--media-size",
        type=frame_size("--media-size", 8192),
        default=(1280, 720),
        help="the clip's frame size WxH (with --media video)",
    )


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
    from engine.media.video import probe

    if kind == "image":
        proc = Qwen2VLImageProcessor.from_config(IMAGE_SETTINGS)
        vision = proc([Image.fromarray(source)])
        t, h, w = (int(v) for v in vision.image_grid_thw[0])
        return [(vision.pixel_values, (t, h, w))], proc.merge_size
    proc = VideoProcessor.from_config(VIDEO_SETTINGS)
    info = probe(source)
    indices = proc.sample(info.frames, info.fps)
    patches = proc.from_clip(source, indices, info.fps)
    groups, h, w = patches.grid
    rows = np.split(patches.pixel_values, groups)
    return [(r, (1, h, w)) for r in rows], proc.merge_size


def _build(shape: dict[str, Any], seed: int) -> tuple[Any, Any]:
    """The language model and the vision tower of a shape, random bf16 weights."""
    import mlx.core as mx

    from engine.media.qwen3_vl.tower import VisionConfig, VisionModel
    from engine.models import get_family

    mx.random.seed(seed)
    kind = shape["model_type"]
    family = get_family(kind)
    model = family.Model(
        family.ModelArgs.from_dict({"model_type": kind, "text_config": shape["text"], "vision_config": shape["vision"]})
    )
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    tower = VisionModel(VisionConfig.from_dict(shape["vision"]))
    tower.set_dtype(mx.bfloat16)
    mx.eval(tower.parameters())
    return model, tower


def _quantize(module: Any, bits: int, group_size: int) -> None:
    import mlx.nn as nn

    if bits in (4, 8):
        nn.quantize(
            module,
            group_size=group_size,
            bits=bits,
            class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % group_size == 0,
        )


def run_media_bench(args: Any) -> int:
    import mlx.core as mx
    import numpy as np

    from engine.decode.loop import PromptInputs, generate_step
    from engine.models.kv_cache import make_prompt_cache

    shape = MEDIA_SHAPES.get(args.shape)
    if shape is None or not args.media:
        raise EngineError(f"--media image|video goes with a vision shape: --shape {' or '.join(sorted(MEDIA_SHAPES))}")
    if args.vs == "mlx-lm":
        raise EngineError("--media compares with mlx-vlm, not mlx-lm: use --vs mlx-vlm")
    model, tower = _build(shape, args.seed)

    with tempfile.TemporaryDirectory() as tmp:
        peer = None
        if args.vs == "mlx-vlm":
            peer = _mlx_vlm_model(model, tower, shape, Path(tmp) / "weights", args.bits, args.group_size)
        _quantize(model, args.bits, args.group_size)
        mx.eval(model.parameters())
        if args.media == "image":
            source: Any = np.random.default_rng(args.seed).integers(0, 256, (1024, 1024, 3), dtype=np.uint8)
            what = "one 1024x1024 image"
        else:
            width, height = args.media_size
            source = _clip(Path(tmp) / "clip.mp4", args.media_seconds, width, height)
            what = f"one {args.media_seconds:g} s {width}x{height} clip"
        print(f"{args.shape} (random weights) on {mx.default_device()}: time to first token for {what}", flush=True)
        runs, peer_runs = [], []
        for _ in range(max(1, args.repeat) + 1):  # the first run of each warms up; runs interleave
            runs.append(_time_once(args.media, source, model, tower, make_prompt_cache, PromptInputs, generate_step))
            if peer is not None:
                peer_runs.append(_time_mlx_vlm(args.media, source, peer))
        split = _video_split(source) if args.media == "video" else None
        follow_up = _follow_up(shape, model, tower, source, Path(tmp) / "towers") if args.media == "video" else None
    best = min(runs[1:], key=lambda r: r["ttft_s"])
    print(
        f"engine   ttft {best['ttft_s']:.3f} s = preprocess {best['preprocess_s']:.3f} + tower "
        f"{best['tower_s']:.3f} + prefill {best['prefill_s']:.3f}  ({best['prompt_tokens']} prompt tokens, "
        f"{best['runs']} runs of soft tokens)",
        flush=True,
    )
    if split:
        stages = " + ".join(f"{name} {seconds:.3f}" for name, seconds in split.items())
        print(
            f"engine   preprocess stage by stage (one after another): {stages} = {sum(split.values()):.3f} s",
            flush=True,
        )
        best["preprocess_split"] = split
    if follow_up:
        print(
            f"engine   follow-up turn with the same clip: its media work was {follow_up['prepare_s']:.3f} s "
            f"(preparing it again; the tower's output was cached), now {follow_up['follow_up_s']:.3f} s "
            "(found by the file's content)",
            flush=True,
        )
        best["follow_up"] = follow_up
    out: dict[str, Any] = {"shape": args.shape, "media": args.media, "device": str(mx.default_device()), "engine": best}
    if peer_runs:
        theirs = min(peer_runs[1:], key=lambda r: r["ttft_s"])
        print(
            f"mlx-vlm  ttft {theirs['ttft_s']:.3f} s = preprocess {theirs['preprocess_s']:.3f} + tower and prefill "
            f"{theirs['model_s']:.3f}  ({theirs['prompt_tokens']} prompt tokens)",
            flush=True,
        )
        if theirs.get("preprocess_note"):
            print(f"mlx-vlm  preprocess: {theirs['preprocess_note']}", flush=True)
        ratio = theirs["ttft_s"] / best["ttft_s"]
        print(f"engine / mlx-vlm: {ratio:.2f}x faster to the first token", flush=True)
        if theirs["first_token"] != best["first_token"]:  # greedy on the same weights and inputs
            print(
                f"warning: the first tokens differ (engine {best['first_token']}, mlx-vlm "
                f"{theirs['first_token']}): the two did not run the same model",
                flush=True,
            )
        out.update({"mlx_vlm": theirs, "ttft_speedup": ratio})
    if args.json:
        print(json.dumps(out))
    return 0


def _prompt(kind: str, runs: list[tuple[Any, tuple[int, int, int]]], merge: int) -> tuple[list[int], list[Any]]:
    """Prompt ids around the soft tokens as the processor lays them out (text, then per run
    a timestamp's worth of text and the vision markers), and the runs' (start, end, grid)."""
    soft = IMAGE_ID if kind == "image" else VIDEO_ID
    ids: list[int] = list(range(20, 36))
    spans = []
    for _, (t, h, w) in runs:
        n = t * h * w // (merge * merge)
        ids += [40, 41, VISION_START]
        spans.append((len(ids), len(ids) + n, (t, h // merge, w // merge)))
        ids += [soft] * n + [VISION_END]
    ids += list(range(50, 66))
    return ids, spans


def _time_once(kind, source, model, tower, make_prompt_cache, PromptInputs, generate_step) -> dict[str, Any]:
    import mlx.core as mx
    import numpy as np

    start = time.perf_counter()
    runs, merge = _prepare(kind, source)
    prepared = time.perf_counter()
    features = [tower(mx.array(pixels), grid).astype(mx.bfloat16) for pixels, grid in runs]
    mx.eval(features)
    encoded = time.perf_counter()
    ids, spans = _prompt(kind, runs, merge)
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
    first = None
    for first, _ in generate_step(
        mx.array(ids, dtype=mx.uint32), model, cache, max_tokens=1, inputs=inputs, prefill_chunk=2048
    ):
        break
    done = time.perf_counter()
    return {
        "first_token": first,
        "ttft_s": done - start,
        "preprocess_s": prepared - start,
        "tower_s": encoded - prepared,
        "prefill_s": done - encoded,
        "prompt_tokens": len(ids),
        "runs": len(runs),
        "peak_memory_bytes": int(mx.get_peak_memory()),
    }


def _mlx_vlm_model(model: Any, tower: Any, shape: dict[str, Any], folder: Path, bits: int, group_size: int) -> Any:
    """mlx-vlm's model of the shape, loaded by mlx-vlm from the engine's random weights."""
    import importlib.util

    import mlx.core as mx
    from mlx.utils import tree_flatten

    if importlib.util.find_spec("mlx_vlm") is None:
        raise EngineError("--vs mlx-vlm needs mlx-vlm installed: pip install mlx-vlm")
    from mlx_vlm.utils import load_model

    folder.mkdir(parents=True)
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        if name.startswith("model."):
            name = "language_model.model." + name[len("model.") :]
        elif name.startswith("lm_head."):
            name = "language_model." + name
        weights[name] = value
    weights.update({"vision_tower." + name: value for name, value in tree_flatten(tower.parameters())})
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    text = {"model_type": f"{shape['model_type']}_text", **shape["text"]}
    params = text.get("rope_parameters") or text.get("rope_scaling")
    if isinstance(params, dict):  # mlx-vlm reads "type" and wants the base inside the block
        params = {"type": params.get("rope_type", "default"), "rope_theta": text.get("rope_theta", 10000), **params}
        text["rope_parameters"] = text["rope_scaling"] = params
    config = {
        "model_type": shape["model_type"],
        "text_config": text,
        "vision_config": {"model_type": shape["model_type"], **shape["vision"]},
        "image_token_id": IMAGE_ID,
        "video_token_id": VIDEO_ID,
        "vision_start_token_id": VISION_START,
        "vision_end_token_id": VISION_END,
        "tie_word_embeddings": text.get("tie_word_embeddings", False),
        "vocab_size": text["vocab_size"],
    }
    (folder / "config.json").write_text(json.dumps(config))
    peer = load_model(folder)
    _quantize(peer.language_model, bits, group_size)
    mx.eval(peer.parameters())
    return peer


def _time_mlx_vlm(kind: str, source: Any, peer: Any) -> dict[str, Any]:
    """mlx-vlm's own path from pixel values to the first token: its generate_step, whose
    first pass runs its tower, merges the features and prefills."""
    import mlx.core as mx
    import numpy as np
    from mlx_vlm.generate import generate_step

    runs, merge = _prepare(kind, source)  # the engine's pixels, which both models see
    start = time.perf_counter()
    note = _mlx_vlm_preprocess(kind, source, runs)
    if note is None:
        note = "no OpenCV here (mlx-vlm's video loader needs it): the engine's preprocessing time is used"
        _prepare(kind, source)
    prepared = time.perf_counter()
    ids, _ = _prompt(kind, runs, merge)
    pixels = mx.array(np.concatenate([r for r, _ in runs]))
    if kind == "image":
        image, media = pixels, {"image_grid_thw": mx.array([list(runs[0][1])], dtype=mx.int32)}
    else:  # one clip: its temporal groups, each (1, h, w), as one (groups, h, w) grid
        _, h, w = runs[0][1]
        image, media = None, {"pixel_values_videos": pixels, "video_grid_thw": mx.array([[len(runs), h, w]])}
    steps = generate_step(
        mx.array(ids, dtype=mx.int32)[None], peer, image, None, max_tokens=1, temperature=0.0, **media
    )
    token, _ = next(steps)
    token = int(token.item() if isinstance(token, mx.array) else token)  # evaluated
    steps.close()
    done = time.perf_counter()
    return {
        "first_token": token,
        "ttft_s": done - start,
        "preprocess_s": prepared - start,
        "model_s": done - prepared,
        "prompt_tokens": len(ids),
        "peak_memory_bytes": int(mx.get_peak_memory()),
        "preprocess_note": note,
    }


def _mlx_vlm_preprocess(kind: str, source: Any, runs: list[tuple[Any, tuple[int, int, int]]]) -> str | None:
    """mlx-vlm's own preprocessing of a clip (its OpenCV loader with the processor's
    sampling, then its Qwen3-VL video processor), checked against the engine's ``runs``;
    what it says about the difference ("" for an image, whose preprocessing is the
    engine's), or None without OpenCV."""
    import importlib.util

    import numpy as np

    if kind != "video":
        _prepare(kind, source)
        return ""
    if importlib.util.find_spec("cv2") is None:
        return None
    from mlx_vlm.models.qwen3_vl.processing_qwen3_vl import Qwen3VLVideoProcessor
    from mlx_vlm.utils import VideoSampling, load_video

    s = VIDEO_SETTINGS
    processor = Qwen3VLVideoProcessor(
        patch_size=s["patch_size"],
        temporal_patch_size=s["temporal_patch_size"],
        merge_size=s["merge_size"],
        min_pixels=s["size"]["shortest_edge"],
        max_pixels=s["size"]["longest_edge"],
        image_mean=s["image_mean"],
        image_std=s["image_std"],
    )
    sampling = VideoSampling(fps=s["fps"], min_frames=s["min_frames"], max_frames=s["max_frames"])
    video, metadata = load_video(str(source), sampling)
    out = processor(videos=[video], video_metadata=[metadata])
    theirs, grid = np.asarray(out["pixel_values_videos"]), [int(v) for v in out["video_grid_thw"][0]]
    ours = np.concatenate([r for r, _ in runs])
    if theirs.shape != ours.shape or grid != [len(runs), *runs[0][1][1:]]:
        return f"mlx-vlm made {theirs.shape} pixel values (grid {grid}), the engine {ours.shape}"
    return f"its pixel values are within {float(np.abs(theirs - ours).max()):.1e} of the engine's"


def _follow_up(shape: dict[str, Any], model: Any, tower: Any, clip: Path, folder: Path) -> dict[str, float]:
    """Seconds of a turn's media work for the clip through the engine's MediaTowers: the
    first turn's preparing and encoding, then a follow-up turn's (the same clip again)."""
    import mlx.core as mx

    from engine.api import MediaInput
    from engine.artifacts.config import config_from_dict
    from engine.media.towers import MediaTowers, TowerSource

    folder.mkdir()
    (folder / "video_preprocessor_config.json").write_text(json.dumps(VIDEO_SETTINGS))
    raw = {"model_type": shape["model_type"], "text_config": shape["text"], "vision_config": shape["vision"]}
    towers = MediaTowers(TowerSource("bench", folder, config_from_dict(raw), model, "bfloat16"))
    towers.encoder("video").tower.module = tower  # the bench's tower, weights and all
    item = [MediaInput("video", str(clip))]
    start = time.perf_counter()
    prepared = towers.prepare(item)[0]
    took = {"prepare_s": time.perf_counter() - start}
    mx.eval([towers.features(run) for run in prepared.runs()])
    start = time.perf_counter()
    again = towers.prepare(item)[0]
    mx.eval([towers.features(run) for run in again.runs()])
    took["follow_up_s"] = time.perf_counter() - start
    if towers.prepare_calls != 1:
        raise EngineError("The follow-up turn prepared the clip again: the engine did not remember it.")
    return took


def _video_split(source: Any) -> dict[str, float]:
    """The engine's video preprocessing a stage at a time, each over the whole clip before the
    next (the decoder on its own threads, the rest on one): where its time goes."""
    from engine.media.qwen3_vl.processor import FramePatches, VideoProcessor
    from engine.media.video import decoded_frames, probe

    times: dict[str, float] = {}

    def lap(name: str, since: float) -> float:
        now = time.perf_counter()
        times[name] = times.get(name, 0.0) + now - since
        return now

    start = time.perf_counter()
    proc = VideoProcessor.from_config(VIDEO_SETTINGS)
    info = probe(source)
    indices = proc.sample(info.frames, info.fps)
    now = lap("open", start)
    frames = list(decoded_frames(source, indices))
    now = lap("decode", now)
    rgb = [f.to_ndarray(format="rgb24") for f in frames]
    now = lap("rgb", now)
    patches = FramePatches(proc, len(rgb), *rgb[0].shape)
    resized = [patches.resize(f) for f in rgb]
    now = lap("resize", now)
    for k, f in enumerate(resized):
        patches.write(k, f)
    patches.finish(len(resized), indices, info.fps)
    lap("normalise+patch", now)
    return times
