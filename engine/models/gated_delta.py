"""Gated DeltaNet linear attention (Qwen3.5, Qwen3-Next), shared by their families.

Per token: a depthwise causal convolution over the projected q/k/v (its last K-1 inputs
are the conv state), L2-normalised q and k, then the gated delta rule on a matrix state
S [value heads, Dv, Dk]:  S <- g*S;  S <- S + beta * k (v - S k)^T;  y = S q / sqrt(Dk).
``mx.fast.gated_delta_update`` runs the rule; it walks the tokens in order, so a pass cut
into chunks gives exactly the same numbers as one pass (chunked prefill equals a single
pass). On CUDA, where that walk is not a fused kernel, prompts take the chunked matrix form
of ``engine.models.delta_chunks`` instead (equal to float32 rounding). The output goes through an RMSNorm gated by silu(z) and the output projection.

The recurrent state stays float32, as in transformers' reference kernels.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import mlx.nn as nn

from engine.models.delta_chunks import MIN_TOKENS, chunked_delta_rule, chunked_pays
from engine.models.recurrent_cache import RecurrentCache, conv_after

L2_EPS = 1e-6  # transformers' l2norm (the FLA library's convention): x / sqrt(sum(x^2) + eps)

# Decoding is bound by per-op overhead: the elementwise steps below run as compiled
# (fused) functions, one call each instead of several ops.


@partial(mx.compile, shapeless=True)
def _silu_gated(y: mx.array, gate: mx.array) -> mx.array:
    return (y * nn.silu(gate.astype(mx.float32))).astype(y.dtype)


class GatedRMSNorm(nn.Module):
    """RMSNorm of each value head, times silu(gate); its weight is used as stored (no 1 + w)."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        y = mx.fast.rms_norm(x, self.weight, self.eps)
        return _silu_gated(y, gate)


@partial(mx.compile, shapeless=True)
def _qk_normalise(q: mx.array, k: mx.array, scale: mx.array) -> tuple[mx.array, mx.array]:
    """L2-normalised queries (times 1/sqrt(Dk)) and keys, in float32."""
    q, k = q.astype(mx.float32), k.astype(mx.float32)
    q = q * mx.rsqrt((q * q).sum(axis=-1, keepdims=True) + L2_EPS) * scale
    return q, k * mx.rsqrt((k * k).sum(axis=-1, keepdims=True) + L2_EPS)


@partial(mx.compile, shapeless=True)
def _log_gates(b: mx.array, a: mx.array, a_log: mx.array, dt_bias: mx.array) -> tuple[mx.array, mx.array]:
    """(beta, log decay) = (sigmoid(b), -exp(A_log) * softplus(a + dt_bias)), in float32."""
    beta = mx.sigmoid(b.astype(mx.float32))
    return beta, -mx.exp(a_log.astype(mx.float32)) * nn.softplus(a.astype(mx.float32) + dt_bias)


@partial(mx.compile, shapeless=True)
def _gates(b: mx.array, a: mx.array, a_log: mx.array, dt_bias: mx.array) -> tuple[mx.array, mx.array]:
    """(beta, decay), the decay in linear space as ``mx.fast.gated_delta_update`` takes it."""
    beta, log_decay = _log_gates(b, a, a_log, dt_bias)
    return beta, mx.exp(log_decay)


class GatedDeltaNet(nn.Module):
    """The linear-attention mixer; families give ``project(x) -> (qkv, z, b, a)``:
    qkv [B, T, 2*key_dim + value_dim] (before the convolution), z [B, T, Hv, Dv],
    b and a [B, T, Hv]."""

    def __init__(
        self,
        hidden_size: int,
        num_k_heads: int,
        num_v_heads: int,
        head_k_dim: int,
        head_v_dim: int,
        conv_kernel: int,
        eps: float,
        activation=nn.silu,
    ):
        super().__init__()
        if num_v_heads % num_k_heads:
            raise ValueError(
                f"linear_num_value_heads ({num_v_heads}) must be a multiple of linear_num_key_heads ({num_k_heads})"
            )
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = head_k_dim * num_k_heads, head_v_dim * num_v_heads
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = mx.ones((num_v_heads,))
        self.A_log = mx.zeros((num_v_heads,))
        self.norm = GatedRMSNorm(head_v_dim, eps)
        self.out_proj = nn.Linear(self.value_dim, hidden_size, bias=False)
        self.activation = activation

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        raise NotImplementedError

    def state_bytes(self, dtype_bytes: int) -> int:
        """Bytes of this layer's conv state plus its float32 recurrent state."""
        conv = (self.conv_kernel - 1) * self.conv_dim * dtype_bytes
        return conv + self.num_v_heads * self.head_v_dim * self.head_k_dim * 4

    def __call__(self, x: mx.array, mask=None, cache: RecurrentCache | None = None) -> mx.array:
        n = x.shape[1]
        record = cache is not None and cache.begin(n) and n > 1
        before, state = (cache[0], cache[1]) if cache is not None else (None, None)
        out, padded, states = self.mix(x, before, state, record)
        if cache is not None:
            if record:
                # The state after each token: a speculative round can then drop rejected drafts.
                for t in range(1, n):
                    cache.record(t, [padded[:, t : t + self.conv_kernel - 1], states[t - 1]])
            cache[0] = padded[:, -(self.conv_kernel - 1) :]
            cache[1] = states[-1]
            cache.advance(n)
        return out

    def mix(
        self, x: mx.array, before: mx.array | None, state: mx.array | None, each: bool
    ) -> tuple[mx.array, mx.array, list[mx.array]]:
        """The mixer's output for ``x`` [B, T, hidden] after the conv inputs ``before``
        [B, K-1, C] and the recurrent ``state`` (None: zeros, a fresh sequence), the conv
        input with ``before`` in front, and the states: after each token when ``each``,
        else the last only. Pure (no cache), so the compiled decode step traces it as is."""
        b, n, _ = x.shape
        qkv, z, beta_in, a = self.project(x)
        conv_out, padded = conv_after(self.conv1d, qkv, before, self.conv_kernel, each)
        conv_out = self.activation(conv_out)
        q, k, v = mx.split(conv_out, [self.key_dim, 2 * self.key_dim], axis=-1)
        q, k = _qk_normalise(
            q.reshape(b, n, self.num_k_heads, self.head_k_dim),
            k.reshape(b, n, self.num_k_heads, self.head_k_dim),
            mx.array(self.head_k_dim**-0.5),
        )
        v = v.reshape(b, n, self.num_v_heads, self.head_v_dim).astype(mx.float32)
        if state is None:
            state = mx.zeros((b, self.num_v_heads, self.head_v_dim, self.head_k_dim), mx.float32)
        if not each and n >= MIN_TOKENS and chunked_pays():
            # A prompt on CUDA: the fused kernel walks tokens one by one there (see delta_chunks).
            beta, log_decay = _log_gates(beta_in, a, self.A_log, self.dt_bias)
            y, state = chunked_delta_rule(q, k, v, log_decay, beta, state)
            y = self.norm(y.astype(x.dtype), z)
            return self.out_proj(y.reshape(b, n, -1)), padded, [state]
        beta, decay = _gates(beta_in, a, self.A_log, self.dt_bias)
        if each:
            # One token at a time (the kernel's own order, so the same numbers as one pass).
            ys, states = [], []
            for t in range(n):
                y_t, state = mx.fast.gated_delta_update(
                    q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1], decay[:, t : t + 1], beta[:, t : t + 1], state
                )
                ys.append(y_t)
                states.append(state)
            y = mx.concatenate(ys, axis=1)
        else:
            y, state = mx.fast.gated_delta_update(q, k, v, decay, beta, state)
            states = [state]
        y = self.norm(y.astype(x.dtype), z)
        return self.out_proj(y.reshape(b, n, -1)), padded, states
