"""Model construction: pair resolution (toy, hub names, local checkpoints, GGUF files, drafters
built from the target's layers, copy:K), checkpoint and tokenizer checks, and the vocabulary
mapping between two tokenizers. Kept apart from prompt data (`data/prompts.py`, the long and toy
sets) and the generate stage so each folder's name says what it holds."""
