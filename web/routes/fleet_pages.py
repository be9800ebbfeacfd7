"""HTML pages for placement: the fleet (`/servers`) and the eligibility explorer (`/eligibility`).

The handlers do the I/O (live inventory, finding or scanning the image) and hand view objects
(web/fleet_views.py) to the templates through web/templating.py's environment.
"""

from __future__ import annotations

from aiohttp import web

from web.fleet.live_fleet import fleet_index, live_servers
from web.lookups import image_report
from web.placement_requests import answer_options, eligibility_answer
from web.security import presented_token, token_matches
from web.state import services_of
from web.views.fleet_views import (
    FORM_FIELDS,
    EligibilityForm,
    FormError,
    ResultView,
    http_error_body,
    http_error_message,
    page_status,
    result_view,
    server_rows,
)
from web.views.templating import page


async def servers_page(request: web.Request) -> web.Response:
    rows = server_rows(await live_servers(request.app))
    return page(request, "servers.html", title="Servers · gpubadge", active="servers", servers=rows)


async def eligibility_page(request: web.Request) -> web.Response:
    form = EligibilityForm.from_query(request.query)

    def show(status: int = 200, error: str | None = None, result: ResultView | None = None) -> web.Response:
        return page(
            request,
            "eligibility.html",
            status=status,
            title="Eligibility · gpubadge",
            active="eligibility",
            form=form,
            fields=FORM_FIELDS,
            error=error,
            result=result,
        )

    if not form.submitted:
        return show()
    if not form.image:
        return show(400, "Enter an image reference, such as registry.example.com/team/app:1.0.")
    try:
        deploy = form.deploy_request()
    except FormError as exc:
        return show(400, str(exc))
    services = services_of(request)
    # A browser sends the token as HTTP Basic; without it only stored results are shown.
    may_scan = token_matches(services.settings.api_token, presented_token(request) or "")
    try:
        report = await image_report(services, form.image, may_scan=may_scan)
    except web.HTTPException as exc:
        if exc.status == 404 and not may_scan:
            return show(
                404,
                f"{form.image} has not been scanned yet. Request a scan on the Scans page"
                " (it needs the API token); its eligibility shows here once the scan is done.",
            )
        queued = http_error_body(exc).get("scan") if exc.status == 404 else None
        if isinstance(queued, str):
            return show(
                404,
                f"{form.image} has not been scanned yet: its scan took longer than this page waits, so it is"
                f" queued (scan {queued}, on the Scans page); reload this page once it is done.",
            )
        return show(page_status(exc), http_error_message(exc))
    try:
        options = answer_options(request, {})
    except web.HTTPException as exc:
        return show(400, http_error_message(exc))
    index = await fleet_index(request.app)
    index.view()  # built here, so a worker thread only reads the index
    body = await eligibility_answer(report, deploy, index, options)
    listed = [index.server(entry["server"]) for entry in body.get("eligible", [])]
    return show(result=result_view(report, body, [server for server in listed if server], form))


def setup_routes(app: web.Application) -> None:
    app.router.add_get("/servers", servers_page)
    app.router.add_get("/eligibility", eligibility_page)
