"""Parameter-efficient fine-tuning: LoRA adapters, their settings, QLoRA's NF4 base, merges."""
