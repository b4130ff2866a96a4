"""kvflow's commands as a user runs them: `doctor`, `inspect`, `new-transport`."""
