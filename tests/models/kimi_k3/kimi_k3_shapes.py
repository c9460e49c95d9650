"""Kimi-K3's public MoE dimensions and the small stand-in used for CPU loading."""

# Kimi-K3 text config (config.json ``text_config``).
HIDDEN_SIZE = 7168
ROUTED_EXPERT_HIDDEN_SIZE = 3584  # latent MoE width: what the experts see
MOE_INTERMEDIATE_SIZE = 3072
NUM_EXPERTS = 896
NUM_EXPERTS_PER_TOKEN = 16
NUM_SHARED_EXPERTS = 2

# MXFP4: two 4-bit values per byte, one E8M0 scale byte per 32 values.
MXFP4_VALUES_PER_BYTE = 2
MXFP4_BLOCK = 32

# Stand-in for CPU tensors: the real intermediate size (so TP32 gives 96 per
# rank), a latent width Marlin needs no hidden padding for (a multiple of 256),
# and a handful of experts.
SMALL_HIDDEN_SIZE = 512
SMALL_ROUTED_EXPERT_HIDDEN_SIZE = 256
SMALL_NUM_EXPERTS = 4
SMALL_NUM_EXPERTS_PER_TOKEN = 2
