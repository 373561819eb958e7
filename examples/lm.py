"""A small decoder-only transformer LM in pure JAX: the model ``examples/manifest.yaml`` warms.

It is the shape of a real serving loop, kept small enough to compile in about a
second per bucket on a CPU:

    params = init_params(jax.random.key(0))
    logits, cache = prefill(params, prompt)              # prompt: int32 [batch, seq]
    token = jnp.argmax(logits[:, -1], -1)[:, None].astype(jnp.int32)
    for pos in range(seq, seq + n):
        token, cache = decode_step(params, cache, token, jnp.int32(pos), key)

The functions are plain (not jitted); the service and ``cachectl warm`` both wrap
them in ``jax.jit`` with the same options, so the programs — and so the cache keys —
are identical. To get a cache hit the service must call them with exactly the
abstract arguments the manifest lists: ``pos`` as an int32 *array* (a Python int
would be weakly typed, a different program), ``key`` as a raw uint32[2] key from
``jax.random.PRNGKey``, and the kv cache in :data:`KV_DTYPE`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

Params = dict[str, Any]


@dataclass(frozen=True)
class Config:
    """Model size; the manifest's kv-cache shape repeats these numbers."""

    vocab: int = 512
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    head_dim: int = 32
    d_ff: int = 512
    max_seq: int = 256
    rope_base: float = 10_000.0


CONFIG = Config()
PARAM_DTYPE = jnp.float32
KV_DTYPE = jnp.bfloat16
# Softmax temperature for sampling="sample"; a constant so it is part of the program.
TEMPERATURE = 0.8
SAMPLING_MODES = ("greedy", "sample")


def kv_cache_shape(batch: int, cfg: Config = CONFIG) -> tuple[int, ...]:
    """[layers, 2 (k, v), batch, max_seq, heads, head_dim]: fixed size, so decode never recompiles."""
    return (cfg.n_layers, 2, batch, cfg.max_seq, cfg.n_heads, cfg.head_dim)


def init_kv_cache(batch: int, cfg: Config = CONFIG) -> jax.Array:
    """An empty cache; prefill fills it, decode_step appends one position per call."""
    return jnp.zeros(kv_cache_shape(batch, cfg), KV_DTYPE)


def init_params(key: jax.Array, cfg: Config = CONFIG) -> Params:
    """Random weights with the structure of :func:`param_specs` (a real service loads a checkpoint)."""
    d, h, hd, ff = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.d_ff
    keys = iter(jax.random.split(key, 1 + 6 * cfg.n_layers))

    def dense(shape: tuple[int, ...], fan_in: int) -> jax.Array:
        return (jax.random.normal(next(keys), shape) / math.sqrt(fan_in)).astype(PARAM_DTYPE)

    layers = []
    for _ in range(cfg.n_layers):
        layers.append(
            {
                "attn_norm": jnp.ones((d,), PARAM_DTYPE),
                "wq": dense((d, h, hd), d),
                "wk": dense((d, h, hd), d),
                "wv": dense((d, h, hd), d),
                "wo": dense((h, hd, d), h * hd),
                "mlp_norm": jnp.ones((d,), PARAM_DTYPE),
                "w_in": dense((d, ff), d),
                "w_out": dense((ff, d), ff),
            }
        )
    return {
        "embed": dense((cfg.vocab, d), d),  # tied: also the output projection
        "layers": layers,
        "final_norm": jnp.ones((d,), PARAM_DTYPE),
    }


def host_params(seed: int = 0) -> Params:
    """Weights made on the host with NumPy, as a service restores a checkpoint: unlike
    :func:`init_params`, making them compiles no program (JAX's random programs would be
    compiled, looked up and missed by every service start)."""
    import numpy as np

    rng = np.random.default_rng(seed)

    def leaf(spec: Any) -> Any:
        if spec.ndim == 1:  # the norms' scales
            return np.ones(spec.shape, spec.dtype)
        fan_in = math.prod(spec.shape[:-1])
        return (rng.standard_normal(spec.shape, np.float32) / math.sqrt(fan_in)).astype(spec.dtype)

    return jax.tree_util.tree_map(leaf, param_specs())


def param_specs() -> Params:
    """The params pytree as ``jax.ShapeDtypeStruct``s: what warm needs, without allocating weights.

    The key is made inside the trace: made eagerly it would compile (and cache) a program.
    """
    return jax.eval_shape(lambda: init_params(jax.random.key(0)))


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def _rope(x: jax.Array, positions: jax.Array, cfg: Config) -> jax.Array:
    """Rotary position embedding over the last axis; x: [batch, seq, heads, head_dim]."""
    half = cfg.head_dim // 2
    freqs = cfg.rope_base ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angles = positions.astype(jnp.float32)[:, None] * freqs[None, :]  # [seq, half]
    sin, cos = jnp.sin(angles)[None, :, None, :], jnp.cos(angles)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """q: [b, s, h, d], k/v: [b, t, h, d], mask: broadcastable to [b, h, s, t] (True = attend)."""
    scores = jnp.einsum("bshd,bthd->bhst", q, k) / math.sqrt(q.shape[-1])
    scores = jnp.where(mask, scores, jnp.finfo(scores.dtype).min)
    return jnp.einsum("bhst,bthd->bshd", jax.nn.softmax(scores, axis=-1), v)


def _mlp(x: jax.Array, layer: Params) -> jax.Array:
    return jax.nn.gelu(x @ layer["w_in"]) @ layer["w_out"]


def _logits(params: Params, x: jax.Array) -> jax.Array:
    return _rms_norm(x, params["final_norm"]) @ params["embed"].T


def prefill(params: Params, tokens: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Run the prompt; return (float32 logits of every position [batch, seq, vocab], kv cache).

    tokens: int32 [batch, seq]. Attention is causal, so a prompt padded on the right
    to the bucket's length gives the same logits and kv cache on its own positions:
    read the logits at position ``length - 1`` and start decoding at ``length``.
    """
    cfg = CONFIG
    batch, seq = tokens.shape
    positions = jnp.arange(seq, dtype=jnp.int32)
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))[None, None]
    cache = init_kv_cache(batch, cfg)
    x = params["embed"][tokens]
    for i, layer in enumerate(params["layers"]):
        h = _rms_norm(x, layer["attn_norm"])
        q = _rope(jnp.einsum("bsd,dhk->bshk", h, layer["wq"]), positions, cfg)
        k = _rope(jnp.einsum("bsd,dhk->bshk", h, layer["wk"]), positions, cfg)
        v = jnp.einsum("bsd,dhk->bshk", h, layer["wv"])
        kv = jnp.stack([k, v]).astype(KV_DTYPE)  # [2, b, s, h, d]
        cache = jax.lax.dynamic_update_slice(cache, kv[None], (i, 0, 0, 0, 0, 0))
        # Attend to the cached (rounded) k/v, exactly as decode_step will later.
        k, v = kv.astype(jnp.float32)
        attn = _attention(q, k, v, causal)
        x = x + jnp.einsum("bshk,hkd->bsd", attn, layer["wo"])
        x = x + _mlp(_rms_norm(x, layer["mlp_norm"]), layer)
    return _logits(params, x), cache


def decode_logits(
    params: Params, kv_cache: jax.Array, token: jax.Array, pos: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """One position: write its k/v at ``pos`` and return (float32 logits [batch, vocab], cache).

    token: int32 [batch, 1]; pos: int32 scalar, the position of ``token`` (= tokens so far).
    """
    cfg = CONFIG
    pos = jnp.asarray(pos, jnp.int32)
    positions = pos[None]
    visible = (jnp.arange(cfg.max_seq) <= pos)[None, None, None, :]  # [1, 1, 1, max_seq]
    zero = jnp.zeros((), jnp.int32)
    x = params["embed"][token]  # [b, 1, d]
    for i, layer in enumerate(params["layers"]):
        h = _rms_norm(x, layer["attn_norm"])
        q = _rope(jnp.einsum("bsd,dhk->bshk", h, layer["wq"]), positions, cfg)
        k = _rope(jnp.einsum("bsd,dhk->bshk", h, layer["wk"]), positions, cfg)
        v = jnp.einsum("bsd,dhk->bshk", h, layer["wv"])
        kv = jnp.stack([k, v]).astype(KV_DTYPE)[None]  # [1, 2, b, 1, h, d]
        start = (jnp.int32(i), zero, zero, pos, zero, zero)
        kv_cache = jax.lax.dynamic_update_slice(kv_cache, kv, start)
        keys, values = kv_cache[i].astype(jnp.float32)  # [b, max_seq, h, d] each
        attn = _attention(q, keys, values, visible)
        x = x + jnp.einsum("bshk,hkd->bsd", attn, layer["wo"])
        x = x + _mlp(_rms_norm(x, layer["mlp_norm"]), layer)
    return _logits(params, x[:, 0]), kv_cache


def decode_step(
    params: Params,
    kv_cache: jax.Array,
    token: jax.Array,
    pos: jax.Array,
    key: jax.Array,
    sampling: str = "greedy",
) -> tuple[jax.Array, jax.Array]:
    """Generate one token: returns (next token int32 [batch, 1], updated kv cache).

    ``sampling`` is static (one program per mode): "greedy" takes the argmax and
    ignores ``key``; "sample" draws from softmax(logits / TEMPERATURE) with ``key``
    (a uint32[2] key from ``jax.random.PRNGKey``; fold in the step for fresh noise).
    Donate ``kv_cache`` (``donate_argnums=1``) so the update happens in place.
    """
    logits, kv_cache = decode_logits(params, kv_cache, token, pos)
    if sampling == "greedy":
        nxt = jnp.argmax(logits, axis=-1)
    elif sampling == "sample":
        nxt = jax.random.categorical(key, logits / TEMPERATURE, axis=-1)
    else:
        raise ValueError(f"sampling must be one of {SAMPLING_MODES}, got {sampling!r}")
    return nxt.astype(jnp.int32)[:, None], kv_cache
