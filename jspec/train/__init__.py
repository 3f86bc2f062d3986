"""Training for the shipped tiny model family: tokenizer, corpora, dense forward, LM pre-training, export."""
