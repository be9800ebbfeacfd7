"""The aiohttp service: registry webhooks, the JSON API, the HTML UI and badges, /healthz and
/metrics, and the Kubernetes admission webhook. The job runtime it calls (the intake, scan workers) is jobs/.

It reads top-down: web/app.py composes; the route modules in web/routes/ (one per resource)
import the shared modules below them (lookups, live_fleet, long_polls, placement_requests,
api_models, api_description, templating and the view models, state, errors, security) and
never each other.
"""
