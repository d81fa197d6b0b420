"""Unit tests of the SkyRL adapter (what needs no skyrl)."""
