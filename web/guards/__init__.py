"""What guards the service's doors before a route runs: every listener's connection guard
(`connections`: request-head timeout, body rate, connection cap) and the private-reads middleware
(`read_access`). The libraries they and every other floor use to read untrusted input and keep
secrets out of answers and logs (web/bounded_json.py, web/security.py) sit on the ground floor,
below web/settings.py and the senders' table, which this room reads."""
