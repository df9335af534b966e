"""Interoperability: models from Hugging Face Marian in, CTranslate2 models out."""
