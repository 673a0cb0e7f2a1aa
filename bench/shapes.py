"""Model shapes the benchmarks build from config (random weights; nothing is downloaded)."""

SHAPES = {
    "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
               num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024, tie_word_embeddings=True),
}
SHAPES |= {f"{name}-untied": {**SHAPES[name], "tie_word_embeddings": False} for name in ("0.5b", "tiny")}
"""Qwen2.5-0.5B, -1.5B, -3B and -7B shapes (their released configs; rope_theta and the rest are Qwen2Config's
defaults, which do not change the cost), a tiny one for trying the scripts on a CPU, and untied
variants of 0.5B and tiny (an output head of its own, as real 7-8B models have)."""

PEAK_BF16_FLOPS = 989e12
"""H100/H200 SXM dense bf16 peak, the usual MFU denominator."""
