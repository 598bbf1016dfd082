"""The readers under the CLI, checked directly: a bounded read still takes a pipe, and a
media processor's settings that mean nothing are refused in one line naming the key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc
from pathlib import Path

import pytest

from engine.artifacts.config_values import check_processor_settings
from engine.errors import EngineError, ModelLoadError
from engine.files import read_bytes_bounded

REPO = Path(__file__).resolve().parents[2]


def test_a_pipe_is_read_up_to_the_bound(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    writer = subprocess.Popen([sys.executable, "-c", f"open({str(fifo)!r}, 'wb').write(b'x' * 5000)"])
    with pytest.raises(EngineError, match="larger than 4,096 bytes, too large to be a test"):
        read_bytes_bounded(fifo, 4096, "a test")
    writer.wait(timeout=30)


def test_a_small_file_costs_its_size_not_the_bound(tmp_path):
    small = tmp_path / "config.json"
    small.write_text('{"model_type": "llama"}' * 40)
    tracemalloc.start()
    data = read_bytes_bounded(small, 512 * 1024 * 1024, "a test")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert data == small.read_bytes()
    assert peak < 256 * 1024, f"reading {len(data)} bytes reserved {peak:,}"


def test_messages_from_stdin_still_render(tmp_path):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    done = subprocess.run(
        [sys.executable, "-m", "engine", "template", "--template", str(template), "--messages", "/dev/stdin"],
        input=json.dumps({"messages": [{"role": "user", "content": "piped"}]}),
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "[piped]"


PROCESSOR_CASES = [
    ({"patch_size": 0}, "patch_size is 0; it must be a positive number"),
    ({"merge_size": -2}, "merge_size is -2"),
    ({"max_pixels": float("nan")}, "max_pixels is nan"),
    ({"size": {"height": -64, "width": 64}}, "size.height is -64; it must be a positive number"),
    ({"size": -1}, "size is -1"),
    ({"patch_size": {"height": 8, "width": 0}}, "patch_size.width is 0"),
    ({"crop_size": [224, 0]}, "crop_size.1 is 0"),
    ({"image_std": [0.5, 0.0, 0.5]}, "image_std is [0.5, 0.0, 0.5]"),
    ({"image_mean": ["a"]}, "image_mean is ['a']"),
    ({"sampling_rate": 0}, "sampling_rate is 0"),
    ({"fps": "fast"}, "fps is 'fast'"),
]


@pytest.mark.parametrize("settings,needle", PROCESSOR_CASES, ids=[c[1].split(" is ")[0] for c in PROCESSOR_CASES])
def test_processor_settings_that_mean_nothing(settings, needle):
    with pytest.raises(ModelLoadError) as caught:
        check_processor_settings(settings, "preprocessor_config.json")
    assert needle in str(caught.value) and "\n" not in str(caught.value)


def test_real_processor_settings_pass():
    qwen2_vl = {
        "min_pixels": 3136, "max_pixels": 12845056, "patch_size": 14, "temporal_patch_size": 2, "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
        "rescale_factor": 0.00392156862745098, "size": {"shortest_edge": 3136, "longest_edge": 12845056},
    }  # fmt: skip
    whisper = {"feature_size": 80, "sampling_rate": 16000, "hop_length": 160, "chunk_length": 30, "n_fft": 400}
    gemma3 = {"size": {"height": 896, "width": 896}, "image_seq_length": 256, "crop_size": None, "resample": 2}
    pixtral = {"patch_size": {"height": 16, "width": 16}, "size": {"longest_edge": 1540}, "image_std": [0.26, 0.26]}
    for settings in (qwen2_vl, whisper, gemma3, pixtral):
        check_processor_settings(settings, "preprocessor_config.json")


def test_the_number_parsers_take_what_people_write():
    from engine.cli.numbers import frame_size, memory_bytes, real, whole

    assert whole("--repeat", 1, 1000)("3") == 3
    assert whole("-p", 1, 1 << 20)("2,048") == 2048 == whole("-p", 1, 1 << 20)("2_048")
    assert whole("-p", 1, 1 << 20)("1e3") == 1000
    assert real("--media-seconds", 0, 3600, above=True)("0.5") == 0.5
    assert frame_size("--media-size", 8192)("1280X720") == (1280, 720)
    assert memory_bytes("12GB") == 12 * 10**9 and memory_bytes("800mb") == 800 * 10**6


def test_help_still_exits_zero(capsys):
    from engine.cli.main import main

    assert main(["--help"]) == 0
    assert "generate" in capsys.readouterr().out


def test_a_device_as_media_is_refused_not_hashed_forever():
    from engine.errors import MediaError
    from engine.media.encoded_cache import content_digest

    with pytest.raises(MediaError, match="/dev/zero is not a regular file, so it cannot be a media file"):
        content_digest("/dev/zero")
