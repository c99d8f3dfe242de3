"""The OpenAI-compatible server over the inference engine: app, protocol types, chat template, CLI."""
