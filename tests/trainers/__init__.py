"""The trainer adapters against the released trainers, each in its own
virtualenv (scripts/test-trainers)."""
