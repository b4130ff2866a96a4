"""kvflow's connector as vLLM drives it, without an engine process: the adapter, vLLM's
real Scheduler and runner wrappers, kvflow's SchedulerEngine + WorkerEngine, stats."""
