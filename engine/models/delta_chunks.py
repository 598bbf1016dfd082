"""The gated delta rule over a whole prompt in chunks of matrix products (prefill on CUDA).

``mx.fast.gated_delta_update`` walks the tokens one by one. On Metal that walk is one fused
kernel and fast; on CUDA it is not, and a Qwen3.5-4B prompt prefilled at about 460 tokens
a second there. This is the chunked ("WY") form of the same recurrence: inside a chunk of
C tokens every token's write is found at once by matrix products and one triangular
solve, and only the chunks are walked in order (T / C steps of a few matmuls).

Per value head, with state S [Dv, Dk], decay g_t, rate beta_t, L2-normalised k_t and
scaled q_t, the rule is  S_t = g_t S_{t-1} + u_t k_t^T  with the write
u_t = beta_t (v_t - g_t S_{t-1} k_t), and  y_t = S_t q_t.  In a chunk starting from S0,
with the running decay G_t = g_1 ... g_t:

    S_t = G_t S0 + sum_{s<=t} (G_t / G_s) u_s k_s^T

so the writes solve a unit lower-triangular system,  (I + A) U = beta*V - diag(beta G) K S0^T
with  A[t,s] = beta_t (G_t / G_s) k_t.k_s  for s < t.  Writing  U0 = (I+A)^-1 beta*V  and
W = (I+A)^-1 diag(beta G) K:

    U   = U0 - W S0^T
    Y   = M U0 + (diag(G) Q - M W) S0^T,   M[t,s] = (G_t / G_s) q_t.k_s  for s <= t
    S_C = G_C S0 + U^T diag(G_C / G) K

Decays enter as logarithms: every ratio G_t / G_s is exp of a difference that is at most
0 where it is used, so nothing overflows however fast a head forgets, and nothing is
divided. The numbers equal the token-by-token kernel's to float32 rounding (not bit for
bit: the sums are taken in another order), which is why it is used only where the fused
kernel is missing.
"""

from __future__ import annotations

import mlx.core as mx

CHUNK = 64  # tokens solved together: the triangular solve is CHUNK x CHUNK per head
MIN_TOKENS = 16  # shorter passes (a few verified drafts) stay on the token-by-token kernel


def chunked_pays() -> bool:
    """Whether prefill should take the chunked form: on a GPU without Metal's fused kernel."""
    return mx.default_device() == mx.gpu and not mx.metal.is_available()


def _unit_lower_inverse(a: mx.array) -> mx.array:
    """(I + a)^-1 for strictly lower-triangular ``a`` [..., C, C], C a power of two.

    Block substitution by doubling: X holds the exact inverse of each diagonal block of
    size b; joining two blocks needs only  X21 = -X22 L21 X11, and with E the lower-left
    blocks of size b inside blocks of size 2b, X - X E X is exactly that for every pair at
    once. log2(C) rounds of two products, as stable as row-by-row substitution (unlike a
    power series in a, whose terms grow like binomials)."""
    c = a.shape[-1]
    idx = mx.arange(c)
    x = mx.broadcast_to(mx.eye(c, dtype=a.dtype), a.shape)
    b = 1
    while b < c:
        # (i, j) with i, j in the same 2b-block but different b-blocks, i below j: L21.
        joins = ((idx[:, None] // (2 * b)) == (idx[None, :] // (2 * b))) & ((idx[:, None] // b) > (idx[None, :] // b))
        x = x - x @ (a * joins) @ x
        b *= 2
    return x


def chunked_delta_rule(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    log_decay: mx.array,
    beta: mx.array,
    state: mx.array,
    chunk: int = CHUNK,
) -> tuple[mx.array, mx.array]:
    """(y [B, T, Hv, Dv], final state [B, Hv, Dv, Dk]) of the gated delta rule, all float32.

    q, k [B, T, Hk, Dk] (q already scaled), v [B, T, Hv, Dv], log_decay and beta [B, T, Hv],
    state [B, Hv, Dv, Dk]; value head h reads key head h // (Hv / Hk), as the kernel does."""
    b, t, hk, dk = k.shape
    hv, dv = v.shape[2:]
    if hv != hk:
        q = mx.repeat(q, hv // hk, axis=2)
        k = mx.repeat(k, hv // hk, axis=2)
    pad = -t % chunk
    if pad:  # padded tokens: no decay (log 0), no write (beta 0), zero keys; cut from y
        q, k, v = (mx.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)]) for x in (q, k, v))
        log_decay, beta = (mx.pad(x, [(0, 0), (0, pad), (0, 0)]) for x in (log_decay, beta))
    n = (t + pad) // chunk

    def chunks(x: mx.array) -> mx.array:  # [B, T, H, D] -> [B, H, n, C, D]
        return x.reshape(b, n, chunk, hv, -1).transpose(0, 3, 1, 2, 4)

    q, k, v = chunks(q), chunks(k), chunks(v)
    log_g = mx.cumsum(chunks(log_decay[..., None])[..., 0], axis=-1)  # log G_t [B, H, n, C]
    beta = chunks(beta[..., None])[..., 0]

    idx = mx.arange(chunk)
    causal = idx[:, None] >= idx[None, :]
    # G_t / G_s where s <= t, zero above the diagonal (masked before exp: no inf * 0).
    ratio = mx.exp(mx.where(causal, log_g[..., :, None] - log_g[..., None, :], -mx.inf))
    strict = (idx[:, None] > idx[None, :]).astype(mx.float32)
    kt = k.swapaxes(-1, -2)
    solve = _unit_lower_inverse(beta[..., :, None] * ratio * (k @ kt) * strict)
    g = mx.exp(log_g)
    u0 = solve @ (beta[..., None] * v)  # [B, H, n, C, Dv]
    w = solve @ ((beta * g)[..., None] * k)  # [B, H, n, C, Dk]
    m = ratio * (q @ kt)
    mu0 = m @ u0
    qg = g[..., None] * q - m @ w
    to_end = mx.exp(log_g[..., -1:] - log_g)[..., None]  # G_C / G_s [B, H, n, C, 1]
    g_end = g[..., -1][..., None, None]  # [B, H, n, 1, 1]

    s = state.astype(mx.float32)
    ys = []
    for c in range(n):
        st = s.swapaxes(-1, -2)  # [B, H, Dk, Dv]
        ys.append(mu0[:, :, c] + qg[:, :, c] @ st)
        u = u0[:, :, c] - w[:, :, c] @ st
        s = g_end[:, :, c] * s + (to_end[:, :, c] * u).swapaxes(-1, -2) @ k[:, :, c]
    y = mx.stack(ys, axis=2).transpose(0, 2, 3, 1, 4).reshape(b, n * chunk, hv, dv)
    return y[:, :t], s
