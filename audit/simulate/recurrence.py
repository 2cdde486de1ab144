"""Mamba1 and Mamba2 recurrences with seeded random weights, for realistic recurrent-state values.

Not a language model: a narrow residual stream (``STREAM_WIDTH`` wide instead of ``hidden_size``)
carries each layer's output into the next, which keeps the projections cheap, while the conv and
selective-scan states are full size and computed the way the Mamba mixers compute them
(HF ``MambaMixer`` / ``Mamba2Mixer``, slow path). Arithmetic is float32 numpy; the cache dtypes are
applied when the states are encoded (``encoding.py``).

States are computed for the whole model (TP 1) and then cut into per-rank shards exactly as
vLLM's tensor-parallel weight loaders split the mixers, so TP 2 values are slices of TP 1 states.

Cost is the scan itself, O(tokens x layers x state size): the tiny test models take milliseconds,
mamba-130m about 3 s per 1,000 tokens on one core.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from audit.errors import AuditError

STREAM_WIDTH = 64  # residual stream width: what the layers pass on, not what they store
VOCABULARY = 4096  # token ids are drawn below this, so the embedding table stays small
SCAN_CHUNK = 128  # tokens whose discretised A and B*x are materialised at once

LayerStates = dict[str, np.ndarray]  # "conv": (d_conv-1, conv_dim), "ssm": (d_inner, N) or (H, P, N)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _softplus(x: np.ndarray) -> np.ndarray:
    # log1p(exp(x)), linear above 20 where exp would lose nothing but could overflow
    return np.log1p(np.exp(np.minimum(x, 20))) + np.maximum(x - 20, 0)


def _rms_norm(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(1e-6))


def _normal(rng: np.random.Generator, shape: tuple[int, ...], std: float) -> np.ndarray:
    return (rng.standard_normal(shape, dtype=np.float32) * np.float32(std))


def _dt_bias(rng: np.random.Generator, size: int) -> np.ndarray:
    """Mamba's initialisation: softplus(bias) is log-uniform in [1e-3, 1e-1]."""
    dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), size)).astype(np.float32)
    return dt + np.log(-np.expm1(-dt))


def _causal_conv(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Depthwise causal conv over time, and the zero-padded input it read.

    vLLM's conv state after t tokens is the last ``d_conv-1`` inputs, oldest first ("SD"):
    ``padded[t : t + d_conv - 1]`` (zeros before the first token).
    """
    width = weight.shape[0]
    padded = np.concatenate([np.zeros((width - 1, x.shape[1]), np.float32), x])
    out = bias + sum(weight[k] * padded[k:k + len(x)] for k in range(width))
    return out, padded


def _scan(state: np.ndarray, decay: np.ndarray, drive: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """h_t = decay_t * h_{t-1} + drive_t for each token of a chunk; every h_t, and the last."""
    states = np.empty_like(drive)
    for t in range(len(drive)):
        state = decay[t] * state + drive[t]
        states[t] = state
    return states, state


@dataclass(frozen=True)
class MambaDims:
    """The sizes a Mamba mixer's states depend on, read from an HF config as vLLM reads them."""

    kind: str  # "mamba1" | "mamba2"
    layers: int
    d_inner: int
    d_state: int
    d_conv: int
    dt_rank: int = 0  # mamba1
    n_groups: int = 1  # mamba2
    n_heads: int = 0  # mamba2
    head_dim: int = 0  # mamba2

    @property
    def conv_dim(self) -> int:
        return self.d_inner if self.kind == "mamba1" else self.d_inner + 2 * self.n_groups * self.d_state

    @classmethod
    def from_hf_config(cls, config: dict) -> MambaDims:
        model_type = config.get("model_type")
        try:
            if model_type in ("mamba", "falcon_mamba"):
                d_inner = config.get("intermediate_size") or config["expand"] * config["hidden_size"]
                dt_rank = config.get("time_step_rank")
                if not isinstance(dt_rank, int):  # "auto", as in transformers' MambaConfig
                    dt_rank = math.ceil(config["hidden_size"] / 16)
                return cls("mamba1", config["num_hidden_layers"], d_inner, config["state_size"],
                           config["conv_kernel"], dt_rank=dt_rank)
            if model_type == "mamba2":
                d_inner = config["expand"] * config["hidden_size"]
                dims = cls("mamba2", config["num_hidden_layers"], d_inner, config["state_size"],
                           config["conv_kernel"], n_groups=config["n_groups"],
                           n_heads=config["num_heads"], head_dim=config["head_dim"])
                if dims.n_heads * dims.head_dim != d_inner or dims.n_heads % dims.n_groups:
                    raise AuditError(f"mamba2 config: num_heads x head_dim must equal expand x "
                                     f"hidden_size ({d_inner}) and n_groups divide num_heads")
                return dims
        except KeyError as error:
            raise AuditError(f"config.json lacks {error.args[0]!r}") from None
        raise AuditError(f"the simulator models pure Mamba1/Mamba2 models (model_type mamba, "
                         f"falcon_mamba, mamba2), not {model_type!r}")


class _Mamba1Layer:
    """One Mamba1 mixer: x,z = in_proj(u); x = silu(conv(x)); selective scan over (d_inner, N)."""

    def __init__(self, dims: MambaDims, rng: np.random.Generator):
        d, n, r = dims.d_inner, dims.d_state, dims.dt_rank
        self.dims = dims
        self.in_proj = _normal(rng, (STREAM_WIDTH, 2 * d), STREAM_WIDTH ** -0.5)
        self.conv_weight = _normal(rng, (dims.d_conv, d), dims.d_conv ** -0.5)
        self.conv_bias = _normal(rng, (d,), 0.1)
        self.x_proj = _normal(rng, (d, r + 2 * n), d ** -0.5)
        self.dt_proj = _normal(rng, (r, d), r ** -0.5)
        self.dt_bias = _dt_bias(rng, d)
        self.a = -np.tile(np.arange(1, n + 1, dtype=np.float32), (d, 1))  # -exp(A_log), S4D-real init
        self.out_proj = _normal(rng, (d, STREAM_WIDTH), d ** -0.5)

    def forward(self, u: np.ndarray, capture: list[int]) -> tuple[np.ndarray, dict[int, LayerStates]]:
        d, n, r = self.dims.d_inner, self.dims.d_state, self.dims.dt_rank
        x, z = np.split(u @ self.in_proj, [d], axis=1)
        conv_out, padded = _causal_conv(x, self.conv_weight, self.conv_bias)
        x = _silu(conv_out)
        dt_low, b, c = np.split(x @ self.x_proj, [r, r + n], axis=1)
        dt = _softplus(dt_low @ self.dt_proj + self.dt_bias)
        y = np.empty_like(x)
        h = np.zeros((d, n), np.float32)
        captured: dict[int, LayerStates] = {}
        for start in range(0, len(x), SCAN_CHUNK):
            part = slice(start, start + SCAN_CHUNK)
            decay = np.exp(dt[part, :, None] * self.a)
            drive = (dt[part] * x[part])[:, :, None] * b[part, None, :]
            states, h = _scan(h, decay, drive)
            y[part] = np.einsum("tdn,tn->td", states, c[part]) + x[part]  # D = 1
            for boundary in capture:
                if start < boundary <= start + len(states):
                    captured[boundary] = {"conv": padded[boundary:boundary + self.dims.d_conv - 1].copy(),
                                          "ssm": states[boundary - start - 1].copy()}
        return (y * _silu(z)) @ self.out_proj, captured


class _Mamba2Layer:
    """One Mamba2 mixer: z, xBC, dt = in_proj(u); xBC = silu(conv(xBC)); per-head scalar decay,
    state (H, P, N); head h reads group h // (H / n_groups) of B and C."""

    def __init__(self, dims: MambaDims, rng: np.random.Generator):
        self.dims = dims
        self.in_proj = _normal(rng, (STREAM_WIDTH, dims.d_inner + dims.conv_dim + dims.n_heads),
                               STREAM_WIDTH ** -0.5)
        self.conv_weight = _normal(rng, (dims.d_conv, dims.conv_dim), dims.d_conv ** -0.5)
        self.conv_bias = _normal(rng, (dims.conv_dim,), 0.1)
        self.dt_bias = _dt_bias(rng, dims.n_heads)
        self.a = -rng.uniform(1, 16, dims.n_heads).astype(np.float32)  # -exp(A_log)
        self.out_proj = _normal(rng, (dims.d_inner, STREAM_WIDTH), dims.d_inner ** -0.5)
        self.head_group = np.arange(dims.n_heads) // (dims.n_heads // dims.n_groups)

    def forward(self, u: np.ndarray, capture: list[int]) -> tuple[np.ndarray, dict[int, LayerStates]]:
        dims = self.dims
        tokens = len(u)
        z, xbc, dt = np.split(u @ self.in_proj, [dims.d_inner, dims.d_inner + dims.conv_dim], axis=1)
        conv_out, padded = _causal_conv(xbc, self.conv_weight, self.conv_bias)
        x, b, c = np.split(_silu(conv_out), [dims.d_inner, dims.d_inner + dims.n_groups * dims.d_state],
                           axis=1)
        x = x.reshape(tokens, dims.n_heads, dims.head_dim)
        b = b.reshape(tokens, dims.n_groups, dims.d_state)[:, self.head_group]  # (T, H, N)
        c = c.reshape(tokens, dims.n_groups, dims.d_state)[:, self.head_group]
        dt = _softplus(dt + self.dt_bias)  # (T, H)
        y = np.empty_like(x)
        h = np.zeros((dims.n_heads, dims.head_dim, dims.d_state), np.float32)
        captured: dict[int, LayerStates] = {}
        for start in range(0, tokens, SCAN_CHUNK):
            part = slice(start, start + SCAN_CHUNK)
            decay = np.exp(dt[part] * self.a)[:, :, None, None]
            drive = (dt[part, :, None] * x[part])[..., None] * b[part, :, None, :]
            states, h = _scan(h, decay, drive)
            y[part] = np.einsum("thpn,thn->thp", states, c[part]) + x[part]  # D = 1
            for boundary in capture:
                if start < boundary <= start + len(states):
                    captured[boundary] = {"conv": padded[boundary:boundary + dims.d_conv - 1].copy(),
                                          "ssm": states[boundary - start - 1].copy()}
        gated = _rms_norm(y.reshape(tokens, dims.d_inner) * _silu(z))
        return gated @ self.out_proj, captured


class MambaModel:
    """A stack of seeded Mamba1 or Mamba2 mixers over token ids; the same seed, the same model."""

    def __init__(self, config: dict, seed: int):
        self.dims = MambaDims.from_hf_config(config)
        rng = np.random.default_rng([seed, 0x5EED])  # the weights' own stream
        self.embedding = _normal(rng, (VOCABULARY, STREAM_WIDTH), 1.0)
        layer = _Mamba1Layer if self.dims.kind == "mamba1" else _Mamba2Layer
        self.layers = [layer(self.dims, rng) for _ in range(self.dims.layers)]

    def states_at(self, tokens: np.ndarray, boundaries: list[int]) -> dict[int, list[LayerStates]]:
        """Every layer's full (TP 1) states after the first ``b`` tokens, for each boundary b."""
        hidden = self.embedding[tokens]
        per_layer = []
        for layer in self.layers:
            out, captured = layer.forward(_rms_norm(hidden), boundaries)
            hidden = hidden + out
            per_layer.append(captured)
        return {boundary: [captured[boundary] for captured in per_layer] for boundary in boundaries}

    def shard(self, layers: list[LayerStates], tp_rank: int, tp_size: int) -> list[LayerStates]:
        """One TP rank's slice of every layer's states, as vLLM splits the mixer's weights."""
        conv_columns, ssm_rows = self._shard_indices(tp_rank, tp_size)
        return [{"conv": states["conv"][:, conv_columns], "ssm": states["ssm"][ssm_rows]}
                for states in layers]

    def _shard_indices(self, tp_rank: int, tp_size: int) -> tuple[np.ndarray, np.ndarray]:
        dims = self.dims
        if dims.d_inner % tp_size:
            raise AuditError(f"d_inner {dims.d_inner} is not divisible by tp_size {tp_size}")
        inner = dims.d_inner // tp_size
        x_columns = np.arange(tp_rank * inner, (tp_rank + 1) * inner)
        if dims.kind == "mamba1":  # conv channels and ssm rows are both d_inner, split evenly
            return x_columns, x_columns
        if dims.n_heads % tp_size:
            raise AuditError(f"num_heads {dims.n_heads} is not divisible by tp_size {tp_size}")
        heads = dims.n_heads // tp_size
        head_rows = np.arange(tp_rank * heads, (tp_rank + 1) * heads)
        # vLLM (mamba_mixer2): each rank keeps its heads' groups; with n_groups == 1 and TP > 1 the
        # single group is replicated on every rank. The rank's conv channels are x | B | C.
        if dims.n_groups % tp_size == 0:
            per_rank = dims.n_groups // tp_size
            groups = np.arange(tp_rank * per_rank, (tp_rank + 1) * per_rank)
        elif dims.n_groups == 1:
            groups = np.zeros(1, dtype=np.int64)
        else:
            raise AuditError(f"n_groups {dims.n_groups} must be 1 or divisible by tp_size {tp_size} "
                             f"(vLLM's rule)")
        group_columns = (groups[:, None] * dims.d_state + np.arange(dims.d_state)).ravel()
        b_columns = dims.d_inner + group_columns
        c_columns = dims.d_inner + dims.n_groups * dims.d_state + group_columns
        return np.concatenate([x_columns, b_columns, c_columns]), head_rows
