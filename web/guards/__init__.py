"""What guards every connection and request before a route runs: the listeners' connection guard
(`connections`), bounded JSON parsing (`bounded_json`), redaction and credential checks
(`security`), and the private-reads middleware (`read_access`)."""
