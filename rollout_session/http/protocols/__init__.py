"""The agent-facing protocols: chat completions (the fast route, below
Quart), the OpenAI Responses API and the Anthropic Messages API (each
decodes into a chat request and encodes the turn's answer back), and the
server-sent events they stream."""
