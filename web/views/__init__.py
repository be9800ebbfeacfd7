"""What the HTML pages show: pure view models (`image_views`, `fleet_views`, `nfd_view`), the SVG
badges (`badge_svg`), and the Jinja2 environment with its filters and security headers
(`templating`). The templates and static files themselves stay in web/templates and web/static."""
