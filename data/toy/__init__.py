"""The toy world: a stdlib-trained Llama pair, its tokenizer, prompts and text streams."""
