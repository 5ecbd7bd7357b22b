"""Per-step planning: the Plan type, cost models and the planners that produce plans."""
