"""Tools a model calls while it writes (GRPO with tools, `tfcli chat --tools`): their schemas
(schema.py), the built-ins that run no model-written code (builtin.py), the run's tools and a call
within limits (toolbox.py), and calls read in a chat template's own format (calls.py)."""
