"""Model loading and model recipes."""
