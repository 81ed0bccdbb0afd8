"""Request and response bodies of the OpenAI-compatible and admin APIs."""
