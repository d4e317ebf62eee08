"""megatron-vlm-packing."""
