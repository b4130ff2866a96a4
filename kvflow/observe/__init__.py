"""Events and what observes them: how kvflow says what it does.

What belongs here: the event vocabulary and its bus (`events`: every vLLM call kvflow
sees, every transfer it starts and how it ends, every input it refuses), and the
subscribers that turn events into views: transfer statistics for vLLM's metrics
(`stats`), a JSON-lines file (`log`, the `event_log` option) and the live stream
`kvflow inspect` reads (`stream`). Emitting an event never blocks a transfer; nothing
here moves KV bytes.
"""

__all__: list[str] = []
