#!/usr/bin/env python3
"""Write tiny, seeded Hugging Face-layout checkpoints (config.json + model.safetensors).

Presets
  tiny-qwen3      -> fixtures/tiny-qwen3/      Qwen3ForCausalLM, f32, tied head, attention bias,
                                               head_dim != hidden/heads, odd widths.
  tiny-qwen3-moe  -> fixtures/tiny-qwen3-moe/  Qwen3MoeForCausalLM, bf16, untied head,
                                               8 experts top-2, norm_topk_prob, layer 2 dense.
  tiny-qwen3_5    -> fixtures/tiny-qwen3_5/    Qwen3_5ForConditionalGeneration (multimodal
                                               layout: tiny vision tower, mtp.* tensors), f32,
                                               hybrid linear/full attention, partial RoPE 0.25.
  tiny-qwen3_5-moe -> fixtures/tiny-qwen3_5-moe/ Qwen3_5MoeForCausalLM (text layout, mtp.*),
                                               bf16, 8 experts top-2 + shared expert, RoPE 0.5.
  tiny-llama      -> fixtures/tiny-llama/      LlamaForCausalLM in the layout real checkpoints
                                               have (SmolLM2, Llama 3.2): bf16, tied head, no
                                               bias, GQA, llama3 rope scaling with a frequency
                                               in its blended band; no q/k norm.
  tiny-llama-bias -> --out DIR (not committed)  tiny-llama with attention and MLP biases, an
                  absent num_key_value_heads (MHA) and linear rope scaling: the llama fields
                  real checkpoints rarely set, for the tests.
  tiny-qwen2      -> fixtures/tiny-qwen2/      Qwen2ForCausalLM in the layout real checkpoints
                                               have (Qwen2.5-0.5B): bf16, tied head, bias on
                                               q/k/v (none on o_proj), GQA, top-level rope_theta,
                                               a sliding_window that use_sliding_window = false
                                               turns off; no q/k norm.
  bench-qwen3     -> --out DIR (required; not committed)  ~160M-parameter bf16 Qwen3 for benchmarks.
  bench-qwen3-0.6b, bench-qwen3-moe -> --out DIR (required; not committed)  the Qwen3-0.6B shape
                  and a 64-expert top-8 MoE shape, bf16, for benchmarks (see docs/benchmarks.md).
  bench-qwen3_5-moe -> --out DIR (required; not committed)  a Qwen3.5-MoE shape (hybrid, 3 linear
                  to 1 full attention layer, 64 experts top-8 + shared expert), bf16, benchmarks.
  tiny-gemma3     -> fixtures/tiny-gemma3/     Gemma3ForCausalLM in the layout real Gemma 3 text
                                               checkpoints have (gemma-3-270m): bf16, tied head,
                                               sliding (window 6) and full layers with two rope
                                               bases, (1 + w) norms, query_pre_attn_scalar 20 !=
                                               head_dim 16, one kv head.
  tiny-diffusion-gemma -> fixtures/tiny-diffusion-gemma/ DiffusionGemmaForBlockDiffusion, bf16:
                  sliding and full layers (k = v, proportional RoPE), dense MLP beside 6
                  routed experts, canvas 7, with a generation_config.json.
  bench-diffusion-gemma -> --out DIR (required; not committed)  the same layout at hidden 512,
                  6 layers, 16 experts top-4, vocab 32000, canvas 32, for benchmarks.

Every parameter comes from numpy's PCG64 seeded per tensor from (preset seed, crc32(name)),
so a tensor's values do not depend on which other tensors exist or their order, and re-running
writes byte-identical files (the README of each fixture records the sha256).  Scales are chosen
so that activations neither vanish nor explode with depth, and so that logit-argmax and router
top-k margins stay far above fp32 noise on the seeded prompt set (see scripts/fixture_margins.py).
Norm weights are 1 + noise (never exactly 1) so a forgotten norm weight shows in every tensor;
Qwen3.5's zero-centred norms (applied as x * (1 + w)) get the noise alone, around 0, and its
gated norm (plain x * w) 1 + noise.

bf16 weights are rounded from the f32 draw with round-to-nearest-even; safetensors' numpy API
has no bf16, so the bits are saved as U16 and the header dtype is rewritten to BF16.

Usage
  python scripts/make_fixtures.py                       # every committed fixture, default dirs
  python scripts/make_fixtures.py tiny-qwen3 --out DIR
  python scripts/make_fixtures.py bench-qwen3 --out /tmp/bench-qwen3
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
import zlib
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

ROOT = Path(__file__).resolve().parent.parent

# Scale knobs (see module docstring).  `embed_tail` is the sigma of a log-normal per-token gain on
# the embedding rows: heavy-tailed token norms spread the top of the logit distribution, which
# makes near-ties between the two best tokens rare (Gaussian logits bunch at the top).
PRESETS: dict[str, dict] = {
    "tiny-qwen3": dict(
        seed=20240631,  # best of seeds 20240611..20240640 by `fixture_margins.py --search` (see README)
        dtype="f32",
        out="fixtures/tiny-qwen3",
        config=dict(
            architectures=["Qwen3ForCausalLM"],
            model_type="qwen3",
            vocab_size=499,
            hidden_size=52,
            num_hidden_layers=5,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=12,
            intermediate_size=86,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            attention_bias=True,
            tie_word_embeddings=True,
            max_position_embeddings=256,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=5,
            hidden_act="silu",
            attention_dropout=0.0,
            initializer_range=0.02,
            use_cache=True,
            bos_token_id=1,
            eos_token_id=2,
            dtype="float32",
        ),
        scales=dict(embed=1.0, embed_tail=0.5, block_out=0.7, bias=0.1, norm_noise=0.1, router=0.0),
    ),
    "tiny-qwen3-moe": dict(
        seed=20240719,  # best of seeds 20240612..20240731 by `fixture_margins.py --search` (see README)
        dtype="bf16",
        out="fixtures/tiny-qwen3-moe",
        config=dict(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            vocab_size=503,
            hidden_size=44,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=70,
            moe_intermediate_size=30,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[2],
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            attention_bias=False,
            tie_word_embeddings=False,
            max_position_embeddings=256,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=4,
            hidden_act="silu",
            attention_dropout=0.0,
            initializer_range=0.02,
            output_router_logits=False,
            router_aux_loss_coef=0.001,
            use_cache=True,
            bos_token_id=1,
            eos_token_id=2,
            dtype="bfloat16",
        ),
        scales=dict(
            embed=1.0,
            embed_tail=0.5,
            block_out=0.7,
            bias=0.0,
            norm_noise=0.1,
            router=2.0,
            router_tail=0.5,
        ),
    ),
    "bench-qwen3": dict(
        seed=20240613,
        dtype="bf16",
        out=None,  # must be given: not committed
        config=dict(
            architectures=["Qwen3ForCausalLM"],
            model_type="qwen3",
            vocab_size=32000,
            hidden_size=1024,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=64,
            intermediate_size=2816,
            rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            attention_bias=False,
            tie_word_embeddings=False,
            max_position_embeddings=4096,
            use_sliding_window=False,
            sliding_window=None,
            max_window_layers=8,
            hidden_act="silu",
            attention_dropout=0.0,
            initializer_range=0.02,
            use_cache=True,
            bos_token_id=1,
            eos_token_id=2,
            dtype="bfloat16",
        ),
        scales=dict(embed=1.0, embed_tail=0.5, block_out=0.7, bias=0.0, norm_noise=0.1, router=0.0),
    ),
}
# Benchmark shapes beside bench-qwen3 (docs/benchmarks.md); never generated by the tests.
# bench-qwen3-0.6b: the Qwen3-0.6B shape (28 layers, hidden 1024, 16/8 heads, head_dim 128,
# intermediate 3072, vocab 151936, tied head), ~0.6B parameters, 1.2 GB as bf16.
PRESETS["bench-qwen3-0.6b"] = dict(
    PRESETS["bench-qwen3"],
    seed=20240614,
    config=dict(
        PRESETS["bench-qwen3"]["config"],
        vocab_size=151936,
        num_hidden_layers=28,
        head_dim=128,
        intermediate_size=3072,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
        max_window_layers=28,
    ),
)
# bench-qwen3-moe: 8 layers, hidden 1024, 16/8 heads, head_dim 64, 64 experts top-8 with
# moe_intermediate 768 in every layer, vocab 32000, untied; ~1.3B parameters (2.6 GB as bf16),
# ~0.2B of them read per decoded token.
PRESETS["bench-qwen3-moe"] = dict(
    PRESETS["tiny-qwen3-moe"],
    seed=20240615,
    out=None,  # must be given: not committed
    config=dict(
        PRESETS["tiny-qwen3-moe"]["config"],
        vocab_size=32000,
        hidden_size=1024,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=3072,
        moe_intermediate_size=768,
        num_experts=64,
        num_experts_per_tok=8,
        mlp_only_layers=[],
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        max_window_layers=8,
    ),
)

# Qwen3.5: the text-config fields both presets share, and their scales. `A_range`: the decay
# rate A = exp(A_log) is log-uniform in it; `dt_bias`: sigma of dt_bias (see draw()).
_Q35_TEXT = dict(
    attention_bias=False,
    tie_word_embeddings=False,
    max_position_embeddings=256,
    hidden_act="silu",
    attention_dropout=0.0,
    initializer_range=0.02,
    use_cache=True,
    bos_token_id=1,
    eos_token_id=2,
)
_Q35_SCALES = dict(
    embed=1.0,
    embed_tail=0.5,
    block_out=0.7,
    bias=0.0,
    norm_noise=0.1,
    A_range=(0.02, 0.6),
    dt_bias=0.5,
)
PRESETS["tiny-qwen3_5"] = dict(
    seed=20241703,  # best of 20241601..20241760 by `fixture_margins.py --search` (see README)
    dtype="f32",
    out="fixtures/tiny-qwen3_5",
    # The multimodal layout real Qwen3.5 checkpoints ship: the language model under `text_config`
    # and `model.language_model.*`, a (tiny) vision tower `model.visual.*` and multi-token-prediction
    # tensors `mtp.*`, both present and unused by a text-only run.
    config=dict(
        architectures=["Qwen3_5ForConditionalGeneration"],
        model_type="qwen3_5",
        tie_word_embeddings=False,
        # inside the vocabulary, near its end as in real checkpoints, above every id of the frozen
        # prompts (fixtures/prompts/frozen.json); a text-only run never sees pixel values
        image_token_id=505,
        video_token_id=506,
        vision_start_token_id=503,
        vision_end_token_id=504,
        text_config=dict(
            model_type="qwen3_5_text",
            vocab_size=509,  # >= the frozen prompts' vocab_min (499)
            hidden_size=40,
            num_hidden_layers=5,
            layer_types=[
                "linear_attention",
                "full_attention",
                "linear_attention",
                "linear_attention",
                "full_attention",
            ],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            intermediate_size=54,
            linear_conv_kernel_dim=4,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=12,
            linear_value_head_dim=10,
            rms_norm_eps=1e-6,
            # partial RoPE: 0.25 * 24 = 6 rotated dims (3 frequencies); mrope sections sum to 3
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [1, 1, 1],
                "mrope_interleaved": True,
            },
            **_Q35_TEXT,
            dtype="float32",
        ),
        vision_config=dict(
            model_type="qwen3_5_vision",
            depth=1,
            hidden_size=16,
            intermediate_size=24,
            num_heads=2,
            in_channels=3,
            patch_size=2,
            temporal_patch_size=2,
            spatial_merge_size=2,
            out_hidden_size=40,
            num_position_embeddings=16,
            hidden_act="gelu_pytorch_tanh",
            initializer_range=0.02,
        ),
        dtype="float32",
    ),
    scales=dict(_Q35_SCALES, bias=0.1, router=0.0),  # bias: the vision tower's
    mtp_layers=1,
)
PRESETS["tiny-qwen3_5-moe"] = dict(
    seed=20241998,  # best of 20241901..20242060 by `fixture_margins.py --search` (see README)
    dtype="bf16",
    out="fixtures/tiny-qwen3_5-moe",
    # The text-only layout (`model.layers.*`); its multimodal twin is tiny-qwen3_5's.
    config=dict(
        architectures=["Qwen3_5MoeForCausalLM"],
        model_type="qwen3_5_moe_text",
        vocab_size=521,  # >= the frozen prompts' vocab_min (499)
        hidden_size=36,
        num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        linear_conv_kernel_dim=3,
        linear_num_key_heads=2,
        linear_num_value_heads=6,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=20,
        shared_expert_intermediate_size=28,
        rms_norm_eps=1e-5,
        # partial RoPE: 0.5 * 16 = 8 rotated dims (4 frequencies); mrope sections sum to 4
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1000000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
        **_Q35_TEXT,
        output_router_logits=False,
        router_aux_loss_coef=0.001,
        dtype="bfloat16",
    ),
    scales=dict(_Q35_SCALES, router=2.0, router_tail=0.5),
    mtp_layers=1,
)
# bench-qwen3_5-moe (docs/benchmarks.md): the Qwen3.5-MoE shape at hidden 1024, 8 layers
# `L L L F L L L F` (3 Gated DeltaNet layers per full attention layer, transformers' default
# interval 4), routed + shared expert in every layer. The linear_* and attention head sizes are
# the Qwen3.5-MoE defaults (head dims 128 and 256, 2 KV heads, partial RoPE 0.25 with mrope
# sections summing to 32) with the head counts halved with the width (16 → 8 key heads, 32 → 16
# value heads, 16 → 8 query heads); 64 experts top-8 with moe_intermediate 512 and a 512 shared
# expert; vocab 32000, untied; no mtp.* tensors. ~0.94B parameters (1.9 GB as bf16), ~0.2B of
# them read per decoded token; generating it peaks near 10 GB.
PRESETS["bench-qwen3_5-moe"] = dict(
    PRESETS["tiny-qwen3_5-moe"],
    seed=20241999,
    out=None,  # must be given: not committed
    config=dict(
        PRESETS["tiny-qwen3_5-moe"]["config"],
        vocab_size=32000,
        hidden_size=1024,
        num_hidden_layers=8,
        layer_types=["linear_attention"] * 3
        + ["full_attention"]
        + ["linear_attention"] * 3
        + ["full_attention"],
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=256,
        linear_conv_kernel_dim=4,
        linear_num_key_heads=8,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        num_experts=64,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
        shared_expert_intermediate_size=512,
        rms_norm_eps=1e-6,
        # 0.25 * 256 = 64 rotated dims (32 frequencies), as in the real config
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        max_position_embeddings=4096,
    ),
    mtp_layers=0,
)


PRESETS["tiny-llama"] = dict(
    seed=20241202,  # best of seeds 20241201..20241216 by `fixture_margins.py --search` (see README)
    dtype="bf16",
    out="fixtures/tiny-llama",
    config=dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=509,
        hidden_size=60,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        # head_dim absent: hidden_size // num_attention_heads = 10, as LlamaConfig defaults.
        intermediate_size=92,
        rms_norm_eps=1e-5,
        # Wavelengths 2π/inv_freq ≈ 6.3, 87, 1190, …: one kept (< 256/4), one blended, the rest
        # divided by the factor (> 256/1) — every branch of §7.1's llama3 rule.
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256,
        },
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        hidden_act="silu",
        attention_dropout=0.0,
        initializer_range=0.02,
        pretraining_tp=1,
        use_cache=True,
        bos_token_id=1,
        eos_token_id=2,
        dtype="bfloat16",
    ),
    scales=dict(embed=1.0, embed_tail=0.5, block_out=0.7, bias=0.0, norm_noise=0.1, router=0.0),
    tokenizer=True,
)
PRESETS["tiny-llama-bias"] = dict(
    PRESETS["tiny-llama"],
    out=None,
    tokenizer=False,
    dtype="f32",
    config={
        **{k: v for k, v in PRESETS["tiny-llama"]["config"].items() if k != "num_key_value_heads"},
        "attention_bias": True,
        "mlp_bias": True,
        "tie_word_embeddings": False,
        "rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
        "dtype": "float32",
    },
    scales=dict(embed=1.0, embed_tail=0.5, block_out=0.7, bias=0.1, norm_noise=0.1, router=0.0),
)

PRESETS["tiny-qwen2"] = dict(
    seed=20250301,  # best of seeds 20250301..20250308 by `fixture_margins.py --search` (see README)
    dtype="bf16",
    out="fixtures/tiny-qwen2",
    # The fields of a real Qwen2.5 config.json (Qwen2.5-0.5B), at odd tiny sizes.
    config=dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        vocab_size=521,
        hidden_size=84,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        # head_dim absent: hidden_size // num_attention_heads = 14, as Qwen2Attention defaults.
        intermediate_size=146,
        rms_norm_eps=1e-6,
        # Top-level, as Qwen2.5's config.json has it (no rope_parameters, rope_scaling absent).
        rope_theta=1000000.0,
        # No attention_bias field: Qwen2's q/k/v bias is fixed. sliding_window is set but
        # use_sliding_window is false, so transformers drops it: a window of 8 would change the
        # longer frozen prompts if a producer applied it anyway.
        use_sliding_window=False,
        sliding_window=8,
        max_window_layers=2,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        hidden_act="silu",
        attention_dropout=0.0,
        initializer_range=0.02,
        use_cache=True,
        bos_token_id=1,
        eos_token_id=2,
        dtype="bfloat16",
    ),
    scales=dict(embed=1.0, embed_tail=0.5, block_out=0.7, bias=0.2, norm_noise=0.1, router=0.0),
    tokenizer=True,
)

# tiny-gemma3: the fields of a real Gemma 3 text config.json (gemma-3-270m: legacy top-level
# rope_theta / rope_local_base_freq, `_sliding_window_pattern` beside the explicit layer_types,
# which transformers reads) at odd tiny sizes. The window (6) is shorter than every frozen prompt
# but `short`, so it bites; query_pre_attn_scalar differs from head_dim, so a scale by head_dim
# shows; the embedding scale 0.5 makes the scaled rows (× √48) about 3.5 in rms.
PRESETS["tiny-gemma3"] = dict(
    seed=20261301,
    dtype="bf16",
    out="fixtures/tiny-gemma3",
    config=dict(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        vocab_size=511,  # >= the frozen prompts' vocab_min (499)
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=4,
        layer_types=[
            "sliding_attention",
            "sliding_attention",
            "full_attention",
            "sliding_attention",
        ],
        _sliding_window_pattern=3,
        sliding_window=6,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=20,
        hidden_activation="gelu_pytorch_tanh",
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        rope_scaling=None,
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
        attention_bias=False,
        attention_dropout=0.0,
        use_bidirectional_attention=False,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        initializer_range=0.02,
        use_cache=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        dtype="bfloat16",
    ),
    scales=dict(embed=0.5, embed_tail=0.5, block_out=0.7, bias=0.0, norm_noise=0.1, router=0.0),
)


# tiny-diffusion-gemma: DiffusionGemmaForBlockDiffusion (docs/diffusion-gemma.md) at odd sizes:
# sliding (head_dim 10, 2 KV heads, window 5) and full (head_dim 16, 1 KV head, k = v,
# proportional RoPE rotating dims 0-1 with 8-9) layers, a dense MLP beside 6 routed experts
# (top 2) in every layer, canvas 7, bf16. The checkpoint holds the decoder's tensors and the
# encoder's own layer_scalar buffers (everything else of the encoder is tied), no vision tower.
# generation_config.json: 6 denoising steps a block at most.
PRESETS["tiny-diffusion-gemma"] = dict(
    seed=20261205,
    dtype="bf16",
    out="fixtures/tiny-diffusion-gemma",
    config=dict(
        architectures=["DiffusionGemmaForBlockDiffusion"],
        model_type="diffusion_gemma",
        canvas_length=7,
        tie_word_embeddings=True,
        text_config=dict(
            model_type="diffusion_gemma_text",
            vocab_size=509,  # >= the frozen prompts' vocab_min (499)
            hidden_size=44,
            intermediate_size=38,
            num_hidden_layers=4,
            layer_types=[
                "sliding_attention",
                "full_attention",
                "sliding_attention",
                "full_attention",
            ],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=10,
            per_layer_config={
                "1": {"head_dim": 16, "num_key_value_heads": 1},
                "3": {"head_dim": 16, "num_key_value_heads": 1},
            },
            sliding_window=5,
            num_experts=6,
            top_k_experts=2,
            moe_intermediate_size=10,
            hidden_activation="gelu_pytorch_tanh",
            rms_norm_eps=1e-6,
            final_logit_softcapping=30.0,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {
                    "rope_type": "proportional",
                    "partial_rotary_factor": 0.25,
                    "rope_theta": 1000000.0,
                },
            },
            attention_bias=False,
            max_position_embeddings=512,
            tie_word_embeddings=True,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=2,
            dtype="bfloat16",
        ),
        # Read by nothing here (token ids only); tiny so that transformers builds a tiny tower.
        vision_config=dict(
            model_type="gemma4_vision",
            hidden_size=16,
            intermediate_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=2,
            head_dim=8,
        ),
        dtype="bfloat16",
    ),
    generation=dict(
        max_denoising_steps=6,
        t_max=0.8,
        t_min=0.4,
        sampler_config={"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 0.3},
        stability_threshold=1,
        confidence_threshold=0.05,
    ),
    scales=dict(
        embed=1.0, embed_tail=0.5, block_out=0.7, norm_noise=0.1, router=8.0, router_tail=0.5
    ),
)

# bench-diffusion-gemma (docs/benchmarks.md): the diffusion Gemma layout at hidden 512, 6 layers
# (5:1 sliding to full, the last full), head dims 64 (sliding, 4 KV heads) and 128 (full, 2 KV
# heads, k = v), a dense MLP of 1536 beside 16 experts of 256 (top 4), vocab 32000, canvas 32,
# window 128, up to 16 denoising steps a block. ~84M parameters (~170 MB as bf16).
PRESETS["bench-diffusion-gemma"] = dict(
    PRESETS["tiny-diffusion-gemma"],
    seed=20261206,
    out=None,  # must be given: not committed
    config=dict(
        PRESETS["tiny-diffusion-gemma"]["config"],
        canvas_length=32,
        text_config=dict(
            PRESETS["tiny-diffusion-gemma"]["config"]["text_config"],
            vocab_size=32000,
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=6,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            per_layer_config={"5": {"head_dim": 128, "num_key_value_heads": 2}},
            sliding_window=128,
            num_experts=16,
            top_k_experts=4,
            moe_intermediate_size=256,
            max_position_embeddings=4096,
        ),
    ),
    generation=dict(PRESETS["tiny-diffusion-gemma"]["generation"], max_denoising_steps=16),
)


def diffusion_gemma_specs(cfg: dict) -> list[tuple[str, tuple[int, ...], str, float]]:
    """The decoder's tensors and the encoder's layer scalars (docs/diffusion-gemma.md DG0)."""
    t = text_config(cfg)
    H, V, nh = t["hidden_size"], t["vocab_size"], t["num_attention_heads"]
    E, I = t["num_experts"], t["moe_intermediate_size"]
    d = "model.decoder."
    specs = [(d + "embed_tokens.weight", (V, H), "embed", H)]
    for i, kind in enumerate(t["layer_types"]):
        over = t["per_layer_config"].get(str(i), {}) if kind == "full_attention" else {}
        hd = over.get("head_dim", t["head_dim"])
        kv = over.get("num_key_value_heads", t["num_key_value_heads"])
        p = f"{d}layers.{i}."
        a = p + "self_attn."
        specs += [
            (a + "q_proj.weight", (nh * hd, H), "in", H),
            (a + "k_proj.weight", (kv * hd, H), "in", H),
            (a + "o_proj.weight", (H, nh * hd), "out", nh * hd),
            (a + "q_norm.weight", (hd,), "norm", 0),
            (a + "k_norm.weight", (hd,), "norm", 0),
        ]
        if kind == "sliding_attention":  # full layers have no v_proj: v is k_proj's output
            specs.append((a + "v_proj.weight", (kv * hd, H), "in", H))
        specs += _mlp_specs(p + "mlp.", H, t["intermediate_size"])
        for norm in (
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
            "post_feedforward_layernorm_1",
            "post_feedforward_layernorm_2",
            "pre_feedforward_layernorm_2",
        ):
            specs.append((f"{p}{norm}.weight", (H,), "norm", 0))
        specs += [
            (p + "router.proj.weight", (E, H), "router", H),
            (p + "router.scale", (H,), "norm", 0),
            (p + "router.per_expert_scale", (E,), "norm", 0),
            (p + "experts.gate_up_proj", (E, 2 * I, H), "in", H),
            (p + "experts.down_proj", (E, H, I), "mlp_down", I),
            (p + "layer_scalar", (1,), "norm", 0),
            # the encoder's own scalar: not tied, so it differs from the decoder's
            (f"model.encoder.language_model.layers.{i}.layer_scalar", (1,), "norm", 0),
        ]
    specs.append((d + "norm.weight", (H,), "norm", 0))
    sc = d + "self_conditioning."
    specs.append((sc + "pre_norm.weight", (H,), "norm", 0))
    specs += _mlp_specs(sc, H, t["intermediate_size"])
    if not cfg["tie_word_embeddings"]:
        specs.append(("lm_head.weight", (V, H), "head", H))
    return specs


def tensor_specs(cfg: dict) -> list[tuple[str, tuple[int, ...], str, float]]:
    """(name, shape, kind, fan_in) for every checkpoint tensor, in HF checkpoint naming."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    nh = cfg["num_attention_heads"]
    nkv = cfg.get("num_key_value_heads", nh)  # LlamaConfig's default: MHA
    hd = cfg.get("head_dim", H // nh)
    qwen2 = cfg["model_type"] == "qwen2"
    # Qwen2Attention: q, k and v always carry a bias, o_proj never (no attention_bias field).
    bias = qwen2 or cfg["attention_bias"]
    moe = cfg["model_type"] == "qwen3_moe"
    no_qk_norm = cfg["model_type"] in ("llama", "qwen2")
    # Gemma 3: every norm is Gemma3RMSNorm, x * (1 + w) ("norm0": noise around 0), and the MLP
    # has its own input and output norms.
    gemma3 = cfg["model_type"] == "gemma3_text"
    norm = "norm0" if gemma3 else "norm"
    specs = [("model.embed_tokens.weight", (V, H), "embed", H)]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (H,), norm, 0),
            (p + "self_attn.q_proj.weight", (nh * hd, H), "in", H),
            (p + "self_attn.k_proj.weight", (nkv * hd, H), "in", H),
            (p + "self_attn.v_proj.weight", (nkv * hd, H), "in", H),
            (p + "self_attn.o_proj.weight", (H, nh * hd), "out", nh * hd),
            (p + "post_attention_layernorm.weight", (H,), norm, 0),
        ]
        if gemma3:
            specs += [
                (p + "pre_feedforward_layernorm.weight", (H,), norm, 0),
                (p + "post_feedforward_layernorm.weight", (H,), norm, 0),
            ]
        if not no_qk_norm:  # llama and qwen2 have no per-head q/k norm
            specs += [
                (p + "self_attn.q_norm.weight", (hd,), norm, 0),
                (p + "self_attn.k_norm.weight", (hd,), norm, 0),
            ]
        if bias:  # Qwen3 puts attention_bias on q, k, v AND o_proj; qwen2 on q, k, v only
            specs += [
                (p + "self_attn.q_proj.bias", (nh * hd,), "bias", 0),
                (p + "self_attn.k_proj.bias", (nkv * hd,), "bias", 0),
                (p + "self_attn.v_proj.bias", (nkv * hd,), "bias", 0),
            ]
            if not qwen2:
                specs.append((p + "self_attn.o_proj.bias", (H,), "bias", 0))
        sparse = (
            moe
            and i not in cfg["mlp_only_layers"]
            and cfg["num_experts"] > 0
            and (i + 1) % cfg["decoder_sparse_step"] == 0
        )
        if sparse:
            I = cfg["moe_intermediate_size"]
            specs.append((p + "mlp.gate.weight", (cfg["num_experts"], H), "router", H))
            for e in range(cfg["num_experts"]):
                q = f"{p}mlp.experts.{e}."
                specs += [
                    (q + "gate_proj.weight", (I, H), "in", H),
                    (q + "up_proj.weight", (I, H), "in", H),
                    (q + "down_proj.weight", (H, I), "mlp_down", I),
                ]
        else:
            I = cfg["intermediate_size"]
            specs += [
                (p + "mlp.gate_proj.weight", (I, H), "in", H),
                (p + "mlp.up_proj.weight", (I, H), "in", H),
                (p + "mlp.down_proj.weight", (H, I), "mlp_down", I),
            ]
            if cfg.get("mlp_bias"):
                specs += [
                    (p + "mlp.gate_proj.bias", (I,), "bias", 0),
                    (p + "mlp.up_proj.bias", (I,), "bias", 0),
                    (p + "mlp.down_proj.bias", (H,), "bias", 0),
                ]
    specs.append(("model.norm.weight", (H,), norm, 0))
    if not cfg["tie_word_embeddings"]:
        specs.append(("lm_head.weight", (V, H), "head", H))
    return specs


def text_config(cfg: dict) -> dict:
    """The language model's fields: `text_config` in the multimodal layout, else the config itself."""
    return cfg.get("text_config", cfg)


def _mlp_specs(p: str, H: int, I: int) -> list:
    return [
        (p + "gate_proj.weight", (I, H), "in", H),
        (p + "up_proj.weight", (I, H), "in", H),
        (p + "down_proj.weight", (H, I), "mlp_down", I),
    ]


def _qwen3_5_layer_specs(p: str, t: dict, kind: str) -> list:
    """One Qwen3.5 decoder layer (`kind` from layer_types) in HF checkpoint naming under prefix p."""
    H = t["hidden_size"]
    specs = [
        # Qwen3_5RMSNorm is zero-centred, x * (1 + w): "norm0" draws small noise around 0
        (p + "input_layernorm.weight", (H,), "norm0", 0),
        (p + "post_attention_layernorm.weight", (H,), "norm0", 0),
    ]
    if kind == "linear_attention":
        nk, nv = t["linear_num_key_heads"], t["linear_num_value_heads"]
        dk, dv = t["linear_key_head_dim"], t["linear_value_head_dim"]
        conv_dim, K = 2 * nk * dk + nv * dv, t["linear_conv_kernel_dim"]
        q = p + "linear_attn."
        specs += [
            (q + "in_proj_qkv.weight", (conv_dim, H), "in", H),
            (q + "in_proj_z.weight", (nv * dv, H), "in", H),
            (q + "in_proj_b.weight", (nv, H), "in", H),
            (q + "in_proj_a.weight", (nv, H), "in", H),
            (q + "conv1d.weight", (conv_dim, 1, K), "in", K),
            (q + "dt_bias", (nv,), "dt_bias", 0),
            (q + "A_log", (nv,), "A_log", 0),
            # Qwen3_5RMSNormGated is 1-centred (plain x * w): "norm" is 1 + noise
            (q + "norm.weight", (dv,), "norm", 0),
            (q + "out_proj.weight", (H, nv * dv), "out", nv * dv),
        ]
    elif kind == "full_attention":
        nh, nkv, hd = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
        q = p + "self_attn."
        specs += [
            # per head: head_dim query rows, then head_dim output-gate rows
            (q + "q_proj.weight", (2 * nh * hd, H), "in", H),
            (q + "k_proj.weight", (nkv * hd, H), "in", H),
            (q + "v_proj.weight", (nkv * hd, H), "in", H),
            (q + "o_proj.weight", (H, nh * hd), "out", nh * hd),
            (q + "q_norm.weight", (hd,), "norm0", 0),
            (q + "k_norm.weight", (hd,), "norm0", 0),
        ]
    else:
        raise AssertionError(kind)
    if "num_experts" in t:  # Qwen3.5-MoE: every layer routed + shared expert
        E, I = t["num_experts"], t["moe_intermediate_size"]
        specs.append((p + "mlp.gate.weight", (E, H), "router", H))
        for e in range(E):
            specs += _mlp_specs(f"{p}mlp.experts.{e}.", H, I)
        specs += _mlp_specs(p + "mlp.shared_expert.", H, t["shared_expert_intermediate_size"])
        specs.append((p + "mlp.shared_expert_gate.weight", (1, H), "in", H))
    else:
        specs += _mlp_specs(p + "mlp.", H, t["intermediate_size"])
    return specs


def qwen3_5_specs(cfg: dict, mtp_layers: int) -> list[tuple[str, tuple[int, ...], str, float]]:
    """Every tensor of a Qwen3.5 / Qwen3.5-MoE checkpoint, text or multimodal layout."""
    t = text_config(cfg)
    H, V = t["hidden_size"], t["vocab_size"]
    lm = "model.language_model." if "text_config" in cfg else "model."
    specs = [(lm + "embed_tokens.weight", (V, H), "embed", H)]
    for i, kind in enumerate(t["layer_types"]):
        specs += _qwen3_5_layer_specs(f"{lm}layers.{i}.", t, kind)
    specs.append((lm + "norm.weight", (H,), "norm0", 0))
    if not t["tie_word_embeddings"]:
        specs.append(("lm_head.weight", (V, H), "head", H))
    # multi-token prediction head: present in real checkpoints, unused by a forward pass
    if mtp_layers:
        specs += [
            ("mtp.fc.weight", (H, 2 * H), "in", 2 * H),
            ("mtp.pre_fc_norm_embedding.weight", (H,), "norm0", 0),
            ("mtp.pre_fc_norm_hidden.weight", (H,), "norm0", 0),
            ("mtp.norm.weight", (H,), "norm0", 0),
        ]
        for i in range(mtp_layers):
            specs += _qwen3_5_layer_specs(f"mtp.layers.{i}.", t, "full_attention")
    if "vision_config" in cfg:
        v = cfg["vision_config"]
        D, Iv, P, T = (
            v["hidden_size"],
            v["intermediate_size"],
            v["patch_size"],
            v["temporal_patch_size"],
        )
        C, M = v["in_channels"], D * v["spatial_merge_size"] ** 2
        p = "model.visual."
        specs += [
            (p + "patch_embed.proj.weight", (D, C, T, P, P), "in", C * T * P * P),
            (p + "patch_embed.proj.bias", (D,), "bias", 0),
            (p + "pos_embed.weight", (v["num_position_embeddings"], D), "in", D),
        ]
        for b in range(v["depth"]):
            q = f"{p}blocks.{b}."
            specs += [
                (q + "norm1.weight", (D,), "norm", 0),
                (q + "norm1.bias", (D,), "bias", 0),
                (q + "norm2.weight", (D,), "norm", 0),
                (q + "norm2.bias", (D,), "bias", 0),
                (q + "attn.qkv.weight", (3 * D, D), "in", D),
                (q + "attn.qkv.bias", (3 * D,), "bias", 0),
                (q + "attn.proj.weight", (D, D), "out", D),
                (q + "attn.proj.bias", (D,), "bias", 0),
                (q + "mlp.linear_fc1.weight", (Iv, D), "in", D),
                (q + "mlp.linear_fc1.bias", (Iv,), "bias", 0),
                (q + "mlp.linear_fc2.weight", (D, Iv), "out", Iv),
                (q + "mlp.linear_fc2.bias", (D,), "bias", 0),
            ]
        specs += [
            (p + "merger.norm.weight", (D,), "norm", 0),
            (p + "merger.norm.bias", (D,), "bias", 0),
            (p + "merger.linear_fc1.weight", (M, M), "in", M),
            (p + "merger.linear_fc1.bias", (M,), "bias", 0),
            (p + "merger.linear_fc2.weight", (v["out_hidden_size"], M), "out", M),
            (p + "merger.linear_fc2.bias", (v["out_hidden_size"],), "bias", 0),
        ]
    return specs


def draw(seed: int, name: str, shape, kind: str, fan_in: int, sc: dict) -> np.ndarray:
    # Per-tensor stream: independent of every other tensor's existence and order.
    rng = np.random.Generator(
        np.random.PCG64(np.random.SeedSequence([seed, zlib.crc32(name.encode())]))
    )
    z = rng.standard_normal(shape, dtype=np.float64)
    if kind == "norm":
        w = 1.0 + sc["norm_noise"] * z
    elif kind == "norm0":  # zero-centred norm weight, applied as x * (1 + w)
        w = sc["norm_noise"] * z
    elif kind == "A_log":
        # decay rate A log-uniform in A_range: per-token decay exp(-A * softplus(a + dt_bias))
        # then spans long and short memories, never 0 or 1
        lo, hi = np.log(sc["A_range"])
        w = lo + (hi - lo) * rng.uniform(size=shape)
    elif kind == "dt_bias":
        w = sc["dt_bias"] * z
    elif kind == "bias":
        w = sc["bias"] * z
    elif kind in ("embed", "head"):
        # log-normal per-row gain (see PRESETS comment); the head reuses the same trick.
        gain = np.exp(sc["embed_tail"] * rng.standard_normal((shape[0], 1)))
        w = sc["embed"] * gain * z / (np.sqrt(fan_in) if kind == "head" else 1.0)
    elif kind == "in":
        w = z / np.sqrt(fan_in)
    elif kind == "out":
        w = sc["block_out"] * z / np.sqrt(fan_in)
    elif kind == "mlp_down":
        # silu(g)*u has rms ~0.5 for unit-rms g, u: x2 brings the block output to ~block_out.
        w = 2.0 * sc["block_out"] * z / np.sqrt(fan_in)
    elif kind == "router":
        # Router logits with std ~`router`; a log-normal per-expert gain (`router_tail`) spreads
        # the ranked logits apart, so k-th vs (k+1)-th near-ties are rarer than with equal gains.
        gain = np.exp(sc.get("router_tail", 0.0) * rng.standard_normal((shape[0], 1)))
        w = sc["router"] * gain * z / np.sqrt(fan_in)
    else:
        raise AssertionError(kind)
    w = w.astype(np.float32)
    assert np.isfinite(w).all(), name
    return w


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even f32 -> bf16, returned as the uint16 bit pattern (finite input)."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    return b.astype(np.uint16)


def save(tensors: dict[str, np.ndarray], path: Path, metadata: dict, bf16: bool) -> None:
    """safetensors.numpy.save_file, then re-serialise the header with sorted keys.

    The Rust writer emits `__metadata__` from a hash map (order varies run to run), so the header
    is rewritten canonically to make the file byte-reproducible. For bf16 the bits are saved as
    U16 (numpy has no bf16) and the header dtype is rewritten to BF16; data bytes are untouched
    and offsets are relative to the data section, so only the header length changes.
    """
    tmp = path.with_suffix(".tmp")
    save_file(
        {k: f32_to_bf16_bits(v) if bf16 else v for k, v in tensors.items()},
        str(tmp),
        metadata=metadata,
    )
    raw = tmp.read_bytes()
    tmp.unlink()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    for k, v in header.items():
        if k != "__metadata__" and bf16:
            assert v["dtype"] == "U16", (k, v)
            v["dtype"] = "BF16"
    hb = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    hb += b" " * (-len(hb) % 8)  # data section stays 8-byte aligned
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + raw[8 + n :])


def make(preset: str, out: Path, seed: int | None = None) -> Path:
    p = PRESETS[preset]
    cfg, sc = p["config"], p["scales"]
    seed = p["seed"] if seed is None else seed
    out.mkdir(parents=True, exist_ok=True)
    family = text_config(cfg)["model_type"]
    if family in ("qwen3_5_text", "qwen3_5_moe_text"):
        specs = qwen3_5_specs(cfg, p["mtp_layers"])
    elif family == "diffusion_gemma_text":
        specs = diffusion_gemma_specs(cfg)
    else:
        specs = tensor_specs(cfg)
    tensors = {
        name: draw(seed, name, shape, kind, fan_in, sc) for name, shape, kind, fan_in in specs
    }
    meta = {"format": "pt", "generator": f"scripts/make_fixtures.py {preset} seed={seed}"}
    st = out / "model.safetensors"
    assert p["dtype"] in ("f32", "bf16"), p["dtype"]
    save(tensors, st, meta, bf16=p["dtype"] == "bf16")
    full = dict(cfg, transformers_version="5.23.0")
    (out / "config.json").write_text(json.dumps(full, indent=2, sort_keys=True) + "\n")
    if "generation" in p:
        gen = dict(p["generation"], transformers_version="5.23.0")
        (out / "generation_config.json").write_text(
            json.dumps(gen, indent=2, sort_keys=True) + "\n"
        )
    if p.get("tokenizer"):
        write_tokenizer(out, cfg["vocab_size"])
    return out


# tiny-llama's tokenizer: byte-level BPE as real llama checkpoints have (every text encodes; ids
# are its own, not 0..n), with a few merges of common English and a ChatML chat template.
TOKENIZER_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENIZER_MERGES = [
    ("Ġ", "t"),
    ("h", "e"),
    ("Ġt", "he"),
    ("Ġ", "a"),
    ("i", "n"),
    ("o", "n"),
    ("e", "r"),
    ("Ġ", "s"),
    ("Ġ", "w"),
    ("Ġ", "o"),
    ("r", "e"),
    ("a", "t"),
    ("e", "n"),
    ("Ġ", "c"),
    ("i", "s"),
    ("Ġ", "i"),
    ("o", "r"),
    ("Ġ", "f"),
    ("Ġ", "p"),
]
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def write_tokenizer(out: Path, vocab_size: int) -> None:
    """tokenizer.json and tokenizer_config.json: special tokens at ids 0..2, the 256 byte
    symbols, then the merges' results, every id below `vocab_size`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(TOKENIZER_SPECIAL)}
    for sym in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[sym] = len(vocab)
    for a, b in TOKENIZER_MERGES:
        vocab.setdefault(a + b, len(vocab))
    assert len(vocab) <= vocab_size, (len(vocab), vocab_size)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=TOKENIZER_MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(TOKENIZER_SPECIAL)
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True) + "\n")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "presets",
        nargs="*",
        metavar="PRESET",
        help=f"one of {', '.join(PRESETS)}; default: the committed fixtures",
    )
    ap.add_argument("--out", type=Path, help="output dir (only with exactly one preset)")
    ap.add_argument(
        "--seed",
        type=int,
        help="override the preset's seed (exploration only; committed fixtures use the preset's)",
    )
    a = ap.parse_args(argv)
    presets = a.presets or [n for n, p in PRESETS.items() if p["out"]]
    for name in presets:
        if name not in PRESETS:
            ap.error(f"unknown preset {name!r} (choose from {', '.join(PRESETS)})")
    if a.out and len(presets) != 1:
        ap.error("--out needs exactly one preset")
    for name in presets:
        out = a.out or (PRESETS[name]["out"] and ROOT / PRESETS[name]["out"])
        if not out:
            ap.error(f"{name} is not committed: give --out DIR")
        d = make(name, Path(out), a.seed)
        size = (d / "model.safetensors").stat().st_size
        print(f"{name}: {d} ({size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
