"""Long-form transcription against transformers' Whisper ``generate`` with timestamps.

tests/golden/make_audio_goldens.py builds a tiny random Whisper laid out like the real
checkpoints (all 1501 timestamp tokens, max_initial_timestamp_index 50) and stores
transformers' long-form segments (tokens with their timestamp tokens, start and end
times, the seek of every window) on 72 s made of ../shared/data/audio/jfk.wav and 1 s of
silence, six times; the same clip is rebuilt here. Ids and times compare exactly.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.errors import EngineError
from engine.media.audio import load_audio
from engine.media.whisper.timestamps import TimestampRules, split_window
from engine.media.whisper.transcribe import Transcriber
from tests.engine.media.audio_checkpoints import load_arrays, load_meta, write_whisper_folder

META = load_meta("whisper_longform")
TB = META["generation_config"]["no_timestamps_token_id"] + 1  # <|0.00|>


@pytest.fixture(scope="module")
def gold() -> dict:
    return load_arrays("whisper_longform")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_whisper_folder(tmp_path_factory.mktemp("whisper") / "whisper-longform-random", META)


@pytest.fixture(scope="module")
def transcriber(folder) -> Transcriber:
    return Transcriber.load(folder)


@pytest.fixture(scope="module")
def jfk(shared_data) -> np.ndarray:
    return load_audio(shared_data / "audio" / "jfk.wav", 16000)


@pytest.fixture(scope="module")
def clip(jfk) -> np.ndarray:
    """The golden script's 72 s: the clip and a gap of silence, repeated."""
    gap = np.zeros(int(META["gap_s"] * 16000), dtype=np.float32)
    return np.concatenate([jfk, gap] * META["repeats"])


def reference(gold: dict, name: str) -> list[tuple[list[int], float, float]]:
    bounds, tokens, times = gold[f"{name}/bounds"], gold[f"{name}/tokens"].tolist(), gold[f"{name}/times"]
    return [(tokens[bounds[i] : bounds[i + 1]], float(times[i][0]), float(times[i][1])) for i in range(len(bounds) - 1)]


def segments_of(result) -> list[tuple[list[int], float, float]]:
    return [(s.token_ids, s.start_s, s.end_s) for s in result.segments]


def starts_of_windows(gold: dict, name: str) -> list[float]:
    return [seek * 0.02 / 2 for seek in gold[f"{name}/seeks"].tolist()]


def test_long_audio_matches_transformers_long_form(transcriber, clip, gold):
    assert clip.shape[0] // 160 == META["frames"]
    seen = []
    result = transcriber.transcribe(clip, on_window=lambda done, total: seen.append((done, total)))
    assert segments_of(result) == reference(gold, "long")
    assert [s for seg in result.segments for s in seg.token_ids] == gold["long/sequence"].tolist()
    assert len(seen) == len(gold["long/seeks"]) and seen[-1][0] == seen[-1][1] == len(seen)
    assert result.language == META["detected_language"]["long"]
    assert result.duration_s == pytest.approx(72.0)
    assert result.text == " ".join(s.text for s in result.segments if s.text)
    # Text leaves the timestamp tokens out; they are the segment's bounds instead.
    for seg in result.segments:
        assert seg.text == " ".join(f"w{i}" for i in seg.token_ids if i < META["n_ordinary"])


def test_window_cut_mid_segment_resumes_at_its_last_timestamp(transcriber, clip, gold):
    """Capped at a few tokens per window, decoding stops inside a segment: the unfinished
    text is dropped and the next window starts at the last closed segment's end."""
    seeks = gold["capped/seeks"].tolist()
    assert any(s % 3000 for s in seeks)  # the reference did not move on by 30 s
    result = transcriber.transcribe(clip, max_new_tokens=META["capped_max_new_tokens"])
    got = segments_of(result)
    assert got == reference(gold, "capped")
    # Each later window's first segment starts at or after where that window began.
    for start in starts_of_windows(gold, "capped")[1:]:
        assert any(s >= start for _, s, _ in got)


def test_short_clip_with_timestamps_matches_transformers(transcriber, jfk, gold):
    result = transcriber.transcribe(jfk, timestamps=True)
    assert segments_of(result) == reference(gold, "short")
    assert result.language == META["detected_language"]["short"]


# ---- the rules and the splitting on their own ----------------------------------------


def rules() -> TimestampRules:
    return TimestampRules(timestamp_begin=TB, no_timestamps_id=TB - 1, eos_id=100, max_initial_index=50)


def allowed(generated: list[int], logits: np.ndarray | None = None) -> np.ndarray:
    vocab = TB + 1501
    out = rules().apply(generated, np.zeros(vocab, np.float32) if logits is None else logits)
    return np.isfinite(out)


def test_rules_first_token_is_an_early_timestamp():
    ok = allowed([])
    assert not ok[:TB].any() and ok[TB : TB + 51].all() and not ok[TB + 51 :].any()


def test_rules_pair_timestamps_and_keep_them_increasing():
    after_open = allowed([TB + 10])  # a lone opening timestamp: text next
    assert not after_open[TB:].any() and after_open[: TB - 1].all()
    likely_end = np.zeros(TB + 1501, np.float32)
    likely_end[100] = 10.0  # so that the timestamps together do not force one
    after_text = allowed([TB + 10, 5, TB + 20], likely_end)  # text then a timestamp: its pair or the end
    assert not after_text[:100].any() and after_text[100] and after_text[TB + 20]
    assert not after_text[TB : TB + 20].any() and not after_text[TB - 1]
    closed = allowed([TB + 10, 5, TB + 20, TB + 20])  # a closed pair: text next
    assert not closed[TB:].any()
    texting = allowed([TB + 10, 5, TB + 20, TB + 20, 7])  # a new timestamp must move forward
    assert not texting[TB : TB + 21].any() and texting[TB + 21]


def test_rules_force_a_timestamp_when_together_they_beat_every_word():
    logits = np.zeros(TB + 1501, np.float32)
    logits[5] = 6.0  # one word likelier than any single timestamp, not than the 1500 allowed timestamps together
    ok = allowed([TB, 5], logits)
    assert not ok[:TB].any() and ok[TB + 1 :].all()
    logits[5] = 9.0  # e^9 > 1500: the word stays possible
    assert allowed([TB, 5], logits)[5]


def test_split_window_cuts_at_pairs_and_seeks_to_the_last_one():
    a, b, c = TB + 50, TB + 300, TB + 700
    # ... <|1.00|> w5 <|6.00|><|6.00|> w7 (unfinished): one segment, resume at 6.00 s.
    segs, advance = split_window([a, 5, b, b, 7], TB, seek=1000, window_frames=3000)
    assert [(s.token_ids, s.start_s, s.end_s) for s in segs] == [
        ([a, 5, b, b], pytest.approx(11.0), pytest.approx(16.0))
    ]
    assert advance == 600
    # A single closing timestamp after text: nothing after it, the whole window is used.
    segs, advance = split_window([a, 5, b, b, 7, c], TB, seek=0, window_frames=3000)
    assert [t for s in segs for t in (s.start_s, s.end_s)] == pytest.approx([1.0, 6.0, 6.0, 14.0]) and advance == 3000
    # No pair at all: one segment to the window's end.
    segs, advance = split_window([TB, 5, 6], TB, seek=0, window_frames=1200)
    assert [t for s in segs for t in (s.start_s, s.end_s)] == pytest.approx([0.0, 12.0]) and advance == 1200


def test_a_checkpoint_without_timestamp_tokens_is_refused_for_long_audio(folder, tmp_path):
    import json
    import shutil

    other = tmp_path / "no-timestamps"
    shutil.copytree(folder, other)
    gen = json.loads((other / "generation_config.json").read_text())
    gen["no_timestamps_token_id"] = META["config"]["vocab_size"] - 1  # nothing after it
    (other / "generation_config.json").write_text(json.dumps(gen))
    t = Transcriber.load(other)
    with pytest.raises(EngineError, match="no timestamp tokens"):
        t.transcribe(np.zeros(31 * 16000, np.float32))
