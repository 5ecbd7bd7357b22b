"""Long-range evaluation tasks for `python -m jaxsb.eval` (host side: prompts, answers, scoring)."""
