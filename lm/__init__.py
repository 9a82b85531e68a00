"""The language-model side's library: tokenizers, chat data, LoRA, Muon, DPO log-probs."""
