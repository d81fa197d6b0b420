"""Test and demo support: the SGLang emulator and the bundled test tokenizer."""

from .tokenizer import BUILTIN_TEMPLATES, builtin_template, test_tokenizer_path

__all__ = ["BUILTIN_TEMPLATES", "builtin_template", "test_tokenizer_path"]
