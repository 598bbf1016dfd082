"""Band-limited sample-rate conversion in numpy (polyphase, Kaiser-windowed sinc).

The design is the classic one for rational ratios up/down: an ideal low-pass at the
lower of the two Nyquist rates, truncated to ``zero_crossings`` lobes on each side of
the slower rate and tapered with a Kaiser window, then applied only at the output
instants (never materialising the zero-stuffed signal). With the defaults (10 lobes,
beta 5) the filter is the same one scipy's ``resample_poly`` designs, which lets the
tests use it as an outside referee.
"""

from __future__ import annotations

from math import gcd

import numpy as np

# Cap on the (outputs x taps) index matrix built per block, to bound memory on long clips.
_BLOCK_ELEMENTS = 1 << 22


def lowpass_filter(up: int, down: int, zero_crossings: int = 10, beta: float = 5.0) -> np.ndarray:
    """Prototype filter at the upsampled rate: length 2*half+1, DC gain ``up``."""
    rate = max(up, down)
    half = zero_crossings * rate
    taps = np.arange(-half, half + 1, dtype=np.float64)
    # Cutoff at the slower Nyquist: sinc with its first zero every ``rate`` taps.
    h = np.sinc(taps / rate) * np.kaiser(2 * half + 1, beta)
    # Unit DC gain, times up because zero-stuffing divides the signal's energy by up.
    return h * (up / h.sum())


def resample(
    audio: np.ndarray,
    orig_rate: int,
    target_rate: int,
    zero_crossings: int = 10,
    beta: float = 5.0,
) -> np.ndarray:
    """Resample a 1-D signal from ``orig_rate`` to ``target_rate`` Hz.

    Output sample n sits at input time n * orig/target; the output has
    ceil(len * target / orig) samples, and the signal is taken as zero outside its ends.
    """
    if orig_rate <= 0 or target_rate <= 0:
        raise ValueError(f"sample rates must be positive, got {orig_rate} and {target_rate}")
    x = np.asarray(audio, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"resample takes a 1-D signal, got shape {x.shape}")
    g = gcd(int(orig_rate), int(target_rate))
    up, down = int(target_rate) // g, int(orig_rate) // g
    if up == down:
        return x.astype(np.float32)
    n_in = x.shape[0]
    n_out = -(-n_in * up // down)
    h = lowpass_filter(up, down, zero_crossings, beta)
    half = (h.shape[0] - 1) // 2
    # y[n] = sum_i x[i] * h[n*down - i*up + half]; for each n only inputs with
    # |n*down - i*up| <= half contribute, at most 2*half//up + 1 of them.
    n_taps = 2 * half // up + 1
    x_pad = np.concatenate([x, np.zeros(1)])  # index n_in reads as zero
    out = np.empty(n_out, dtype=np.float64)
    block = max(1, _BLOCK_ELEMENTS // n_taps)
    j = np.arange(n_taps)
    for start in range(0, n_out, block):
        n = np.arange(start, min(start + block, n_out))
        centre = n * down
        first = -((half - centre) // up)  # ceil((centre - half) / up)
        idx = first[:, None] + j[None, :]
        tap = centre[:, None] - idx * up + half
        valid = (idx >= 0) & (idx < n_in) & (tap >= 0) & (tap <= 2 * half)
        idx = np.where(valid, idx, n_in)
        tap = np.where(valid, tap, 0)
        out[start : start + n.shape[0]] = np.sum(x_pad[idx] * np.where(valid, h[tap], 0.0), axis=1)
    return out.astype(np.float32)
