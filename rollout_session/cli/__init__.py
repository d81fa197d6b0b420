"""The ``rollout-session`` command: one module per subcommand, imported
only when that subcommand runs (so ``export --help`` loads no server).

May import anything; `cli.main` (the dispatcher) is the top of the layers.
"""
