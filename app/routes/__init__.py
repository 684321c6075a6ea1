"""One router per resource: jobs, models, health (with metrics)."""
