"""Text to speech: the acoustic model, its data and its evaluation (train_tts.py)."""
