"""The description of a dense decoder that the shared forward (``engine/dense``) runs.

A family module fills one in from a Hugging Face config: which norms sit where, how rotary
embeddings are computed per layer, each layer's attention window, scale and soft-cap, and the
checkpoint names its weights carry. The forward reads these as data; no family name appears in it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from cleave.runtime.engine.families.experts import MoESpec
from cleave.runtime.engine.shape import ModelShape

# Rotary variants whose frequencies are fixed at load time (transformers computes them once).
# "dynamic" and "longrope" change frequencies with each forward's sequence length, which a
# batch mixing sequences cannot reproduce per sequence.
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
ACTIVATIONS = frozenset({"silu", "gelu_pytorch_tanh", "gelu"})  # MLP gate activations run


class UnsupportedModelError(ValueError):
    """The config describes something the engine cannot run; the message names it."""


@dataclass(frozen=True)
class RopeSpec:
    rope_type: str
    theta: float
    rotary_dim: int  # < head_dim: only the leading dims rotate (partial rotary)
    layer_type: str | None  # key into a per-layer-type ``rope_parameters``, if the config has one


@dataclass(frozen=True)
class LayerSpec:
    rope: RopeSpec
    sliding_window: int | None  # keys with q_pos - k_pos < window are visible


@dataclass(frozen=True)
class WeightNames:
    """Checkpoint names, relative to ``model.layers.{i}.``; tuples are concatenated (fused)."""

    qkv: tuple[str, ...] = ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                            "self_attn.v_proj.weight")
    qkv_bias: tuple[str, ...] = ()
    o_proj: str = "self_attn.o_proj.weight"
    o_bias: str | None = None
    gate_up: tuple[str, ...] = ("mlp.gate_proj.weight", "mlp.up_proj.weight")
    down: str = "mlp.down_proj.weight"
    attn_in_norm: str = "input_layernorm.weight"
    attn_out_norm: str | None = None  # sandwich norm on the attention output (Gemma)
    mlp_in_norm: str = "post_attention_layernorm.weight"
    mlp_out_norm: str | None = None  # sandwich norm on the MLP output (Gemma)
    q_norm: str | None = None  # per-head RMSNorm of q and k before rotary (Qwen3, Gemma 3)
    k_norm: str | None = None


@dataclass(frozen=True)
class DecoderSpec:
    model_type: str
    shape: ModelShape
    layers: tuple[LayerSpec, ...]
    rms_norm_eps: float
    hidden_act: str = "silu"
    norm_offset: float = 0.0  # Gemma's RMSNorm scales by (offset + weight)
    embed_scale: float | None = None  # Gemma multiplies embeddings by sqrt(hidden)
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None  # tanh soft-cap of attention logits (Gemma 2)
    final_softcap: float | None = None  # tanh soft-cap of output logits (Gemma 2, 3)
    names: WeightNames = field(default_factory=WeightNames)
    moe: MoESpec | None = None  # experts replace the MLP on moe.sparse_layers (engine/dense/moe)

    def __post_init__(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise UnsupportedModelError(
                f"activation '{self.hidden_act}' is not supported "
                f"(supported: {', '.join(sorted(ACTIVATIONS))})")

    @property
    def has_windows(self) -> bool:
        return any(layer.sliding_window is not None for layer in self.layers)


def check_dense_text(cfg: Any) -> None:
    """Refuse what no family here runs: quantized weights, vision towers."""
    quant = getattr(cfg, "quantization_config", None)
    if quant:
        method = quant.get("quant_method") if isinstance(quant, dict) else getattr(
            quant, "quant_method", "unknown")
        raise UnsupportedModelError(
            f"quantization '{method}' is not supported: give unquantized (fp16/bf16/fp32) weights")
    if getattr(cfg, "vision_config", None) is not None:
        raise UnsupportedModelError(
            f"'{cfg.model_type}' has a vision tower, which is not supported: "
            "serve a text-only checkpoint of the model")


def check_architectures(cfg: Any) -> None:
    for arch in getattr(cfg, "architectures", None) or []:
        if not arch.endswith("ForCausalLM"):
            raise UnsupportedModelError(
                f"architecture '{arch}' is not a causal language model (needs *ForCausalLM)")


def rope_parameters(cfg: Any, layer_type: str | None) -> dict[str, Any]:
    params = getattr(cfg, "rope_parameters", None) or {}
    if layer_type is not None and layer_type in params:
        params = params[layer_type] or {}
    return dict(params)


def read_rope(cfg: Any, shape: ModelShape, layer_type: str | None = None) -> RopeSpec:
    params = rope_parameters(cfg, layer_type)
    if layer_type is not None and "rope_type" not in params:
        layer_type = None  # one set of parameters for every layer
        params = rope_parameters(cfg, None)
    rope_type = str(params.get("rope_type", "default"))
    if rope_type not in STATIC_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope scaling '{rope_type}' is not supported "
            f"(supported: {', '.join(sorted(STATIC_ROPE_TYPES))})")
    factor = params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", 1.0))
    return RopeSpec(rope_type=rope_type,
                    theta=float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))),
                    rotary_dim=int(shape.head_dim * float(factor or 1.0)),
                    layer_type=layer_type)


def typed_layers(cfg: Any, shape: ModelShape) -> tuple[LayerSpec, ...]:
    """Layers from ``layer_types`` (``sliding_attention`` / ``full_attention``), as Qwen2/3 and
    Gemma 2/3 configs list them; each type may carry its own rotary parameters."""
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * shape.num_layers)
    window = getattr(cfg, "sliding_window", None)
    layers = []
    for t in types:
        if t not in ("sliding_attention", "full_attention"):
            raise UnsupportedModelError(f"layer type '{t}' is not supported")
        layers.append(LayerSpec(rope=read_rope(cfg, shape, t),
                                sliding_window=window if t == "sliding_attention" else None))
    return tuple(layers)


def uniform_layers(cfg: Any, shape: ModelShape, window: int | None) -> tuple[LayerSpec, ...]:
    rope = read_rope(cfg, shape)
    return tuple(LayerSpec(rope=rope, sliding_window=window) for _ in range(shape.num_layers))
