"""Whisper's timestamp tokens: the decoding rules that keep them well formed, and how a
window's output splits into timed segments.

The rules are those of transformers' ``WhisperTimeStampLogitsProcessor`` (after OpenAI's
decoder), applied after token suppression at every step:

- <|notimestamps|> is never chosen;
- timestamps come in pairs: after a lone timestamp that followed text, the next token is a
  timestamp or end-of-text (ids below end-of-text are masked); after two timestamps in a
  row (or one at the very start) the next token is text;
- timestamps never decrease, and a closing one may not repeat an earlier pair's time;
- the first token is a timestamp, at most ``max_initial_index`` steps (0.02 s each) in;
- when the timestamps' total probability beats every single text token, a timestamp is forced.

Segment splitting mirrors transformers' long-form ``generate``: every pair of consecutive
timestamps ends a segment; a window that ends on text after its last pair is cut there,
and the next window starts at that pair's time ("seek"), so no word is split.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

TIME_PRECISION = 0.02  # seconds per timestamp token
FEATURE_PRECISION = 0.01  # seconds per mel frame (hop 160 at 16 kHz)
INPUT_STRIDE = 2  # mel frames per encoder position, hence per timestamp step


@dataclass
class TimestampRules:
    """Masks for one window's decoding; ``timestamp_begin`` is the id of <|0.00|>."""

    timestamp_begin: int
    no_timestamps_id: int
    eos_id: int
    max_initial_index: int | None = None

    def apply(self, generated: list[int], logits: np.ndarray) -> np.ndarray:
        """``logits`` (vocab,) for the next token after ``generated`` (this window's new ids,
        the prompt excluded), with the rules applied as -inf."""
        tb = self.timestamp_begin
        out = np.array(logits, dtype=np.float32, copy=True)
        out[self.no_timestamps_id] = -np.inf
        last_is_ts = len(generated) >= 1 and generated[-1] >= tb
        before_last_is_ts = len(generated) < 2 or generated[-2] >= tb
        if last_is_ts:
            if before_last_is_ts:
                out[tb:] = -np.inf  # a pair just closed: text next
            else:
                out[: self.eos_id] = -np.inf  # a lone timestamp after text: its pair, or the end
        times = [t for t in generated if t >= tb]
        if times:
            # An open pair may close on the same time; otherwise time moves strictly forward.
            lowest = times[-1] if last_is_ts and not before_last_is_ts else times[-1] + 1
            out[tb:lowest] = -np.inf
        if not generated:
            out[:tb] = -np.inf
            if self.max_initial_index is not None:
                out[tb + self.max_initial_index + 1 :] = -np.inf
        # Force a timestamp when all of them together are likelier than any text token
        # (log-softmax in float32, as the reference computes it).
        with np.errstate(invalid="ignore", divide="ignore"):
            peak = out.max()
            logprobs = out - peak - np.log(np.exp(out - peak, dtype=np.float32).sum(dtype=np.float32))
            ts = logprobs[tb:]
            ts_peak = ts.max()
            ts_total = ts_peak + np.log(np.exp(ts - ts_peak).sum(dtype=np.float32)) if np.isfinite(ts_peak) else -np.inf
        if ts_total > logprobs[:tb].max():
            out[:tb] = -np.inf
        return out


@dataclass
class TimedSegment:
    """A piece of one window: its ids (timestamp tokens included) and times in seconds."""

    start_s: float
    end_s: float
    token_ids: list[int] = field(default_factory=list)


def split_window(
    tokens: list[int], timestamp_begin: int, seek: int, window_frames: int
) -> tuple[list[TimedSegment], int]:
    """Segments of one window decoded from mel frame ``seek`` over ``window_frames`` frames,
    and how many frames the next window starts after this one's start.

    Times are computed the way the reference does, in float64 from the frame offset, so
    they compare exactly."""
    tb = timestamp_begin
    offset = seek * TIME_PRECISION / INPUT_STRIDE
    is_ts = [t >= tb for t in tokens]
    ends_single = is_ts[-2:] == [False, True]  # one timestamp after text: no speech after it
    cuts = [i + 1 for i in range(len(tokens) - 1) if is_ts[i] and is_ts[i + 1]]
    if not cuts:
        # No closed segment: the whole window is one, ending at its last timestamp if any
        # (other than <|0.00|>), else at the window's end (float32 as the reference has it).
        end_pos: float = int(np.float32(window_frames) * np.float32(FEATURE_PRECISION) / np.float32(TIME_PRECISION))
        stamps = [t for t in tokens if t >= tb]
        if stamps and stamps[-1] != tb:
            end_pos = float(stamps[-1] - tb)
        return [TimedSegment(offset, offset + end_pos * TIME_PRECISION, list(tokens))], window_frames
    if ends_single:
        cuts.append(len(tokens))
    else:
        cuts[-1] += 1  # keep the closing pair's second timestamp in the last segment
    segments = []
    last = 0
    for k, cut in enumerate(cuts):
        piece = tokens[last:cut]
        end_token = piece[-1] if k < len(cuts) - 1 or ends_single else piece[-2]
        segments.append(
            TimedSegment(
                offset + float(piece[0] - tb) * TIME_PRECISION,
                offset + float(end_token - tb) * TIME_PRECISION,
                list(piece),
            )
        )
        last = cut
    if ends_single:
        return segments, window_frames
    # Text after the last pair is unfinished: drop it and start the next window at that pair.
    return segments, (tokens[last - 2] - tb) * INPUT_STRIDE
