"""A :class:`~cleave.runtime.engine.paged_model.PagedModel` for any transformers causal LM:
its own forward (positions, rotary, norms, MLPs, head all transformers'), attention over the
paged pool through :mod:`.attention`.

The step's flat token batch runs as one sequence of ``T`` tokens with each token's own
``position_ids``; attention alone separates the sequences (it reads each one's KV through its
block table), so nothing else in the model may mix tokens. Before serving, one probe forward
records every attention call, which gives the KV layout and refuses what the pool cannot
honour (see :func:`check_calls`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from cleave.runtime.engine.families.generic import GenericSpec
from cleave.runtime.engine.families.spec import UnsupportedModelError
from cleave.runtime.engine.generic import attention
from cleave.runtime.engine.generic.attention import STEP, CallRecord, StepContext
from cleave.runtime.engine.kv_layout import KVLayout
from cleave.runtime.engine.paged_model import AttentionBatch


class GenericCausalLM:
    def __init__(self, spec: GenericSpec, hf_config: Any, state: dict[str, torch.Tensor],
                 dtype: torch.dtype, device: torch.device) -> None:
        self.spec = spec
        self._dtype = dtype
        self._device = device
        self.model = load_causal_lm(spec, hf_config, state, dtype).to(device).eval()
        forward_args = inspect.signature(self.model.forward).parameters
        self._keeps_logits = "logits_to_keep" in forward_args  # else: slice after the head
        self._tiled = device.type == "cpu" and dtype == torch.bfloat16
        self._layout = check_calls(self._probe(), spec, hf_config)

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def kv_layout(self) -> KVLayout:
        return self._layout

    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def _probe(self) -> list[CallRecord]:
        context = StepContext(batch=None, k_pool=[], v_pool=[], tiled_prefill=self._tiled)
        ids = torch.zeros(1, 2, dtype=torch.long, device=self._device)
        self._run(ids, torch.arange(2, device=self._device)[None], context, None)
        return context.calls

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch,
                k_pool: list[torch.Tensor], v_pool: list[torch.Tensor]) -> torch.Tensor:
        context = StepContext(batch=batch, k_pool=k_pool, v_pool=v_pool,
                              tiled_prefill=self._tiled)
        logits = self._run(input_ids[None], batch.positions[None], context,
                           batch.logits_indices)
        return logits.float()

    @torch.inference_mode()
    def _run(self, ids: torch.Tensor, positions: torch.Tensor, context: StepContext,
             keep: torch.Tensor | None) -> torch.Tensor:
        kwargs: dict[str, Any] = {"input_ids": ids, "position_ids": positions,
                                  "use_cache": False}
        if self._keeps_logits and keep is not None:
            kwargs["logits_to_keep"] = keep
        token = STEP.set(context)
        try:
            logits: torch.Tensor = self.model(**kwargs).logits[0]
        finally:
            STEP.reset(token)
        if keep is not None and not self._keeps_logits:
            logits = logits[keep]
        return logits


def load_causal_lm(spec: GenericSpec, hf_config: Any, state: dict[str, torch.Tensor],
                   dtype: torch.dtype) -> Any:
    """transformers' class for the spec, its weights converted by transformers' own loading
    (renamed or fused checkpoint keys included), with the paged attention plugged in."""
    import transformers

    cls = getattr(transformers, spec.causal_lm_class, None)
    if cls is None:
        raise UnsupportedModelError(f"transformers has no class '{spec.causal_lm_class}'")
    if not cls.is_backend_compatible():
        raise UnsupportedModelError(
            f"'{spec.model_type}' ({spec.causal_lm_class}) does not run attention through "
            "transformers' AttentionInterface (attention code of its own, or none: a recurrent "
            "or state-space model), so its KV cannot live in the paged pool")
    attention.register()
    model, info = cls.from_pretrained(None, config=hf_config, state_dict=state, dtype=dtype,
                                      attn_implementation=attention.NAME,
                                      output_loading_info=True)
    # transformers fills what the checkpoint lacks with random weights and only warns; a
    # server must not answer from those.
    bad = sorted(info["missing_keys"]) + sorted(str(k) for k in info["mismatched_keys"])
    if bad:
        raise UnsupportedModelError(
            f"the checkpoint does not fit {spec.causal_lm_class}: {len(bad)} weights missing or "
            f"of another shape (first: {', '.join(bad[:3])})")
    return model


def check_calls(calls: list[CallRecord], spec: GenericSpec, hf_config: Any) -> KVLayout:
    """The KV layout one forward's attention calls reveal; refuses what the pool cannot hold."""
    name, layers = spec.model_type, spec.shape.num_layers
    if len(calls) != layers:
        raise UnsupportedModelError(
            f"'{name}' ran attention {len(calls)} times for {layers} layers: layers without "
            "attention (recurrent or state-space) keep state the paged pool does not hold")
    for what in {c.refused for c in calls if c.refused is not None}:
        raise UnsupportedModelError(f"'{name}' uses {what}, which the generic path cannot honour")
    if any(c.cross for c in calls):
        raise UnsupportedModelError(f"'{name}' attends over keys other than its own tokens "
                                    "(cross-attention or shared KV), which is not supported")
    if len({(c.num_kv_heads, c.head_dim) for c in calls}) != 1:
        raise UnsupportedModelError(
            f"'{name}' layers differ in KV heads or head size; the paged pool needs one shape")
    windowed = any(c.window is not None for c in calls)
    if declares_window(hf_config) and not windowed:
        raise UnsupportedModelError(
            f"'{name}' declares a sliding window that its attention applies only through the "
            "mask, which the generic path does not build")
    return KVLayout(layers, calls[0].num_kv_heads, calls[0].head_dim)


def declares_window(cfg: Any) -> bool:
    if "sliding_attention" in (getattr(cfg, "layer_types", None) or []):
        return True
    window = getattr(cfg, "sliding_window", None)
    return bool(window) and getattr(cfg, "use_sliding_window", True) is not False
