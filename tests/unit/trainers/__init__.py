"""Unit tests of the trainers wing."""
