"""The HTTP face of one server: the edge, the app, routes and protocols.

Owns: the edge every request meets (`edge`: keys and roles via `auth`,
body limits, error rendering, fast routes), the app and its services
(`app`, `context`), routing by session (`session_routing`), serving on
hypercorn (`serving`), the fleet's redirects and fleet-wide views
(`fleet`), ``/metrics`` (`metrics`), the routes (`routes/`) and the
agent-facing protocols (`protocols/`: chat completions, Responses,
Anthropic Messages, server-sent events).

May import every wing below it: `config`, `turn`, `engines`, `export`,
`session`, `prompt`, `errors`, `tokens`, and `client` (the fleet's
rendezvous hashing). Never `emulator`.
"""
