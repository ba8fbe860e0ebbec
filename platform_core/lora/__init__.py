"""Serving LoRA adapters: reading PEFT adapters, their slots in the layers, per-step mappings."""
