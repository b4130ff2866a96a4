"""The `kvflow` command line: what belongs here is argument parsing and output, each
command's work being done by the room it belongs to. `main` (the entry point, and the
`kvflow.commands` entry point group through which the adapter adds `kvflow demo`),
`doctor` (prints `kvflow.doctor`'s findings), `inspect` and `inspect_state` (the live
view of `kvflow.observe.stream`), `scaffold` (a new transport package to start from);
`kvflow proxy` is `kvflow.pd.proxy`'s."""

__all__: list[str] = []
