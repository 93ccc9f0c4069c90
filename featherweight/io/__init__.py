"""Files in and out: checkpoint readers (safetensors, GGUF), writers (HF, PEFT), tokenizers, atomic writes."""
