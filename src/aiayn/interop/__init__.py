"""Interoperability: models from Hugging Face Marian in, CTranslate2 models out.

Light on purpose (no torch, no ctranslate2): the CLI's ``--help`` reads it.
"""

# CTranslate2's weight types (``spec.optimize(quantization=...)``); None keeps float32.
QUANTIZATIONS = (
    "float32",
    "int8",
    "int8_float32",
    "int8_float16",
    "int8_bfloat16",
    "int16",
    "float16",
    "bfloat16",
)
