"""Contracts shared by the API and the workers: settings, job spec, storage layout, job records."""
