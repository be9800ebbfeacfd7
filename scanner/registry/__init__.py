"""The only code in gpubadge that talks to registries: `client.py` reads (manifests, blobs,
referrers; with `auth.py`'s token flow, `redirects.py`, `mirrors.py`, `retry.py`, `transfer.py`),
`push.py` writes (oras-py, with each registry's push account), `referrers.py` is the referrers
protocol over both. `reference.py` and `descriptors.py` parse what names and manifests say.
"""
