"""The typer commands, by group, and the studies they run (compare, probe, runs)."""
