"""``bench --roofline``: how close decode comes to the memory-bandwidth limit.

A decode step of a small batch is bound by reading memory, not by arithmetic: every weight
the step uses is read once, and so is the KV cache up to the current length. The ceiling
for one stream is therefore ``bandwidth / bytes read per token``, and the share of it a loop
reaches says how much of the machine's limit is left on the table.

What counts as read per decoded token:

- every parameter of the model, except
  - embedding tables, which a step reads one row of, unless the table is tied to the head
    (no separate ``lm_head``), where it is read whole once, as the head;
  - stacked routed experts (a leading dimension equal to the expert count), of which a token
    reads ``top_k / experts``;
  - a built-in MTP layer (``mtp.*``), which plain decoding never runs;
- the KV cache as it stands after the prompt (measured from the cache's own arrays, so
  windows, latent caches, recurrent state and quantized KV count what they hold).

The bandwidth is measured in the same run: a copy of a buffer far larger than the caches,
timed over several evaluations, counting the bytes read and written. The ceiling uses that
figure rather than a datasheet's, so a share is a share of what this machine can do now.
For a verify pass or a batch of ``rows``, the step reads the weights once for all rows and
the KV once per row: ``step_bytes(rows)`` gives that, per step.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

_EXPERT_COUNT_KEYS = ("n_routed_experts", "num_local_experts", "num_experts")
_TOP_K_KEYS = ("num_experts_per_tok", "top_k_experts", "moe_top_k")


@dataclass(frozen=True)
class Roofline:
    weight_bytes_per_token: int
    kv_bytes_per_token: int
    bandwidth_bytes_per_s: float
    ceiling_tps: float
    share: float | None = None  # of the engine's measured decode rate; set by ``with_rate``
    share_peer: float | None = None

    @property
    def bytes_per_token(self) -> int:
        return self.weight_bytes_per_token + self.kv_bytes_per_token

    def with_rates(self, tps: float, peer_tps: float | None = None) -> Roofline:
        share_peer = None if peer_tps is None else peer_tps / self.ceiling_tps
        return Roofline(**{**asdict(self), "share": tps / self.ceiling_tps, "share_peer": share_peer})

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "bytes_per_token": self.bytes_per_token}

    def row(self) -> str:
        text = (
            f"roofline {self.bytes_per_token / 1e9:.3f} GB read per token "
            f"(weights {self.weight_bytes_per_token / 1e9:.3f}, KV {self.kv_bytes_per_token / 1e9:.3f})   "
            f"bandwidth {self.bandwidth_bytes_per_s / 1e9:.1f} GB/s   ceiling {self.ceiling_tps:.1f} tok/s"
        )
        if self.share is not None:
            text += f"   engine at {self.share:.1%}"
        if self.share_peer is not None:
            text += f", mlx-lm at {self.share_peer:.1%}"
        return text


def _first(config: dict[str, Any], keys: tuple[str, ...]) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def weight_bytes_per_token(model: Any, config: dict[str, Any]) -> int:
    """The bytes of weights one decoded token reads (the module docstring says which)."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    experts = _first(config, _EXPERT_COUNT_KEYS)
    top_k = _first(config, _TOP_K_KEYS) or 1
    tied = not any(name.endswith("lm_head") for name, _ in model.named_modules())
    embeddings = {name for name, m in model.named_modules() if isinstance(m, (nn.Embedding, nn.QuantizedEmbedding))}
    total = 0.0
    for path, array in tree_flatten(model.parameters()):
        if path.startswith("mtp.") or ".mtp." in path:
            continue
        owner = path.rsplit(".", 1)[0]
        if owner in embeddings:
            if tied and owner.endswith("embed_tokens"):
                continue  # the head: counted whole below, once, with its scales and biases
            rows = array.shape[0] if array.ndim else 1
            total += array.nbytes / max(rows, 1)
            continue
        if experts and array.ndim >= 3 and array.shape[0] == experts:
            total += array.nbytes * min(top_k, experts) / experts
            continue
        total += array.nbytes
    if tied:
        head = next((n for n in sorted(embeddings) if n.endswith("embed_tokens")), None)
        if head is not None:
            module = dict(model.named_modules())[head]
            total += sum(a.nbytes for _, a in tree_flatten(module.parameters()))
    return int(total)


def kv_bytes_after(model: Any, prompt: Any) -> int:
    """The KV cache's bytes after prefilling ``prompt`` and decoding one token."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from engine.decode.loop import generate_step
    from engine.models.kv_cache import make_prompt_cache

    cache = make_prompt_cache(model)
    for _ in generate_step(prompt, model, cache, max_tokens=1, prefill_chunk=2048):
        pass
    arrays = [a for c in cache for _, a in tree_flatten(c.state) if isinstance(a, mx.array)]
    mx.eval(arrays)
    return int(sum(a.nbytes for a in arrays))


def copy_bandwidth(megabytes: int | None = None, repeat: int = 10) -> float:
    """Bytes read plus bytes written per second copying a ``megabytes`` buffer, at its best
    (by default 1 GiB on a GPU and 256 MiB on a CPU: either far past the caches)."""
    import mlx.core as mx

    if megabytes is None:
        megabytes = 1024 if mx.default_device() == mx.gpu else 256
    n = megabytes * 2**20 // 4
    src = mx.random.uniform(shape=(n,))
    mx.eval(src)
    best = float("inf")
    for i in range(repeat + 1):
        start = time.perf_counter()
        dst = src * 1.0 if i % 2 else src + 0.0  # an elementwise pass: one read, one write
        mx.eval(dst)
        elapsed = time.perf_counter() - start
        if i:  # the first pass builds the kernel
            best = min(best, elapsed)
        del dst
    return 2 * src.nbytes / best


def measure(model: Any, config: dict[str, Any], prompt: Any, copy_megabytes: int | None = None) -> Roofline:
    weights = weight_bytes_per_token(model, config)
    kv = kv_bytes_after(model, prompt)
    bandwidth = copy_bandwidth(copy_megabytes)
    return Roofline(
        weight_bytes_per_token=weights,
        kv_bytes_per_token=kv,
        bandwidth_bytes_per_s=bandwidth,
        ceiling_tps=bandwidth / max(weights + kv, 1),
    )


def step_bytes(roofline: Roofline, rows: int) -> int:
    """Bytes one step of ``rows`` rows (a batch, or a verify pass) reads: weights once, KV per row.
    (A verify pass's rows share one KV; count it as ``rows=1`` for the KV then.)"""
    return roofline.weight_bytes_per_token + rows * roofline.kv_bytes_per_token
