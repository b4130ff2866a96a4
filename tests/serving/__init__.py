"""vLLM's OpenAI servers as a user runs them: `fs`, P/D with `kvflow proxy`, faults,
the demo, the soak script."""
