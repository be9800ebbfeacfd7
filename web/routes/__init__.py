"""The service's route modules, one per resource. Each imports the shared modules below it
(web/lookups.py, web/live_fleet.py, web/state.py, ...) and never another route module."""
