"""Reading checkpoints (GGUF, Hugging Face) and their tokenizers."""
