"""The aiohttp service: registry webhooks, the JSON API, the HTML UI and badges, /healthz and
/metrics, and the Kubernetes admission webhook. The job runtime it calls (the intake, scan workers) is jobs/.

It reads top-down: web/app.py composes; the route modules in web/routes/ (one per resource)
import the shared modules below them (lookups, placement_requests, api_models, api_description,
state, errors; the rooms fleet/ (live_fleet, long_polls), views/ (templating and the view models)
and guards/ (connections, read_access); bounded_json and security on the ground floor) and never
each other.
"""
