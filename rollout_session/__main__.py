"""`python -m rollout_session` is `rollout-session`."""

from .cli.main import main

main()
