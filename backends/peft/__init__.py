"""PEFT and LoRA adapters (``adapter/``, ``lora.safetensors``): exact where the rule allows."""
