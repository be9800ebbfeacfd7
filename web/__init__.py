"""The aiohttp service: webhooks, JSON API, and the HTML UI."""
