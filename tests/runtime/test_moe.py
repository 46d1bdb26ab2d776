"""The mixture-of-experts MLP part against transformers' own sparse blocks, in the dtype where
their roundings differ (bf16), and the property that makes it fast: idle experts never run."""
# transformers 5.24 runs a loaded model's experts with its grouped forward ("grouped_mm"): one
# rounding of the k choices' fp32 sum for Mixtral, where its loop ("eager") rounds each choice.

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from cleave.runtime.engine.dense.moe import ExpertsMLP, load_experts
from cleave.runtime.engine.families.experts import sparse_layers
from cleave.runtime.engine.families.moe import read_mixtral, read_qwen3_moe

SIZES = {"hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "num_hidden_layers": 1, "num_experts_per_tok": 2, "vocab_size": 32}


def _blocks(norm_topk_prob: bool) -> list[tuple[str, torch.nn.Module, ExpertsMLP]]:
    """(name, transformers block, our part from the block's own weights) per family."""
    mixtral_cfg = MixtralConfig(**SIZES, intermediate_size=32, num_local_experts=6)
    qwen_cfg = Qwen3MoeConfig(**SIZES, moe_intermediate_size=32, num_experts=6,
                              norm_topk_prob=norm_topk_prob)
    out = []
    for name, cfg, block_cls, reader in (
            ("mixtral", mixtral_cfg, MixtralSparseMoeBlock, read_mixtral),
            ("qwen3_moe", qwen_cfg, Qwen3MoeSparseMoeBlock, read_qwen3_moe)):
        block = block_cls(cfg)
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0, 0.3)
        block = block.to(torch.bfloat16).eval()
        block.experts.config._experts_implementation = "grouped_mm"
        state = {f"model.layers.0.{k if k.startswith('mlp.') else 'mlp.' + k}": v.detach()
                 for k, v in block.state_dict().items()}
        spec = reader(cfg).moe
        assert spec is not None
        out.append((name, block, load_experts(spec, "model.layers.0.", state.__getitem__,
                                              F.silu)))
    return out


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_experts_match_transformers_in_bf16(norm_topk_prob: bool) -> None:
    torch.manual_seed(0)
    x = torch.randn(37, 64).to(torch.bfloat16)
    for name, block, ours in _blocks(norm_topk_prob):
        with torch.inference_mode():
            theirs = block(x.unsqueeze(0))[0]
            mine = ours(x)
        # Same routing, same roundings: bit for bit.
        assert torch.equal(mine, theirs), name
        assert mine.abs().max() > 0.1, name


def test_idle_experts_are_never_computed() -> None:
    _, _, ours = _blocks(True)[0]
    with torch.no_grad():
        ours.router[:2] = 1.0  # positive inputs: every token prefers experts 0 and 1
        ours.router[2:] = -1.0
        ours.gate_up[2:] = float("nan")  # any matmul touching experts 2+ would spread NaN
        ours.down[2:] = float("nan")
    out = ours((torch.rand(16, 64) + 0.1).to(torch.bfloat16))
    assert torch.isfinite(out).all()
    assert out.abs().max() > 0


def test_sparse_layers_follow_step_and_mlp_only_layers() -> None:
    assert sparse_layers(4, 8, 1, None) == frozenset({0, 1, 2, 3})
    assert sparse_layers(4, 8, 2, [3]) == frozenset({1})
    assert sparse_layers(4, 0, 1, None) == frozenset()
