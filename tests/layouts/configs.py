"""Real ``config.json`` field values of the models the layout tests work through by hand.

Only the fields vLLM reads for cache sizing are kept; values are as published on the Hub.
"""

# state-spaces/mamba-130m-hf
MAMBA_130M = {
    "model_type": "mamba", "hidden_size": 768, "intermediate_size": 1536, "expand": 2,
    "state_size": 16, "conv_kernel": 4, "num_hidden_layers": 24,
}

# mistralai/Mamba-Codestral-7B-v0.1
CODESTRAL = {
    "model_type": "mamba2", "hidden_size": 4096, "num_hidden_layers": 64, "state_size": 128,
    "expand": 2, "n_groups": 8, "head_dim": 64, "num_heads": 128, "conv_kernel": 4,
}

# Qwen/Qwen3-Next-80B-A3B-Instruct (no layer_types: layer i is full attention when (i+1) % 4 == 0)
QWEN3_NEXT = {
    "model_type": "qwen3_next", "hidden_size": 2048, "num_hidden_layers": 48,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_key_head_dim": 128, "linear_num_value_heads": 32,
    "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
}

# Qwen/Qwen3.5-9B (the model of the vLLM #53084 report): 32 layers, 8 of them full attention
QWEN3_5_9B = {
    "model_type": "qwen3_5",
    "text_config": {
        "model_type": "qwen3_5_text", "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_key_head_dim": 128, "linear_num_value_heads": 32,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "mamba_ssm_dtype": "float32",
    },
}

# LiquidAI/LFM2-1.2B: attention at layers 2, 5, 8, 10, 12, 14; short conv elsewhere
_LFM2_ATTENTION = {2, 5, 8, 10, 12, 14}
LFM2_1_2B = {
    "model_type": "lfm2", "hidden_size": 2048, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "conv_L_cache": 3,
    "layer_types": ["full_attention" if i in _LFM2_ATTENTION else "conv" for i in range(16)],
}
