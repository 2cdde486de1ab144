"""Model configs to simulate: tiny ones for tests, and the real mamba-130m.

Only the fields the layouts and the recurrences read are kept (the HF ``config.json`` names).
"""

# A 4-layer Mamba1 with d_inner 64: one key is 4 x (conv 3x64 + ssm 64x16) x bf16 = 9,728 bytes.
TINY_MAMBA1 = {
    "model_type": "mamba", "hidden_size": 32, "intermediate_size": 64, "state_size": 16,
    "conv_kernel": 4, "num_hidden_layers": 4,
}

# A 4-layer Mamba2, 8 heads x 8 dims in 2 groups: conv 3x(64 + 2*2*16), ssm (8, 8, 16);
# one key is 4 x (384 + 1024) x bf16 = 11,264 bytes.
TINY_MAMBA2 = {
    "model_type": "mamba2", "hidden_size": 32, "expand": 2, "n_groups": 2, "num_heads": 8,
    "head_dim": 8, "state_size": 16, "conv_kernel": 4, "num_hidden_layers": 4,
}

# state-spaces/mamba-130m-hf: 1,400,832 bytes per key at TP 1 in bfloat16.
MAMBA_130M = {
    "model_type": "mamba", "hidden_size": 768, "intermediate_size": 1536, "expand": 2,
    "state_size": 16, "conv_kernel": 4, "num_hidden_layers": 24, "time_step_rank": 48,
}
