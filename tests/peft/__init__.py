"""Parameter-efficient fine-tuning against peft: LoRA, QLoRA (NF4), prompt and prefix tuning."""
