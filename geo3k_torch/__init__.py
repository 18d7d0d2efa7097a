"""The torch learner: transformers Qwen-VL models, FSDP2, GRPO updates, tiny-checkpoint builder."""
