"""Published Hugging Face models in and out: checkpoints, tokenizers, chat templates."""
