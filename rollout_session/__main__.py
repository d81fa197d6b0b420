"""`python -m rollout_session` is `rollout-session`."""

from .cli import main

main()
